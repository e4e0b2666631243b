"""What each learned item is worth (issue 58): the attribution's arithmetic and its pruning, on a program whose items
have known effects, and the knobs as a compile uses them."""

import json

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import learner, make_trainset, metric
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import Demo
from tfgrpo.optimizers.record import Record
from tfgrpo.optimizers.runner import Run
from tfgrpo.optimizers.worth import FILLER, Attribution, Learned, _halves
from tfgrpo.programs.library import ExperienceLibrary


def resolved(optimizer, model):
    """The knobs a run with a reflection model of this name uses (the `auto` preset's values in place)."""
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[0]


def path_for(optimizer, model):
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[2]

# Each item's effect on the reward, written into the scripted student: E1 and the demo help, E2 does nothing, E3 hurts.
# The game is additive, so leave-one-out and Shapley values both equal these effects exactly.
EFFECTS = {"E1": 0.375, "E2": 0.0, "E3": -0.25, "D1": 0.375}
MARKERS = {"E1": "alpha rule", "E2": "beta rule", "E3": "gamma rule", "D1": "DEMO-Q"}


def student(messages, kwargs):
    prompt = "\n".join(m["content"] for m in messages)
    present = "".join(item for item, marker in MARKERS.items() if marker in prompt)
    return {**{f: "x" for f in output_fields(messages)}, "answer": present or "none"}


def reward(example, pred, trace=None):
    return 0.25 + sum(effect for item, effect in EFFECTS.items() if item in pred.answer)


def learned() -> Learned:
    library = ExperienceLibrary.recovered([(i, f"Apply the {MARKERS[i]} here.", "") for i in ("E1", "E2", "E3")])
    demo = Demo(query="k", trace=[{"predictor": "self", "inputs": {"question": MARKERS["D1"]},
                                   "outputs": {"answer": "42"}}])
    return Learned(library, [demo])


def queries(n=8):
    return [dspy.Example(question=f"q{i}", answer="-").with_inputs("question") for i in range(n)]


def measure(metric, items: Learned, examples: list, log_dir=None, **knobs):
    """The attribution of `items` of a one-predictor program on `examples`, in a run of its own (its calls recorded
    in `log_dir`, or in memory)."""
    with Run(knobs=Knobs(attribution=True, **knobs), metric=metric, record=Record(log_dir)) as run:
        return Attribution(run).measure(dspy.Predict("question -> answer"), ["self"], items, examples)


def attribute(tmp_path=None, **knobs):
    lm = ScriptedLM(student)
    dspy.configure(lm=lm)
    return measure(reward, learned(), queries(), tmp_path, num_threads=2, **knobs), lm


@pytest.mark.parametrize("max_items", [8, 2])
def test_each_item_is_worth_its_known_effect(max_items):
    (worth, kept), _ = attribute(attribution_max_items=max_items, attribution_permutations=3)
    assert worth.method == ("leave-one-out" if max_items == 8 else "shapley")
    assert {it.id: round(it.worth, 6) for it in worth.items} == EFFECTS
    assert all(it.ci95 == pytest.approx((it.worth, it.worth)) for it in worth.items)  # same effect on every query
    assert [it.kind for it in worth.items] == ["experience"] * 3 + ["demo"]
    assert worth.score == pytest.approx(0.75)  # 0.25 + 0.375 + 0.375 - 0.25
    assert worth.library == pytest.approx(0.5)  # nothing learned scores the 0.25 floor
    assert worth.control == pytest.approx(0.5)  # the irrelevant text triggers no effect
    assert worth.pruned == [] and worth.prune_check is None and kept.items() == learned().items()
    assert "E1 " not in worth.line("t", 0) and worth.line("game24", 1) == (
        "worth: task=game24 seed=1 items=4 library=+0.500 ci_low=+0.500 control=+0.500 ci_low_vs_control=+0.500 "
        "pruned=0")


