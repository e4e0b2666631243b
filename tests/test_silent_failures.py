"""Issue 11: no failure may pass for "nothing to learn". Each test is one way a run used to go quiet."""

import json
import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import LESSON, TwoStep, compile_with, count, learner, make_trainset, metric, student_answer
from tfgrpo.optimizers import TrainingFreeGRPO


def reflection_outage():
    """A responder whose learning calls all fail at the connection; the student answers as usual."""
    sent = {"learning": 0}

    def respond(messages, kwargs):
        if kind_of(messages) == "student":
            return student_answer(messages, kwargs)
        sent["learning"] += 1
        raise ConnectionError("the reflection endpoint is down")

    return respond, sent


# 1 ----------------------------------------------------------------------------------------------------------
def misspelled_metric(example, pred, trace=None):
    return float(pred.answer == example.anwser)  # a typo: dspy.Example raises AttributeError


def percent_metric(example, pred, trace=None):
    return 100.0 * (pred.answer == example.answer)  # a score on the wrong scale


@pytest.mark.parametrize("bad_metric, says", [(misspelled_metric, "anwser"), (percent_metric, r"\[0, 1\]")],
                         ids=["raises", "out-of-range"])
def test_a_broken_metric_stops_the_run_naming_the_metric_and_the_example(bad_metric, says):
    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(bad_metric, num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4)
    with pytest.raises(Exception) as info:
        optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset())
    message = str(info.value)
    # (one that raises scores each attempt 0, as dspy.Evaluate does, and stops the step past max_failure_rate)
    assert type(info.value).__name__ == ("TooManyFailuresError" if bad_metric is misspelled_metric else "MetricError")
    assert bad_metric.__name__ in message and re.search(says, message)
    assert re.search(r"What is \d+ \+ \d+\?", message), "the example is named"
    assert all(kind_of(c["messages"]) == "student" for c in lm.calls), "no learning from made-up rewards"


# 2 ----------------------------------------------------------------------------------------------------------
def test_a_reflection_outage_is_not_a_finished_step_and_a_resume_redoes_the_learning(tmp_path):
    respond, sent = reflection_outage()
    policy = ScriptedLM(learner())
    with pytest.raises(RuntimeError, match="summary calls failed") as info:
        compile_with(policy, dspy.Predict("question -> answer"), reflection_lm=ScriptedLM(respond),
                     log_dir=str(tmp_path))
    assert "the reflection endpoint is down" in str(info.value) and str(tmp_path) in str(info.value)
    assert not list(tmp_path.glob("steps/*/done.json")), "a step whose learning failed is not done"

    policy_again, reflection = ScriptedLM(learner()), ScriptedLM(learner())
    compiled = compile_with(policy_again, dspy.Predict("question -> answer"), reflection_lm=reflection,
                            log_dir=str(tmp_path))
    assert policy_again.calls == [], "finished rollouts are reused"
    assert len(reflection.calls) == 16 + 4 + 1 and compiled.experience_library.texts() == [LESSON]


# 3 ----------------------------------------------------------------------------------------------------------
def test_an_unparseable_learning_reply_costs_at_most_two_calls_and_all_are_counted():
    lm = ScriptedLM(learner(garbage=True))
    compiled = compile_with(lm, dspy.Predict("question -> answer"), max_failure_rate=1.0)
    step = compiled.detailed_results.to_dict()["steps"][0]
    learning_calls = len(lm.calls) - 16
    assert learning_calls == 2 * (16 + 4), "one retry per summary and per group advantage, nothing more"
    assert step["learning_failures"] == 16 + 4
    assert sum(step["usage"][s]["calls"] for s in ("summary", "advantage", "consolidation")) == learning_calls


def test_the_dry_run_bound_covers_a_step_of_unparseable_replies():
    def respond(messages, kwargs):  # every first reply is unusable, students' included; every retry parses
        if kind_of(messages) == "student" and "Respond with a JSON object" in messages[-1]["content"]:
            return json.dumps(student_answer(messages, kwargs))
        if kind_of(messages) != "student" and "could not be used" in messages[0]["content"]:
            return learner()(messages, kwargs)
        return "nothing usable"

    lm = ScriptedLM(respond)
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4)
    bound = optimizer.plan(dspy.Predict("question -> answer"), make_trainset()).bound["per_step"]
    step = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset()).detailed_results.to_dict()["steps"][0]
    assert step["groups_kept"] == 4, "the JSON fallback let the students answer"
    for stage, usage in step["usage"].items():
        assert 0 < usage["calls"] <= bound[stage]["calls"], stage


def test_an_lm_error_in_a_learning_call_is_not_retried_as_if_it_were_a_parse_error():
    respond, sent = reflection_outage()
    with pytest.raises(RuntimeError):
        compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), reflection_lm=ScriptedLM(respond))
    assert sent["learning"] == 16 + 4, "one call per summary and group advantage (the LM client retries outages)"


def test_one_bad_reply_then_a_good_one_learns_with_two_calls():
    def respond(messages, kwargs):
        retry = "could not be used" in messages[0]["content"]
        if kind_of(messages) == "advantage" and not retry:
            return "no operations field here"
        return learner()(messages, kwargs)

    lm = ScriptedLM(respond)
    compiled = compile_with(lm, dspy.Predict("question -> answer"))
    assert count(lm, "advantage") == 2 * 4 and compiled.experience_library.texts() == [LESSON]


