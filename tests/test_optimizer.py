"""TrainingFreeGRPO end to end on a scripted LM (answers keyed on prompt and rollout_id, never call order)."""

import io
import json
import logging
import re
import sys
import threading

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs.inject import OPEN_TAG

LESSON = "When adding two numbers, add the ones digits first and carry."


def make_trainset(n=4):
    return [dspy.Example(question=f"What is {i} + {i + 10}?", answer=str(2 * i + 10)).with_inputs("question")
            for i in range(n)]


def metric(example, pred, trace=None):
    ok = str(getattr(pred, "answer", "")).strip() == example.answer
    return dspy.Prediction(score=float(ok), feedback="right" if ok else f"expected {example.answer}")


def student_answer(messages, kwargs):
    """Right on even rollout_ids (or always once the lesson is in the prompt), wrong otherwise."""
    prompt = "\n".join(m["content"] for m in messages)
    q = re.findall(r"What is (\d+) \+ (\d+)\?", messages[-1]["content"])
    right = str(int(q[-1][0]) + int(q[-1][1])) if q else "0"
    learned = LESSON in messages[0]["content"]
    rid = kwargs.get("rollout_id") or 0
    answer = right if learned or rid % 2 == 0 else "-1"
    values = {f: "thinking" for f in output_fields(messages)}
    values["answer"] = answer
    if "next_thought" in values:  # ReAct: finish at once
        values.update(next_thought="done", next_tool_name="finish", next_tool_args={})
    assert prompt  # messages are never empty
    return values


def learner(ops=None, plan=None, garbage=False):
    """A responder: the student as above; learning calls propose and consolidate `LESSON` (or garbage)."""
    ops = ops if ops is not None else [{"action": "add", "ids": [], "text": LESSON}]

    def respond(messages, kwargs):
        kind = kind_of(messages)
        if kind == "student":
            return student_answer(messages, kwargs)
        if garbage:
            return "I think the library is fine as it is!!! {not json"
        if kind == "summary":
            return {"summary": "1. Added the numbers. 2. Forgot the carry."}
        if kind == "advantage":
            return {"operations": ops}
        return {"plan": plan if plan is not None else ops}

    return respond


def compile_with(lm, program, trainset=None, valset=None, **kw):
    dspy.configure(lm=lm)
    opts = dict(num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4)
    opts.update(kw)
    return TrainingFreeGRPO(metric, **opts).compile(program, trainset=trainset or make_trainset(), valset=valset)


def count(lm, kind):
    return sum(1 for c in lm.calls if kind_of(c["messages"]) == kind)


class TwoStep(dspy.Module):
    """A user program of two predictors."""

    def __init__(self):
        super().__init__()
        self.plan = dspy.Predict("question -> plan")
        self.solve = dspy.ChainOfThought("question, plan -> answer")

    def forward(self, question):
        return self.solve(question=question, plan=self.plan(question=question).plan)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("make", [
    lambda: dspy.Predict("question -> answer"),
    lambda: dspy.ChainOfThought("question -> answer"),
    lambda: dspy.ReAct("question -> answer", tools=[add], max_iters=3),
    TwoStep,
], ids=["Predict", "ChainOfThought", "ReAct", "TwoPredictors"])
def test_compiles_any_program_and_never_mutates_the_student(make):
    student = make()
    before = {n: p.signature.instructions for n, p in student.named_predictors()}
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, student)
    assert {n: p.signature.instructions for n, p in student.named_predictors()} == before
    assert not hasattr(student, "experience_library")
    assert compiled is not student and compiled.experience_library.texts() == [LESSON]
    for name, predictor in compiled.named_predictors():
        assert LESSON in predictor.signature.instructions, name
        assert predictor.signature.instructions.startswith(before[name])  # appended: ReAct's tool list survives
        assert predictor.lm is None  # no rollout LM copy leaks into the result
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["groups_kept"] == 4 and step["operations_applied"]["add"] == 1 and step["library_size"] == 1


