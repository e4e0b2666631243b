"""Optimizers (DSPy teleprompters) of tfgrpo."""

from tfgrpo.optimizers.direct_experiences import DirectExperiences
from tfgrpo.optimizers.parallel import TooManyFailuresError
from tfgrpo.optimizers.rewards import MetricError
from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO
from tfgrpo.tracking import join_dspy_autolog

join_dspy_autolog()  # an mlflow.dspy.autolog() called before this import patches these optimizers' compile too

__all__ = ["DirectExperiences", "MetricError", "TooManyFailuresError", "TrainingFreeGRPO"]
