"""The knobs of `TrainingFreeGRPO`, checked in one place.

The constructor checks every knob here, `tfgrpo.config.OptimizerConfig` runs the same checks on a config
file's `[optimizer]` section, and the knobs that change what a run computes make up the checkpoint's
fingerprint (a resume must use the same values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import dspy

from tfgrpo.optimizers.learning_paths import LearningPath


@dataclass(frozen=True)
class Knob:
    valid: Callable[[Any], bool]
    expected: str  # what a valid value is, for the error message
    fingerprinted: bool = False  # changes what a run computes: a resume must use the same value


def _int(low: int | None = None) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)


def _number(low: float, high: float | None = None, *, open_low: bool = False) -> Callable[[Any], bool]:
    def valid(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            return False
        return (v > low if open_low else v >= low) and (high is None or v <= high)

    return valid


def _is_path(v: Any) -> bool:
    return isinstance(v, LearningPath)


def _flag(*, fingerprinted: bool = False) -> Knob:
    """A True-or-False knob."""
    return Knob(lambda v: isinstance(v, bool), "True or False", fingerprinted=fingerprinted)


def _optional(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or valid(v)


KNOBS: dict[str, Knob] = {
    # group rollouts
    "num_generations": Knob(_int(1), "an integer >= 1", fingerprinted=True),
    "temperature": Knob(_number(0, 2), "a number in [0, 2]", fingerprinted=True),
    # schedule
    "num_train_epochs": Knob(_int(0), "an integer >= 0", fingerprinted=True),
    "batch_size": Knob(_int(1), "an integer >= 1", fingerprinted=True),
    "max_steps": Knob(_optional(_int(1)), "None or an integer >= 1"),  # more steps on a resume go on from the last
    "seed": Knob(_int(), "an integer", fingerprinted=True),
    # learning calls
    "reflection_lm": Knob(_optional(lambda v: isinstance(v, dspy.BaseLM)), "None or a dspy.BaseLM"),
    "max_operations_per_group": Knob(_int(1), "an integer >= 1", fingerprinted=True),
    "use_ground_truth": _flag(fingerprinted=True),
    "learning_path": Knob(lambda v: _is_path(v) or (isinstance(v, str) and v in ("auto", "paper", "contrast")),
                          "'auto', 'paper', 'contrast' or a LearningPath instance", fingerprinted=True),
    "constrained_decoding": Knob(lambda v: v in ("auto", "json_object", "json_schema", "off"),
                                 "'auto', 'json_object', 'json_schema' or 'off'"),
    # the library
    "max_experiences": Knob(_optional(_int(1)), "None or an integer >= 1", fingerprinted=True),
    "max_words_per_experience": Knob(_int(4), "an integer >= 4", fingerprinted=True),
    "target_predictors": Knob(_optional(lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and
                                        all(isinstance(n, str) for n in v)),
                              "None or a non-empty list of predictor names"),
    "max_demos": Knob(_int(0), "an integer >= 0", fingerprinted=True),
    "max_excerpt_lines": Knob(_int(0), "an integer >= 0", fingerprinted=True),
    "excerpt_whole_attempt": _flag(fingerprinted=True),
    "probe_size": Knob(_int(0), "an integer >= 0", fingerprinted=True),
    "keep_tied_demos": _flag(fingerprinted=True),
    "max_probed_edits": Knob(_int(1), "an integer >= 1", fingerprinted=True),
    # execution
    "num_threads": Knob(_int(1), "an integer >= 1"),
    "max_failure_rate": Knob(_number(0, 1), "a number in [0, 1]"),
    "metric_timeout_s": Knob(_optional(_number(0, open_low=True)), "None or a number of seconds > 0"),
    "max_cost": Knob(_optional(_number(0, open_low=True)), "None or a number > 0 (USD)"),
    "max_total_tokens": Knob(_optional(_int(1)), "None or an integer >= 1"),
    "log_dir": Knob(_optional(lambda v: isinstance(v, (str, os.PathLike))), "None or a folder path"),
    "progress": Knob(_optional(callable), "None or a callable progress(stage, done, total)"),
    "use_mlflow": _flag(),
}


def check_knob(name: str, value: Any) -> Any:
    """`value` if it is valid for the knob `name`, else a ValueError that says what is expected."""
    knob = KNOBS[name]
    if not knob.valid(value):
        raise ValueError(f"{name} must be {knob.expected}, not {value!r}")
    return value


def fingerprinted_knobs(optimizer: Any) -> dict[str, Any]:
    return {name: getattr(optimizer, name) for name, knob in KNOBS.items() if knob.fingerprinted}
