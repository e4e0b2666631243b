"""tfgrpo: Training-Free GRPO for DSPy programs.

Importing a `tfgrpo` package does nothing but define names: the optimizer is `tfgrpo.optimizers.TrainingFreeGRPO`,
and the `tfgrpo` command is `tfgrpo.cli`.
"""

__version__ = "0.1.0"
