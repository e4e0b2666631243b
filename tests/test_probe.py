"""Edits that earn their place: the probe (probe_size) keeps what helps on other training queries; an experience that
carries code (an excerpt) is held to a demo's standard."""

import re
import statistics

import dspy

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import LESSON, compile_with, learner, make_trainset, student_answer
from tfgrpo.base.util import digest
from tfgrpo.optimizers.judge import probe_queries
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import ExcerptOperation

BAD = "Always answer minus one when the sum looks large."


def _seed_with_even_probe_run(step=0):
    """A seed whose probe attempts of `step` run with an even rollout_id: the scripted student is right there."""
    return next(s for s in range(100) if int(digest([s, step, "probe"]), 16) % 2**31 % 2 == 0)


def _learner_with_a_bad_rule():
    def respond(messages, kwargs):
        kind = kind_of(messages)
        if kind == "student":
            values = student_answer(messages, kwargs)
            if BAD in messages[0]["content"]:
                values["answer"] = "-1"  # the bad rule makes every attempt wrong
            return values
        if kind == "summary":
            return {"summary": "1. Added the numbers."}
        ops = [{"action": "add", "ids": [], "text": LESSON}, {"action": "add", "ids": [], "text": BAD}]
        return {"operations": ops} if kind == "advantage" else {"plan": ops}
    return respond


def test_probe_keeps_the_rule_that_helps_and_drops_the_one_that_hurts(tmp_path):
    lm = ScriptedLM(_learner_with_a_bad_rule())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(8), batch_size=4,
                            learning_path="paper", probe_size=3, seed=_seed_with_even_probe_run(),
                            log_dir=str(tmp_path / "ckpt"))
    step = compiled.detailed_results.to_dict()["steps"][0]
    probe = step["probe"]
    assert [c["kept"] for c in probe["candidates"]] == [True, False]
    assert probe["base_mean"] == 1.0 and [c["mean"] for c in probe["candidates"]] == [1.0, 0.0]
    # (1 + 2 candidates) x 3 queries, but the bad rule stops after its first failure: it can no longer tie
    assert len(probe["queries"]) == 3 and step["usage"]["probe"]["calls"] == 7 and probe["attempts_saved"] == 2
    assert step["library_size"] == 1 and BAD not in compiled.experience_library.texts()  # LESSON kept in step 0
    # a resume reuses every probe attempt
    calls = len(lm.calls)
    compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(8), batch_size=4, learning_path="paper",
                 probe_size=3, seed=_seed_with_even_probe_run(), log_dir=str(tmp_path / "ckpt"))
    assert len(lm.calls) == calls


def test_probe_queries_are_outside_the_batch_and_stable():
    q = probe_queries(12, [0, 1, 2, 3], 4, seed=0, step=1)
    assert len(q) == 4 and not set(q) & {0, 1, 2, 3} and q == probe_queries(12, [0, 1, 2, 3], 4, seed=0, step=1)
    assert probe_queries(4, [0, 1, 2, 3], 3, seed=0, step=0)  # a batch that covers the trainset probes on it


def test_probe_needs_ground_truth():
    import pytest

    from tfgrpo.optimizers import TrainingFreeGRPO

    with pytest.raises(ValueError, match="use_ground_truth"):
        TrainingFreeGRPO(lambda e, p, t=None: 1.0, probe_size=2, use_ground_truth=False)


def test_the_library_renders_saves_and_loads_an_excerpt():
    lib = ExperienceLibrary()
    op = ExcerptOperation(action="add", text="Search every order and operator with eval.",
                          excerpt="for p in permutations(nums):\n    pass")
    assert lib.apply([op], step=0).num_applied == 1
    assert lib.render() == ("[E1] Search every order and operator with eval.\n    ```\n"
                            "    for p in permutations(nums):\n        pass\n    ```")
    again = ExperienceLibrary.from_state(lib.dump_state())
    assert again.render() == lib.render()
    state = lib.dump_state()
    del state["experiences"][0]["excerpt"]  # a library saved before excerpts existed
    assert ExperienceLibrary.from_state(state).render() == "[E1] Search every order and operator with eval."
    too_long = ExcerptOperation(action="add", text="Another rule entirely.", excerpt="x = 1\n" * 41)
    assert "over the limit" in lib.apply([too_long], step=1).rejected[0][1]