def test_rollouts_are_distinct_samples_at_the_learning_temperature():
    lm = ScriptedLM(learner())
    compile_with(lm, dspy.Predict("question -> answer"), temperature=0.9)
    student = [c["kwargs"] for c in lm.calls if kind_of(c["messages"]) == "student"]
    assert len(student) == 16 and all(k["temperature"] == 0.9 for k in student)
    assert len({k["rollout_id"] for k in student}) == 4  # one per generation, shared across queries (prompts differ)


def test_call_budget_of_a_step():
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"))
    # B*G rollouts + G*M summaries + M advantages + 1 consolidation, M = 4 mixed groups
    assert (count(lm, "student"), count(lm, "summary"), count(lm, "advantage"), count(lm, "consolidation")) == (16, 16, 4, 1)
    usage = compiled.detailed_results.to_dict()["steps"][0]["usage"]
    assert {k: v["calls"] for k, v in usage.items()} == {"rollout": 16, "summary": 16, "advantage": 4, "consolidation": 1}
    assert all(v["prompt_tokens"] > 0 for v in usage.values())


def test_a_group_learns_while_another_still_rolls_out():
    """No stage barrier: the groups whose attempts are in are summarized and judged while a slow group still rolls
    out. The slow group's rollouts wait for the other groups' three group advantages; with a barrier after the
    rollouts they would wait in vain (and time out)."""
    base, lock, advantages, released = learner(), threading.Lock(), [0], threading.Event()

    def respond(messages, kwargs):
        kind, slow = kind_of(messages), "What is 0 + 10?" in messages[-1]["content"]
        if kind == "student" and slow:
            assert released.wait(timeout=20), "the slow group's rollouts waited for a stage barrier"
        reply = base(messages, kwargs)
        if kind == "advantage":
            with lock:
                advantages[0] += 1
                if advantages[0] == 3:
                    released.set()
        return reply

    lm = ScriptedLM(respond)
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_threads=8)
    assert compiled.experience_library.texts() == [LESSON]
    assert (count(lm, "student"), count(lm, "summary"), count(lm, "advantage"), count(lm, "consolidation")) == (16, 16, 4, 1)


def test_groups_with_equal_rewards_make_no_learning_call():
    def respond(messages, kwargs):  # always right: every group has std 0
        values = student_answer(messages, {"rollout_id": 0})
        assert kind_of(messages) == "student", "a learning call was made"
        return values

    lm = ScriptedLM(respond)
    compiled = compile_with(lm, dspy.Predict("question -> answer"))
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["groups_kept"] == 0 and step["frac_skipped_zero_std"] == 1.0
    assert len(lm.calls) == 16 and len(compiled.experience_library) == 0


def test_group_size_one_learns_from_each_attempt_against_the_ground_truth():
    """The paper's G = 1 ablation (its Table 3) still learns: every single attempt is summarized and judged."""
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_generations=1)
    assert count(lm, "student") == 4 and count(lm, "summary") == 4 and count(lm, "advantage") == 4
    assert compiled.experience_library.texts() == [LESSON]
    assert compiled.detailed_results.to_dict()["steps"][0]["groups_kept"] == 4


def test_group_size_one_on_the_contrast_path_is_refused():
    with pytest.raises(ValueError, match="num_generations=1"):
        compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), num_generations=1,
                     learning_path="contrast")


def test_garbage_from_the_learning_lm_stops_the_run_unless_tolerated_and_never_edits_the_library():
    with pytest.raises(RuntimeError, match="16 of 16 summary calls failed"):
        compile_with(ScriptedLM(learner(garbage=True)), dspy.Predict("question -> answer"))
    lm = ScriptedLM(learner(garbage=True))
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=2, max_failure_rate=1.0)
    assert len(compiled.experience_library) == 0
    steps = compiled.detailed_results.to_dict()["steps"]
    assert len(steps) == 2 and all(s["learning_failures"] == 16 + 4 for s in steps)  # summaries + advantages
    assert OPEN_TAG not in compiled.predictors()[0].signature.instructions