def test_leave_one_out_runs_each_variant_once_and_the_control_has_the_learned_length():
    (worth, _), lm = attribute()
    # full, nothing, the control, and one variant per item, on 8 queries each
    assert worth.program_runs == 8 * (3 + 4) == len(lm.calls)
    full_prompt = next(c for c in lm.calls if all(m in "".join(x["content"] for x in c["messages"])
                                                 for m in MARKERS.values()))
    control = next(c for c in lm.calls if FILLER[:40] in c["messages"][0]["content"])
    assert not any(m in "".join(x["content"] for x in control["messages"]) for m in MARKERS.values())
    learned_chars = len("".join(x["content"] for x in full_prompt["messages"]))
    control_chars = len("".join(x["content"] for x in control["messages"]))
    assert abs(learned_chars - control_chars) < 0.2 * learned_chars  # the same order of length (formatting aside)


def test_prune_drops_what_does_not_help_and_checks_it_on_the_other_half(tmp_path):
    (worth, kept), _ = attribute(tmp_path, prune=True)
    assert worth.queries == 4 and worth.prune_check["queries"] == 4
    assert worth.pruned == ["E3", "E2"] and worth.prune_check["kept"] == "pruned"  # the least worth first
    assert worth.prune_check["difference"] == pytest.approx(0.25)  # without E3, on queries that chose nothing
    assert [e.id for e in kept.library] == ["E1"] and len(kept.demos) == 1
    # the half that measures (all, none, the control, 4 left out; then E1 and D1 alone as the prune tries it), then the
    # two programs on the other half
    assert worth.program_runs == 4 * (3 + 4) + 4 + 2 * 4
    # every call of the runs is recorded: measuring again sends nothing
    (again, _), lm = attribute(tmp_path, prune=True)
    assert again == worth and lm.calls == []


def test_a_prune_that_scores_worse_on_the_check_half_is_not_kept():
    choose = {x.question for x in _halves(queries(), 0)[0]}

    def noisy(example, pred, trace=None):  # E2 does nothing on the half that chooses, but carries the other half
        base = reward(example, pred)
        return base if example.question in choose or "E2" in pred.answer else max(0.0, base - 0.5)

    dspy.configure(lm=ScriptedLM(student))
    worth, kept = measure(noisy, learned(), queries(), prune=True, num_threads=2)
    assert worth.prune_check["dropped"] == ["E3", "E2"] and worth.prune_check["kept"] == "unpruned"
    assert worth.prune_check["difference"] == pytest.approx(-0.25)  # E3's 0.25 back, E2's 0.5 lost
    assert worth.pruned == [] and kept.items() == learned().items()


def test_knob_checks():
    with pytest.raises(ValueError, match="prune .* needs attribution=True"):
        Knobs(prune=True)
    with pytest.raises(ValueError, match="at least 4 attribution queries"):
        dspy.configure(lm=ScriptedLM(student))
        measure(reward, learned(), queries(3), prune=True)


def compile_with(lm, attribution_set=None, **knobs):
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4, **knobs)
    return optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(),
                             attribution_set=attribution_set)


def test_compile_measures_its_items_on_held_out_queries_and_prunes(tmp_path):
    lm = ScriptedLM(learner())
    valset = make_trainset(8)
    with pytest.raises(ValueError, match="pass valset= or attribution_set="):
        compile_with(lm, attribution=True)
    with pytest.raises(ValueError, match="only read with attribution=True"):
        compile_with(lm, valset)
    compiled = compile_with(lm, valset, attribution=True, prune=True, log_dir=str(tmp_path))
    worth = compiled.detailed_results.worth
    # the lesson was learned, but the deployed student (rollout_id None) answers right without it: worth 0, dropped
    assert [(it.id, it.worth) for it in worth.items] == [("E1", 0.0)] and worth.pruned == ["E1"]
    assert len(compiled.experience_library) == 0
    assert compiled.signature.instructions == dspy.Predict("question -> answer").signature.instructions
    assert json.loads((tmp_path / "worth.json").read_text())["pruned"] == ["E1"]
    students = sum(1 for c in lm.calls if kind_of(c["messages"]) == "student")
    again = compile_with(lm, valset, attribution=True, prune=True, log_dir=str(tmp_path))
    assert again.detailed_results.worth == worth
    assert sum(1 for c in lm.calls if kind_of(c["messages"]) == "student") == students  # all reused


