"""Optimizers (DSPy teleprompters) of tfgrpo."""

from tfgrpo.optimizers.training_free_grpo import TrainingFreeGRPO

__all__ = ["TrainingFreeGRPO"]
