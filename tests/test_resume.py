"""Crash and resume: finished units in log_dir are never sent to an LM again."""

import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import make_trainset, metric
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.checkpoint import RunMismatchError


class Crash(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def learner(messages, kwargs):
    """Every step learns something new: the student ignores the library (right on even rollout_ids only),
    each group proposes a lesson named after its query, and consolidation keeps every proposal."""
    kind, last = kind_of(messages), messages[-1]["content"]
    if kind == "student":
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", last)[-1]
        right = (kwargs.get("rollout_id") or 0) % 2 == 0
        return {**{f: "x" for f in output_fields(messages)}, "answer": str(int(a) + int(b)) if right else "-1"}
    if kind == "summary":
        return {"summary": "1. Added. 2. Lost the carry."}
    if kind == "advantage":
        a = re.findall(r"What is (\d+) \+", last)[-1]
        return {"operations": [{"action": "add", "text": f"When a sum starts from {a}, check the carry."}]}
    return {"plan": [{"action": "add", "text": t} for t in re.findall(r'"text": "([^"]+)"', last)]}


def crashing(at_kind, nth):
    base, seen = learner, {"n": 0}

    def respond(messages, kwargs):
        if kind_of(messages) == at_kind:
            seen["n"] += 1
            if seen["n"] == nth:
                raise Crash()
        return base(messages, kwargs)

    return respond


def run(lm, log_dir, **kw):
    dspy.configure(lm=lm)
    opts = dict(num_generations=4, num_train_epochs=1, batch_size=2, num_threads=1, log_dir=str(log_dir))
    opts.update(kw)
    return TrainingFreeGRPO(metric, **opts).compile(dspy.Predict("question -> answer"), trainset=make_trainset())


@pytest.mark.parametrize("at_kind, nth", [("consolidation", 2), ("advantage", 3), ("summary", 5), ("student", 10)])
def test_resume_after_a_crash_redoes_nothing_and_ends_the_same(tmp_path, at_kind, nth):
    reference_lm = ScriptedLM(learner)
    reference = run(reference_lm, tmp_path / "clean")
    assert len(reference.experience_library) == 4  # two steps, two lessons each
    first = ScriptedLM(crashing(at_kind, nth))
    with pytest.raises(Crash):
        run(first, tmp_path / "run")
    resumed_lm = ScriptedLM(learner)
    resumed = run(resumed_lm, tmp_path / "run")
    assert resumed.experience_library.dump_state() == reference.experience_library.dump_state()
    # every call that returned before the crash was kept: together the two runs made the calls of one
    assert len(first.calls) + len(resumed_lm.calls) == len(reference_lm.calls)
    assert resumed.detailed_results["reused_units"] > 0


def test_a_finished_run_resumes_with_zero_calls(tmp_path):
    run(ScriptedLM(learner), tmp_path)
    lm = ScriptedLM(learner)
    again = run(lm, tmp_path)
    assert lm.calls == [] and again.experience_library.texts()


def test_changed_settings_are_refused(tmp_path):
    run(ScriptedLM(learner), tmp_path)
    with pytest.raises(RunMismatchError, match="knobs"):
        run(ScriptedLM(learner), tmp_path, num_generations=3)