def test_an_excerpt_survives_stock_dspy_save_and_load_and_a_recompile(tmp_path):
    from tfgrpo.programs import apply_library
    from tfgrpo.programs.inject import library_from_instructions

    lib = ExperienceLibrary()
    lib.apply([ExcerptOperation(action="add", text="Search every order.", excerpt="for p in perms:\n    try(p)"),
               ExcerptOperation(action="add", text="Print only the expression.")], step=0)
    program = apply_library(dspy.Predict("question -> answer"), lib)
    program.save(str(tmp_path / "p.json"))
    fresh = dspy.Predict("question -> answer")
    fresh.load(str(tmp_path / "p.json"))  # stock DSPy: only the instructions come back
    again = library_from_instructions(fresh, ["self"])
    assert [(e.id, e.text, e.excerpt) for e in again] == [(e.id, e.text, e.excerpt) for e in lib]


def test_a_spare_probe_slot_retires_an_experience_that_does_not_help(tmp_path):
    """Step 0 keeps the good rule and drops the bad one; in step 1 nothing new is proposed, so the spare slot asks
    whether E1 must stay: the scripted student is right with or without it on the probe, so E1 is retired."""
    lm = ScriptedLM(_learner_with_a_bad_rule())
    seed = next(s for s in range(200) if all(int(digest([s, t, "probe"]), 16) % 2**31 % 2 == 0 for t in (0, 1)))
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(8), batch_size=4,
                            learning_path="paper", probe_size=3, max_probed_edits=3, seed=seed)
    first, second = compiled.detailed_results.steps
    assert [c["kept"] for c in first.probe["candidates"]] == [True, False]
    labels = [c["edit"] for c in second.probe["candidates"]]
    assert labels[-1] == "retire E1" and second.probe["candidates"][-1]["kept"] is True
    assert LESSON not in compiled.experience_library.texts()


class _Fixed(dspy.Module):
    """A program without an LM: answers right on the first `right` probe queries, else `wrong`."""

    def __init__(self, right, wrong):
        super().__init__()
        self.right, self.wrong = right, wrong

    def forward(self, question):
        n = int(question.split()[2])
        return dspy.Prediction(answer=str(2 * n + 10) if n < self.right else self.wrong)


def _partial(example, pred, trace=None):
    """Full credit when right; 0.3 for any number (the Game of 24's 'an expression of the right numbers')."""
    return 1.0 if pred.answer == example.answer else 0.3 if pred.answer.lstrip("-").isdigit() else 0.0


def _probe(programs, candidates):
    """A probe on 4 training queries, every attempt run in turn (one thread), nothing saved."""
    from tfgrpo.optimizers.judge import Probe
    from tfgrpo.optimizers.knobs import Knobs
    from tfgrpo.optimizers.runner import Run, Scope

    with Run(knobs=Knobs(num_threads=1), metric=_partial) as run, Scope(run, "probe") as scope:
        return Probe(candidates, [0, 1, 2, 3]).run(scope, lambda p, qi: programs[p], make_trainset(4))


def full_verdicts(programs, candidates):
    """The oracle: what a probe that ran every attempt keeps (each program's 4 rewards, the rules of `keeps`, then the
    best of each kind), and each candidate's (successes, mean)."""
    from tfgrpo.optimizers.judge import keeps

    rewards = [[_partial(ex, p(**ex.inputs())) for ex in make_trainset(4)] for p in programs]
    scores = [(sum(r >= 1 for r in rs), statistics.fmean(rs)) for rs in rewards]
    kept = []
    for c, cand in enumerate(candidates):
        wins = sum(a >= 1 > b for a, b in zip(rewards[1 + c], rewards[0]))
        losses = sum(b >= 1 > a for a, b in zip(rewards[1 + c], rewards[0]))
        kept.append(keeps(cand, scores[1 + c], scores[0], wins, losses))
    kinds = [lambda c: c.demo is not None, lambda c: c.demo is None and c.shows_code]
    kinds += [lambda c, t=t: t in c.targets for t in sorted({t for c in candidates for t in c.targets})]
    for kind in kinds:
        best = max(((scores[1 + i], i) for i, c in enumerate(candidates) if kept[i] and kind(c)), default=(None, None))[1]
        kept = [k and (not kind(c) or i == best) for i, (c, k) in enumerate(zip(candidates, kept))]
    return kept, scores[1:]