def test_invented_ids_are_refused_and_valid_operations_still_apply():
    ops = [{"action": "modify", "ids": ["E42"], "text": "When lost, guess."}, {"action": "delete", "ids": ["E7"]},
           {"action": "add", "ids": [], "text": LESSON}]
    lm = ScriptedLM(learner(ops=ops))
    compiled = compile_with(lm, dspy.Predict("question -> answer"))
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert compiled.experience_library.texts() == [LESSON]
    assert step["operations_rejected"] == 2 and step["operations_applied"]["add"] == 1


def test_proposals_cap_per_group():
    ops = [{"action": "add", "ids": [], "text": f"When case {i} holds, try method {i}."} for i in range(5)]
    lm = ScriptedLM(learner(ops=ops, plan=[]))
    compiled = compile_with(lm, dspy.Predict("question -> answer"), max_operations_per_group=2)
    assert compiled.detailed_results.to_dict()["steps"][0]["operations_proposed"] == 8  # 4 groups x 2


def test_learning_in_later_steps_sees_the_library_and_uses_reflection_lm():
    policy = ScriptedLM(learner())
    reflection = ScriptedLM(learner())
    dspy.configure(lm=policy)
    compiled = TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=2, batch_size=2, num_threads=4,
                                reflection_lm=reflection).compile(dspy.Predict("question -> answer"),
                                                                  trainset=make_trainset())
    assert all(kind_of(c["messages"]) == "student" for c in policy.calls)
    assert all(kind_of(c["messages"]) != "student" for c in reflection.calls)
    steps = compiled.detailed_results.to_dict()["steps"]
    # step 0 learns the lesson; with it in the prompt every later rollout is right: no contrast, no learning calls
    assert steps[0]["library_size"] == 1 and all(s["groups_kept"] == 0 for s in steps[1:])
    assert [s["mean_reward"] for s in steps[1:]] == [1.0] * 3


def test_without_ground_truth_no_answer_key_reaches_a_learning_call():
    trainset = make_trainset()
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), trainset=trainset, use_ground_truth=False)
    learning = [c for c in lm.calls if kind_of(c["messages"]) != "student"]
    assert learning, "contrast from the majority vote should trigger learning"
    for call in learning:
        text = json.dumps(call["messages"])
        assert "reference_answer" not in text and "correct answer" not in text
    assert compiled.detailed_results.to_dict()["steps"][0]["groups_kept"] == 4


def test_valset_keeps_the_best_epoch():
    calls = {"epoch": 0}

    def respond(messages, kwargs):
        kind = kind_of(messages)
        if kind == "student":
            return student_answer(messages, kwargs)
        if kind == "summary":
            return {"summary": "ok"}
        calls["epoch"] += kind == "consolidation"
        # epoch 1's consolidation deletes the lesson: validation must keep epoch 0's library
        if kind == "advantage":
            return {"operations": [{"action": "add", "text": LESSON}] if "E1" not in messages[-1]["content"] else
                    [{"action": "delete", "ids": ["E1"]}]}
        return {"plan": [{"action": "add", "text": LESSON}] if calls["epoch"] == 1 else [{"action": "delete", "ids": ["E1"]}]}

    lm = ScriptedLM(respond)
    dspy.configure(lm=lm)
    opt = TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=2, batch_size=4, num_threads=4)
    # validation runs without rollout_id: wrong unless the lesson is in the prompt
    compiled = opt.compile(dspy.Predict("question -> answer"), trainset=make_trainset(),
                           valset=[dspy.Example(question="What is 1 + 2?", answer="3").with_inputs("question")])
    epochs = compiled.detailed_results.to_dict()["epochs"]
    assert [e["val_score"] for e in epochs] == [1.0, 1.0]  # epoch 1 made no change (no contrast left)
    assert compiled.experience_library.texts() == [LESSON]


