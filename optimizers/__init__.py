"""Optimizers (DSPy teleprompters) of tfgrpo."""

from tfgrpo.optimizers.direct_experiences import DirectExperiences
from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO
from tfgrpo.optimizers.utils import MetricError, TooManyFailuresError

__all__ = ["DirectExperiences", "MetricError", "TooManyFailuresError", "TrainingFreeGRPO"]
