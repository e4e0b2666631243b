"""Winning attempts kept as few-shot demos (max_demos): which attempts qualify, where they go, and that they
reach later rollouts, the compiled program and a saved file, without touching the student."""

import dataclasses

import dspy

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import compile_with, learner
from tfgrpo.optimizers.records import Demo, Group, Scored
from tfgrpo.optimizers.judge import best_demos, demo_candidates


def _groups(rewards_by_query):
    def attempt(qi, g, r):
        trace = [{"predictor": "p", "inputs": {"q": f"q{qi}"}, "outputs": {"a": f"a{qi}.{g}"}}]
        return Scored(outputs={"a": f"a{qi}.{g}"}, error=None, trace=trace, tool_calls=0, text="", reward=r, g=g)
    return [Group(index=qi, key=f"k{qi}", example=dspy.Example(q=f"q{qi}").with_inputs("q"),
                  attempts=tuple(attempt(qi, g, r) for g, r in enumerate(rewards)))
            for qi, rewards in rewards_by_query.items()]


def test_only_full_successes_ranked_by_group_advantage():
    groups = _groups({0: [1, 0, 0, 0], 1: [0.3, 0, 0, 0], 2: [1, 1, 1, 0], 3: [0, 1, 0, 1]})
    found = demo_candidates(groups, step=0)
    assert [d.query for d in found] == ["k0", "k2", "k3"]  # a partial success (k1) teaches its mistakes too
    assert found[2].trace[0]["outputs"] == {"a": "a3.1"}  # the first of equally good attempts
    best = best_demos(found, 2)
    assert [(d.query, d.advantage) for d in best] == [("k0", 0.75), ("k3", 0.5)]
    assert [d.query for d in demo_candidates(groups, step=0, min_reward=0.0)] == ["k0", "k1", "k2", "k3"]


def test_one_demo_per_query_and_earlier_steps_win_ties():
    old = Demo(query="k0", step=0, advantage=0.5, trace=[])
    new = [Demo(query="k0", step=1, advantage=0.75, trace=[]), Demo(query="k1", step=1, advantage=0.5, trace=[])]
    assert [(d.query, d.step) for d in best_demos([old] + new, 3)] == [("k0", 1), ("k1", 1)]
    assert [(d.query, d.step) for d in best_demos([dataclasses.replace(old, query="k2")] + new, 2)] == [
        ("k0", 1), ("k2", 0)]


def test_compiled_program_carries_a_winning_attempt_and_the_student_is_untouched(tmp_path):
    lm = ScriptedLM(learner())
    student = dspy.Predict("question -> answer")
    compiled = compile_with(lm, student, batch_size=2, max_demos=1, log_dir=str(tmp_path / "ckpt"))
    assert student.demos == []
    (demo,) = compiled.demos
    assert demo.answer == str(eval(demo.question.removeprefix("What is ").removesuffix("?")))  # a right answer
    assert compiled.detailed_results.to_dict()["steps"][0]["demos"]
    # the second step's attempts were shown the demo (DSPy puts a demo before the question, as a past turn)
    step2 = [c for c in lm.calls if kind_of(c["messages"]) == "student" and len(c["messages"]) > 2]
    assert step2 and all(demo.question in c["messages"][1]["content"] for c in step2)
    path = tmp_path / "program.json"
    compiled.save(str(path))
    fresh = dspy.Predict("question -> answer")
    fresh.load(str(path))  # stock DSPy
    assert [dict(d)["answer"] for d in fresh.demos] == [demo.answer]  # stock DSPy loads demos as dicts


def test_off_by_default():
    compiled = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"))
    assert compiled.demos == []
    assert compiled.detailed_results.to_dict()["steps"][0]["demos"] == []


def test_a_resumed_run_restores_the_demos(tmp_path):
    kw = dict(batch_size=2, max_demos=2, log_dir=str(tmp_path / "ckpt"))
    first = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), **kw)
    lm = ScriptedLM(learner())
    again = compile_with(lm, dspy.Predict("question -> answer"), **kw)
    assert lm.calls == []  # every step came from the checkpoint
    assert [d.toDict() for d in again.demos] == [d.toDict() for d in first.demos]


def test_a_student_that_carries_demos_keeps_them_beside_what_it_learns(caplog):
    """A student whose predictor already holds a demo (learned before, by this model or another) goes on from it: the
    run says so as it starts, the demo is one of the run's own (it competes for the max_demos slots: without a probe,
    by group advantage, where it counts 0) and the compiled program keeps it beside the demos this run learned, where a
    slot is left, instead of dropping it for them."""
    import logging

    student = dspy.Predict("question -> answer")
    student.demos = [dspy.Example(question="What is 100 + 110?", answer="210")]
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = compile_with(ScriptedLM(learner()), student, batch_size=2, max_demos=3)
    assert "carries what was learned before: 0 experience(s) and 1 demo(s)" in caplog.text
    assert [d.question for d in compiled.demos] == ["What is 0 + 10?", "What is 2 + 12?", "What is 100 + 110?"]
    assert [d.question for d in student.demos] == ["What is 100 + 110?"]  # the student is left as it was
