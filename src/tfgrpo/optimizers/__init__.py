"""Optimizers (DSPy teleprompters) of tfgrpo.

The names below load on first use, so that importing one module of this package (such as `knobs`, which the
command line reads before anything runs) does not load DSPy and the whole optimizer."""

from __future__ import annotations

import importlib

_WHERE = {"BudgetExhausted": "record", "DirectExperiences": "direct_experiences", "MetricError": "rewards",
          "Plan": "plan", "RequestPacer": "spend", "TooManyFailuresError": "runner",
          "TrainingFreeGRPO": "training_free_grpo"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