class _Table(dspy.Module):
    """A program without an LM whose reward on probe query n is `rewards[n]` (1, 0.3 or 0 under `_partial`)."""

    def __init__(self, rewards):
        super().__init__()
        self.rewards = rewards

    def forward(self, question):
        n = int(question.split()[2])
        return dspy.Prediction(answer={1.0: str(2 * n + 10), 0.3: "7", 0.0: "none"}[self.rewards[n]])


def test_stopping_early_gives_the_verdicts_of_the_full_probe_with_fewer_attempts():
    """Random probes: every candidate kind (demo, rule, excerpt, edits of one experience); the early-stopping probe keeps exactly what the full one keeps and never runs more attempts."""
    import random

    from tfgrpo.optimizers.judge import Candidate
    from tfgrpo.signatures.operations import ExcerptOperation, Operation

    rule = Operation(action="add", ids=[], text="Try every order of the numbers.")
    coded = ExcerptOperation(action="add", ids=[], text="Try every order of the numbers.", excerpt="print(24)")
    retire = Operation(action="delete", ids=["E1"], text="")
    kinds = [lambda: Candidate("demo", demo={}), lambda: Candidate("rule", operations=(rule,)),
             lambda: Candidate("excerpt", operations=(coded,)), lambda: Candidate("retire", operations=(retire,))]
    rng, saved = random.Random(0), 0
    for case in range(150):
        candidates = [rng.choice(kinds)() for _ in range(rng.randint(1, 4))]
        programs = [_Table([rng.choice([1.0, 1.0, 0.3, 0.0]) for _ in range(4)]) for _ in range(len(candidates) + 1)]
        kept, scores = full_verdicts(programs, candidates)
        early = _probe(programs, candidates)
        assert early.kept == kept, case
        assert [s for s, k in zip(early.scores, early.kept) if k] == [s for s, k in zip(scores, kept) if k]
        saved += 4 * len(candidates) - sum(early.ran)
    assert saved > 0


def test_partial_credit_alone_does_not_buy_a_demo_its_place():
    from tfgrpo.optimizers.judge import Candidate

    programs = [_Fixed(1, "none"),  # now: 1 solved, nothing else printed
                _Fixed(1, "7"),  # demo A: a number everywhere (partial credit), no new success
                _Fixed(3, "none"),  # demo B: two more successes
                _Fixed(0, "7")]  # rule C: one success fewer, higher mean
    candidates = [Candidate("A", demo={}), Candidate("B", demo={}), Candidate("C", operations=())]
    result = _probe(programs, candidates)
    assert result.base == (1, 0.25) and result.scores[1] == (3, 0.75)
    assert result.kept == [False, True, False]  # A only earns partial credit; C loses a success
    # A stopped once B was sure to be kept and A could no longer outrank it (3 of 4 queries run, 1.6 reward)
    assert result.ran == [3, 4, 4] and result.scores[0] == (1, statistics.fmean([1.0, 0.3, 0.3]))
    kept, scores = full_verdicts(programs, candidates)
    assert kept == result.kept and scores[0] == (1, 0.475)


def test_only_the_best_of_two_winning_demos_is_recorded_as_kept():
    from tfgrpo.optimizers.judge import Candidate

    programs = [_Fixed(1, "none"), _Fixed(2, "none"), _Fixed(3, "none")]  # now 1 solved; demo A 2; demo B 3
    candidates = [Candidate("A", demo={}), Candidate("B", demo={})]
    result = _probe(programs, candidates)
    assert result.kept == [False, True]  # both add successes, but the step keeps only B's demo set