def test_clear_errors_for_bad_setup():
    with pytest.raises(ValueError, match="no LM"):
        TrainingFreeGRPO(metric).compile(dspy.Predict("question -> answer"), trainset=make_trainset())
    dspy.configure(lm=ScriptedLM(learner()))
    with pytest.raises(ValueError, match="not found"):
        TrainingFreeGRPO(metric, target_predictors=["nope"]).compile(dspy.Predict("q -> a"), trainset=make_trainset())
    with pytest.raises(ValueError, match="empty"):
        TrainingFreeGRPO(metric).compile(dspy.Predict("q -> a"), trainset=[])
    with pytest.raises(ValueError):
        TrainingFreeGRPO(metric, num_generations=0)
    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    with pytest.raises(ValueError, match="takes no teacher"):  # refused, not silently ignored
        TrainingFreeGRPO(metric).compile(dspy.Predict("q -> a"), trainset=make_trainset(), teacher=dspy.Predict("q -> a"))
    assert lm.calls == []


def test_target_predictors_limits_where_experiences_go():
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, TwoStep(), target_predictors=["solve.predict"])
    assert LESSON in compiled.solve.predict.signature.instructions
    assert OPEN_TAG not in compiled.plan.signature.instructions


def test_unparseable_rollouts_score_0_and_raising_ones_past_the_failure_rate_stop_the_run(caplog):
    def respond(messages, kwargs):
        if kind_of(messages) == "student" and (kwargs.get("rollout_id") or 0) % 2:
            return "no fields here at all"  # unparseable: the rollout raises, the program's own wrong answer
        return learner()(messages, kwargs)

    class Raising(dspy.Module):  # the same replies, but the program itself raises on the odd ones
        def __init__(self):
            super().__init__()
            self.predict = dspy.Predict("question -> answer")

        def forward(self, question):
            prediction = self.predict(question=question)
            if prediction.answer == "-1":
                raise RuntimeError("the program gave up")
            return prediction

    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        step = compile_with(ScriptedLM(respond), dspy.Predict("question -> answer"),
                            max_failure_rate=0.1).detailed_results.to_dict()["steps"][0]
    assert step["rollout_failures"] > 0 and step["failed_calls"] == 0 and step["groups_kept"] > 0
    assert re.search(r"Step 0: \d+ of 16 attempts raised, each scored 0", caplog.text)
    with pytest.raises(RuntimeError, match="attempts failed"):
        compile_with(ScriptedLM(learner()), Raising(), max_failure_rate=0.1)


def test_directly_generated_experiences_baseline():
    from tfgrpo.optimizers import DirectExperiences

    def respond(messages, kwargs):
        assert "20" not in messages[-1]["content"]  # answers of the shown examples never appear (10+10=20 etc.)
        return {"experiences": [LESSON, "When checking, redo the sum backwards.", "x " * 40, LESSON]}

    dspy.configure(lm=ScriptedLM(respond))
    compiled = DirectExperiences(num_experiences=3).compile(dspy.Predict("question -> answer"),
                                                             trainset=make_trainset(1))
    assert compiled.experience_library.texts() == [LESSON, "When checking, redo the sum backwards."]
    assert LESSON in compiled.signature.instructions


def test_a_token_budget_holds_inside_a_step_and_a_resume_with_a_larger_one_redoes_nothing(tmp_path):
    """Each unit is charged before it starts: the run stops where the next one would not fit, inside step 0, having
    overshot by no more than the units in flight; the same call with a larger budget goes on from the saved units."""
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=3, batch_size=2,
                            max_total_tokens=1, log_dir=str(tmp_path))
    results = compiled.detailed_results.to_dict()
    assert results["steps"] == [] and "max_total_tokens=1" in results["stopped_early"]
    first = count(lm, "student")
    assert 1 <= first <= 4 and results["usage"]["policy"]["calls"] == first  # at most the 4 threads' units in flight
    assert compiled.experience_library.texts() == []  # no step finished: nothing learned yet
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=3, batch_size=2,
                            log_dir=str(tmp_path))
    assert count(lm, "student") == 6 * 2 * 4 - first and compiled.detailed_results.stopped_early is None