# 4 ----------------------------------------------------------------------------------------------------------
def test_budgets_hold_when_dspy_history_is_disabled():
    """A budget the plan expects to pay for one step's rollouts (so it starts a step) stops the run where the record
    counts it spent, with DSPy's history off (a budget that pays for no step sends nothing: tests/test_first_user.py)."""
    knobs = dict(num_generations=4, num_train_epochs=3, batch_size=2, prices={"dummy": {"input": 1e-6, "output": 1e-6}})

    def compile_without_history(**budget):
        with dspy.context(lm=ScriptedLM(learner()), disable_history=True):
            optimizer = TrainingFreeGRPO(metric, **knobs, **budget)
            return optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset())

    with dspy.context(lm=ScriptedLM(learner())):
        rollout = TrainingFreeGRPO(metric, **knobs).plan(dspy.Predict("question -> answer"),
                                                         trainset=make_trainset()).expected["per_step"]["rollout"]
    results = compile_without_history(max_total_tokens=rollout["prompt_tokens"] + rollout["completion_tokens"]
                                      ).detailed_results.to_dict()
    assert len(results["steps"]) < 6 and "max_total_tokens" in results["stopped_early"], results["stopped_early"]
    assert results["usage"]["policy"]["calls"] > 0 and results["usage"]["policy"]["prompt_tokens"] > 0
    # dollars are tokens times the price, so a cost budget holds without DSPy's history too
    results = compile_without_history(max_cost=rollout["cost"]).detailed_results.to_dict()
    assert len(results["steps"]) < 6 and "max_cost" in results["stopped_early"], results["stopped_early"]
    assert results["usage"]["policy"]["cost"] > 0


def test_an_enclosing_track_usage_still_sees_every_call():
    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    with dspy.track_usage() as tracker:
        TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset())
    assert len(tracker.usage_data[lm.model]) == len(lm.calls) == 16 + 16 + 4 + 1


# 5 ----------------------------------------------------------------------------------------------------------
def test_the_learning_calls_see_every_predictor_of_a_multi_step_attempt(tmp_path):
    def respond(messages, kwargs):
        if "[[ ## question ## ]]" in messages[-1]["content"] and output_fields(messages) == ["plan"]:
            return {"plan": "PLAN-7F3: add the ones, then the tens"}
        return learner()(messages, kwargs)

    lm = ScriptedLM(respond)
    compile_with(lm, TwoStep(), log_dir=str(tmp_path))
    summaries = [c for c in lm.calls if kind_of(c["messages"]) == "summary"]
    assert summaries and all("PLAN-7F3" in c["messages"][-1]["content"] for c in summaries)
    record = json.loads((tmp_path / "steps" / "0000.attempts.jsonl").read_text().splitlines()[0])
    assert [s["predictor"] for s in record["trace"]] == ["plan", "solve.predict"]
    assert record["trace"][0]["outputs"] == {"plan": "PLAN-7F3: add the ones, then the tens"}
    assert record["trace"][1]["inputs"]["plan"].startswith("PLAN-7F3")


# 6 ----------------------------------------------------------------------------------------------------------
def test_a_disk_error_while_recording_a_call_surfaces_as_that_error(tmp_path):
    (tmp_path / "calls.jsonl").mkdir()  # a folder where the record should be: every call's write fails
    with pytest.raises(OSError, match="calls.jsonl"):
        compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), log_dir=str(tmp_path))


# evaluation runs programs through the same helper --------------------------------------------------------------
def test_evaluation_records_a_failing_program_and_stops_on_a_failing_metric():
    from tfgrpo.evaluate import evaluate_program
    from tfgrpo.optimizers import MetricError

    def respond(messages, kwargs):
        if "What is 1 + 11?" in messages[-1]["content"]:
            return "no fields at all"
        return student_answer(messages, {"rollout_id": 0})

    lm = ScriptedLM(respond)
    rows = evaluate_program(dspy.Predict("question -> answer"), make_trainset(2), metric, lm=lm, num_runs=2)
    assert [(r["problem"], r["score"], bool(r["error"])) for r in rows] == [(0, 1.0, False)] * 2 + [(1, 0.0, True)] * 2
    assert rows[0]["usage_total"]["calls"] == len(lm.calls)
    with pytest.raises(MetricError, match="misspelled_metric"):
        evaluate_program(dspy.Predict("question -> answer"), make_trainset(2), misspelled_metric, lm=lm)


def failing_summaries(*queries):
    """A responder whose summary calls fail for the groups of `queries` (by their question); all else as `learner`."""
    ok = learner()

    def respond(messages, kwargs):
        if kind_of(messages) == "summary" and any(q in messages[-1]["content"] for q in queries):
            raise ConnectionError("the reflection endpoint dropped this one")
        return ok(messages, kwargs)

    return respond


def test_failed_summaries_are_checked_once_every_group_is_done_and_a_resume_sends_only_them_again(tmp_path):
    """One group's 4 summaries of 16 fail: under max_failure_rate=0.3 the stage's check passes (the group's advantage
    reads its raw attempts); with two groups' 8 the check stops the step, and a resume against a reflection LM that
    answers sends those 8 summaries again and the 2 advantages that read them, nothing else."""
    lm = ScriptedLM(failing_summaries("What is 0 + 10?"))
    compiled = compile_with(lm, dspy.Predict("question -> answer"), max_failure_rate=0.3)
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert count(lm, "advantage") == 4 and step["learning_failures"] == 4
    assert compiled.experience_library.texts() == [LESSON]

    lm = ScriptedLM(failing_summaries("What is 0 + 10?", "What is 1 + 11?"))
    with pytest.raises(RuntimeError, match="8 of 16 summary calls failed"):
        compile_with(lm, dspy.Predict("question -> answer"), max_failure_rate=0.3, log_dir=str(tmp_path))
    healthy = ScriptedLM(learner())
    compile_with(healthy, dspy.Predict("question -> answer"), max_failure_rate=0.3, log_dir=str(tmp_path))
    assert [count(healthy, k) for k in ("student", "summary", "advantage", "consolidation")] == [0, 8, 2, 1]