def test_an_excerpt_must_add_successes_like_a_demo():
    """On the Game of 24 the 1.5B once picked a stub (`def solve(...): pass`) as an excerpt; a rule that only ties the
    current program stays, the same rule carrying code does not."""
    from tfgrpo.optimizers.judge import Candidate
    from tfgrpo.signatures.operations import ExcerptOperation, Operation

    rule = Operation(action="add", ids=[], text="Try every order of the numbers.")
    coded = ExcerptOperation(action="add", ids=[], text="Try every order of the numbers.", excerpt="pass")
    programs = [_Fixed(1, "none"), _Fixed(1, "none"), _Fixed(1, "none"), _Fixed(2, "none")]
    candidates = [Candidate("rule", operations=(rule,)), Candidate("stub", operations=(coded,)),
                  Candidate("solver", operations=(coded,))]
    assert _probe(programs, candidates).kept == [True, False, True]


def test_only_the_best_of_two_winning_excerpts_is_kept_and_a_plain_rule_beside_them_too():
    """Game of 24, seed 0: two sum-only solvers each added a success on the probe and both went into the library. Code
    competes as demos do: one excerpt per step, the best; a rule without code is judged on its own."""
    from tfgrpo.optimizers.judge import Candidate
    from tfgrpo.signatures.operations import ExcerptOperation, Operation

    rule = Operation(action="add", ids=[], text="Try every order of the numbers.")
    coded = ExcerptOperation(action="add", ids=[], text="Try every order of the numbers.", excerpt="print(24)")
    programs = [_Fixed(1, "none"), _Fixed(2, "none"), _Fixed(3, "none"), _Fixed(1, "none"), _Fixed(4, "none")]
    candidates = [Candidate("narrow", operations=(coded,)), Candidate("search", operations=(coded,)),
                  Candidate("rule", operations=(rule,)), Candidate("demo", demo={})]
    assert _probe(programs, candidates).kept == [False, True, True, True]  # a demo does not compete with an excerpt


def test_a_rewrite_and_a_retirement_of_the_same_experience_are_not_both_kept():
    """Game of 24, seed 0: `modify E1` and `retire E1` both tied the program at 0 solved and both were applied."""
    from tfgrpo.optimizers.judge import Candidate
    from tfgrpo.signatures.operations import Operation

    modify = Operation(action="modify", ids=["E1"], text="Try every order of the numbers.")
    retire = Operation(action="delete", ids=["E1"], text="")
    other = Operation(action="modify", ids=["E2"], text="Check for a division by zero.")
    programs = [_Fixed(1, "none"), _Fixed(2, "none"), _Fixed(1, "none"), _Fixed(1, "none")]
    candidates = [Candidate("modify E1", operations=(modify,)), Candidate("retire E1", operations=(retire,)),
                  Candidate("modify E2", operations=(other,))]
    assert _probe(programs, candidates).kept == [True, False, True]  # both pass; the better edit of E1 stays


def test_a_kept_demo_that_failed_its_own_query_is_shown_by_a_probe_success(tmp_path):
    """A candidate judged by what it does on other queries: when it wins the probe but had not solved its own query,
    the kept demo is its attempt on a probe query it solved (a demo always shows a success)."""
    from tfgrpo.optimizers.judge import Candidate

    def solver(right):
        def respond(messages, kwargs):
            n = int(re.findall(r"What is (\d+) \+", messages[-1]["content"])[-1])
            return {"answer": str(2 * n + 10) if n < right else "none"}
        program = dspy.Predict("question -> answer")
        program.lm = ScriptedLM(respond)
        return program

    result = _probe([solver(0), solver(2)], [Candidate("general", demo={})])
    assert result.kept == [True] and result.tried[1] == [0, 1, 2, 3] and result.solved[1] == [0, 1]
    assert result.traces[1][0][0]["outputs"]["answer"] == "10"  # query 0's own success


def test_stop_when_nothing_to_learn_ends_the_run_and_says_so():
    def respond(messages, kwargs):
        if kind_of(messages) == "student":
            values = student_answer(messages, kwargs)
            values["answer"] = "-1"  # every attempt wrong alike: no group ever has contrast
            return values
        return learner()(messages, kwargs)

    lm = ScriptedLM(respond)
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(12), batch_size=4,
                            learning_path="paper", stop_when_nothing_to_learn=True)
    result = compiled.detailed_results
    assert len(result.steps) == 1 and result.stopped_early.startswith("nothing left to learn")


