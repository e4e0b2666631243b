"""Optimizers (DSPy teleprompters) of tfgrpo."""

from tfgrpo.optimizers.direct_experiences import DirectExperiences
from tfgrpo.optimizers.parallel import TooManyFailuresError
from tfgrpo.optimizers.rewards import MetricError
from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO

__all__ = ["DirectExperiences", "MetricError", "TooManyFailuresError", "TrainingFreeGRPO"]