def test_metric_call_budget_counts_rollouts_and_validation_and_is_charged_before_each_attempt():
    valset = [dspy.Example(question="What is 1 + 2?", answer="3").with_inputs("question")]
    # 2 queries x G = 4: 8 scored attempts per step, 2 steps an epoch, then 1 validation example
    for budget, steps, epochs, spent in ((8, 1, 0, 8), (12, 1, 0, 8), (17, 2, 1, 17), (34, 4, 2, 34)):
        lm = ScriptedLM(learner())
        compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=2,
                                batch_size=2, max_metric_calls=budget, valset=valset)
        results = compiled.detailed_results
        assert [s.metric_calls for s in results.steps] == [8] * steps and len(results.epochs) == epochs, budget
        assert count(lm, "student") == spent <= budget  # never one more than the budget
        assert (results.stopped_early is None) == (budget == 34), results.stopped_early  # 34: the whole run
        if budget == 12:  # 4 left, a step needs 8: none is started that could not finish
            assert results.stopped_early.startswith("budget max_metric_calls=12 cannot pay for another step: 4 left, "
                                                    "a step needs ~8 (8 attempts")
        elif results.stopped_early:
            assert results.stopped_early.startswith(f"budget max_metric_calls={budget} reached: {budget} metric calls")


def test_a_step_the_token_budget_left_cannot_pay_for_is_not_started():
    one = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), batch_size=2, max_steps=1)
    step = one.detailed_results.steps[0].usage
    total = sum(u["prompt_tokens"] + u["completion_tokens"] for u in step.values())
    rollouts = step["rollout"]["prompt_tokens"] + step["rollout"]["completion_tokens"]
    lm = ScriptedLM(learner())  # what step 0 spends and half of another step's rollouts
    compiled = compile_with(lm, dspy.Predict("question -> answer"), batch_size=2, max_total_tokens=total + rollouts // 2)
    results = compiled.detailed_results
    assert len(results.steps) == 1 and count(lm, "student") == 8
    assert results.stopped_early.startswith(f"budget max_total_tokens={total + rollouts // 2} cannot pay for another "
                                            f"step: {rollouts // 2:,} left, a step needs ~{rollouts:,} (8 attempts")


def test_max_steps_stops_part_way_through_an_epoch_and_a_resume_with_more_goes_on(tmp_path):
    lm = ScriptedLM(learner())
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=3, batch_size=2, max_steps=3,
                            log_dir=str(tmp_path))
    steps = compiled.detailed_results.to_dict()["steps"]
    assert [(s["step"], s["epoch"]) for s in steps] == [(0, 0), (1, 0), (2, 1)]
    assert count(lm, "student") == 3 * 2 * 4
    lm = ScriptedLM(learner())  # raising max_steps is not a new run: the 3 finished steps are reused
    compiled = compile_with(lm, dspy.Predict("question -> answer"), num_train_epochs=3, batch_size=2, max_steps=4,
                            log_dir=str(tmp_path))
    assert len(compiled.detailed_results.to_dict()["steps"]) == 4 and count(lm, "student") == 2 * 4

class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_without_a_progress_callback_every_stage_draws_a_bar_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"))
    shown = sys.stderr.getvalue()
    for stage, total in (("rollout", 16), ("reward", 16), ("summary", 16), ("advantage", 4), ("consolidation", 1)):
        assert re.search(rf"{stage}: 100%.*{total}/{total}", shown), stage
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file or CI: no bar redrawn with escape codes
    compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"))
    assert "100%" not in sys.stderr.getvalue() and "\r" not in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", Terminal())
    calls = []
    compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), progress=lambda *a: calls.append(a))
    assert "100%" not in sys.stderr.getvalue() and ("advantage", 4, 4) in calls