def test_probe_power_falls_as_the_program_solves_more():
    from tfgrpo.optimizers.judge import probe_power

    assert probe_power(0.0, 8) > 0.99 and probe_power(1.0, 8) == 0.0 and probe_power(0.5, 0) == 0.0
    powers = [probe_power(r / 10, 8) for r in range(11)]
    assert powers == sorted(powers, reverse=True)
    assert abs(probe_power(0.6, 8) - 0.33) < 0.01  # the figure the knob's documentation gives
    assert probe_power(0.6, 16) > probe_power(0.6, 8)  # a larger probe resolves more


def test_a_probe_without_power_is_skipped_demos_fill_free_slots_and_the_run_stops(tmp_path):
    lm = ScriptedLM(learner())  # the student solves half its attempts: a probe of 3 cannot tell edits apart there
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(12), batch_size=4,
                            learning_path="paper", probe_size=3, max_demos=2, probe_min_power=0.5,
                            log_dir=str(tmp_path / "ckpt"))
    result = compiled.detailed_results
    step = result.to_dict()["steps"][0]
    assert len(result.steps) == 1 and result.stopped_early.startswith("more calls cannot pay")
    assert step["probe"]["skipped"].startswith("a probe of 3 queries has power") and step["probe"]["power"] < 0.5
    # the first look (2 of each group's 4 attempts) already left the probe no power: the step ended there
    assert step["metric_calls"] == 8 and step["usage"]["probe"].get("calls", 0) == 0  # and no probe attempt ran
    assert len(compiled.experience_library) == 0 and step["operations_proposed"] == 0  # no lesson could be kept:
    assert not any(step["usage"].get(s, {}).get("calls") for s in ("summary", "advantage", "consolidation"))  # none
    assert not any(kind_of(c["messages"]) != "student" for c in lm.calls)  # was asked for
    assert len(step["demos"]) == 2  # two of the model's own solved attempts, by group advantage
    assert LESSON not in compiled.predictors()[0].signature.instructions
    # with the gate open the same run probes
    opened = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), trainset=make_trainset(12),
                          batch_size=4, learning_path="paper", probe_size=3, max_demos=2, max_steps=1,
                          log_dir=str(tmp_path / "open"))
    assert opened.detailed_results.to_dict()["steps"][0]["probe"]["queries"]


def test_where_the_first_look_leaves_the_probe_power_the_groups_are_made_whole(tmp_path):
    lm = ScriptedLM(learner())  # half solved: a probe of 3 has power 0.25 there, enough for probe_min_power=0.2
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=make_trainset(12), batch_size=4,
                            learning_path="paper", probe_size=3, max_demos=2, probe_min_power=0.2, max_steps=1,
                            log_dir=str(tmp_path / "ckpt"))
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["probe"]["queries"] and "skipped" not in step["probe"]
    rollouts = [(c["messages"][-1]["content"], c["kwargs"]["rollout_id"]) for c in lm.calls
                if kind_of(c["messages"]) == "student" and c["kwargs"].get("rollout_id") is not None]
    step_zero = [r for r in rollouts if r[0] in {m for m, _ in rollouts[:8]}]  # the batch's questions
    assert len(step_zero) == len(set(step_zero)) == 16 == step["usage"]["rollout"]["calls"]  # 4 whole groups of 4:
    # the first look's 8 attempts reused, none made twice (the probe's queries are outside the batch)
    assert step["groups"] == 4 and step["operations_proposed"] >= 1  # lessons asked for once the groups were whole


def test_where_the_probe_is_skipped_free_slots_take_full_successes_of_groups_without_contrast_too(tmp_path):
    def always_right(messages, kwargs):  # every attempt solves its query: no group has contrast
        return student_answer(messages, {**kwargs, "rollout_id": 0}) if kind_of(messages) == "student" else \
            learner()(messages, kwargs)

    compiled = compile_with(ScriptedLM(always_right), dspy.Predict("question -> answer"), trainset=make_trainset(12),
                            batch_size=4, learning_path="paper", probe_size=3, max_demos=2, probe_min_power=0.5,
                            log_dir=str(tmp_path / "ckpt"))
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["probe"]["skipped"] and step["groups_kept"] == 0 and step["metric_calls"] == 8
    assert len(step["demos"]) == 2  # as BootstrapFewShot keeps its first solved traces
    assert len(compiled.predictors()[0].demos) == 2