def test_the_dry_run_bound_covers_the_attribution_and_refuses_one_without_held_out_queries(tmp_path):
    from test_trust_resume import cli_config
    from tfgrpo.cli import app
    from tfgrpo.optimizers.plan import attribution_runs
    from tfgrpo.testing.fake_lm_server import FakeLMServer
    from typer.testing import CliRunner

    lm = ScriptedLM(learner())
    compiled = compile_with(lm, make_trainset(6), attribution=True, max_demos=1)
    knobs = resolved(TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=4, attribution=True,
                             max_demos=1), "")
    bound = attribution_runs(knobs, len(make_trainset()), 6)
    assert compiled.detailed_results.worth.program_runs <= bound["runs"]
    with FakeLMServer() as server:
        refused = cli_config(tmp_path, server.api_base, "num_generations = 2\nattribution = true")
        dry = CliRunner().invoke(app, ["compile", str(refused), "--dry-run"])
        assert dry.exit_code == 2 and "pass valset= or attribution_set=" in dry.output
        named = refused.read_text().replace("eval_limit = 2", 'eval_limit = 2\nattribution_set = "gsm8k_train"\n'
                                            "attribution_offset = 100\nattribution_limit = 6")
        refused.write_text(named)
        dry = CliRunner().invoke(app, ["compile", str(refused), "--dry-run"])
        assert server.stats()["calls"] == 0
    assert dry.exit_code == 0 and "program runs of 1 call(s) on 6 held-out queries" in " ".join(dry.output.split())


def test_the_report_shows_each_item_with_its_worth(tmp_path):
    from tfgrpo.report import build_report

    (worth, _), _ = attribute(prune=True)
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "compiled.jsonl").write_text(json.dumps({"problem": 0, "run": 0, "score": 1.0}) + "\n")
    (run / "worth.json").write_text(json.dumps(worth.to_dict()))
    md, _ = build_report([run], tmp_path / "out")
    text = md.read_text()
    assert "| E3 (pruned) | experience | -0.250 [-0.250, -0.250] | Apply the gamma rule here. |" in text
    assert "vs an irrelevant text of their length | +0.500" in text and "the pruned program is kept" in text


def test_a_changed_library_is_measured_again(tmp_path):
    (first, _), _ = attribute(tmp_path)
    changed = learned()
    state = changed.library.dump_state()
    state["experiences"][2]["text"] = "Apply the alpha rule twice."  # E3 now says what E1 says: no longer harmful
    lm = ScriptedLM(student)
    dspy.configure(lm=lm)
    worth, _ = measure(reward, Learned(ExperienceLibrary.from_state(state), changed.demos), queries(), tmp_path,
                       num_threads=2)
    assert lm.calls and {it.id: round(it.worth, 6) for it in worth.items}["E3"] == 0.0 != first.items[2].worth


def test_nothing_learned_costs_nothing():
    dspy.configure(lm=(lm := ScriptedLM(student)))
    worth, kept = measure(reward, Learned(ExperienceLibrary(), []), queries())
    assert worth.items == [] and worth.program_runs == 0 and lm.calls == []


def test_of_two_items_that_stand_in_for_each_other_prune_drops_one():
    """E1 and the demo each give the same gain and together no more: each is worth 0 left out alone, and dropping both
    (what a prune by leave-one-out alone does) loses the gain; one at a time, the second stays."""
    def either(example, pred, trace=None):
        return 0.25 + 0.5 * ("E1" in pred.answer or "D1" in pred.answer) - 0.25 * ("E3" in pred.answer)

    dspy.configure(lm=ScriptedLM(student))
    worth, kept = measure(either, learned(), queries(), prune=True, num_threads=2)
    assert {it.id: it.worth for it in worth.items} == {"E1": 0.0, "E2": 0.0, "E3": -0.25, "D1": 0.0}
    assert worth.pruned == ["E3", "E1", "E2"] and [i for _, i, _ in kept.items()] == ["D1"]
    assert worth.prune_check["difference"] == pytest.approx(0.25) and worth.prune_check["kept"] == "pruned"
