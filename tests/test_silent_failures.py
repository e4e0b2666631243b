"""Issue 11: no failure may pass for "nothing to learn". Each test is one way a run used to go quiet."""

import json
import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import LESSON, TwoStep, compile_with, count, learner, make_trainset, metric, student_answer
from tfgrpo.optimizers import TrainingFreeGRPO


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
    assert type(info.value).__name__ == "MetricError"
    assert bad_metric.__name__ in message and re.search(says, message)
    assert re.search(r"What is \d+ \+ \d+\?", message), "the example is named"
    assert all(kind_of(c["messages"]) == "student" for c in lm.calls), "no learning from made-up rewards"


# 6 ----------------------------------------------------------------------------------------------------------
def test_a_disk_error_while_saving_a_rollout_surfaces_as_that_error(tmp_path):
    blocked = tmp_path / "steps" / "0000" / "rollouts"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the rollouts folder should be")  # every rollout's write fails
    with pytest.raises(OSError):
        compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), log_dir=str(tmp_path))
