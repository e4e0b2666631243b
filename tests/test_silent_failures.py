"""Issue 11: no failure may pass for "nothing to learn". Each test is one way a run used to go quiet."""

import json
import re

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import LESSON, TwoStep, compile_with, count, learner, make_trainset, metric, student_answer
from tfgrpo.optimizers import TrainingFreeGRPO


# 6 ----------------------------------------------------------------------------------------------------------
def test_a_disk_error_while_saving_a_rollout_surfaces_as_that_error(tmp_path):
    blocked = tmp_path / "steps" / "0000" / "rollouts"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("a file where the rollouts folder should be")  # every rollout's write fails
    with pytest.raises(OSError):
        compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), log_dir=str(tmp_path))
