"""Rewards: what the metric says of an attempt, or of its group's majority answer without ground truth."""

from __future__ import annotations

import inspect
import json
import numbers
from collections import Counter
from typing import Any, Callable

import dspy

from tfgrpo.optimizers.render import format_fields
from tfgrpo.util import clip


class MetricError(RuntimeError):
    """The metric raised, or returned something that is not a reward in [0, 1]: the run cannot go on."""


METRIC_RETURNS = "a number in [0, 1], a bool, or dspy.Prediction(score=..., feedback=...)"


def metric_takes_trace(metric: Callable) -> bool:
    """Whether `metric` is called as metric(example, prediction, trace) or, as dspy.Evaluate calls it, as
    metric(example, prediction). A TypeError says what is expected when it takes neither."""
    try:
        params = inspect.signature(metric).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: DSPy's optimizers pass the trace
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        return True
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 3 or len(positional) < 2:
        raise TypeError(f"metric {getattr(metric, '__name__', metric)!r} must take (example, prediction) or "
                        f"(example, prediction, trace=None); it takes ({', '.join(params)})")
    return len(positional) >= 3


def metric_result(result: Any) -> tuple[float, str]:
    """(score, feedback) from what a metric returned: a number or bool, or a dspy.Prediction(score=..., feedback=...).
    Anything else (a string such as "1", None, a list) is a TypeError: it is never read as a number."""
    score, feedback = (result.score, str(getattr(result, "feedback", "") or "")) if hasattr(result, "score") \
        else (result, "")
    if not isinstance(score, numbers.Real) and type(score).__name__ != "bool_":  # numpy's bool is no numbers.Real
        raise TypeError(f"returned {score!r} ({type(score).__name__}); a metric must return {METRIC_RETURNS}")
    return float(score), feedback


def call_metric(metric: Callable, example: dspy.Example, prediction: dspy.Prediction) -> tuple[float, str]:
    """(score, feedback) of `metric` on one prediction; a metric that fails raises a `MetricError` naming the
    metric and the example, so that a typo never reads as "every attempt was wrong"."""
    where = f"metric {getattr(metric, '__name__', type(metric).__name__)!r} on the example " \
            f"{clip(format_fields(example.inputs()), 300)!r}"
    args = (example, prediction, None) if metric_takes_trace(metric) else (example, prediction)
    try:
        result = metric(*args)
    except Exception as exc:
        raise MetricError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    try:
        score, feedback = metric_result(result)
    except TypeError as exc:
        raise MetricError(f"{where} {exc}") from None
    if not 0.0 <= score <= 1.0:
        raise MetricError(f"{where} returned {score}; rewards must lie in [0, 1]")
    return score, feedback


def score_attempt(metric: Callable, example: dspy.Example, record: dict) -> dict:
    """The reward and feedback of a recorded attempt; a failed attempt scores 0 without asking the metric."""
    if record["error"] or record["outputs"] is None:
        return {"reward": 0.0, "feedback": f"the attempt failed: {record['error']}"}
    score, feedback = call_metric(metric, example, dspy.Prediction(**record["outputs"]))
    return {"reward": score, "feedback": feedback}


def reference_example(example: dspy.Example, group: list[dict], use_ground_truth: bool) -> dspy.Example:
    """The example to score a group against: itself, or (without ground truth) its group's majority answers."""
    if use_ground_truth:
        return example
    labels = {k: majority([(r["outputs"] or {}).get(k) for r in group]) for k in example.labels().keys()}
    return dspy.Example(**example.inputs(), **labels).with_inputs(*example.inputs().keys())


def majority(values: list[Any]) -> Any:
    """The most common value (first seen wins ties); None values do not vote."""
    votes = Counter(json.dumps(v, sort_keys=True, default=str) for v in values if v not in (None, ""))
    if not votes:
        return None
    best = max(votes.values())
    for v in values:
        if v not in (None, "") and votes[json.dumps(v, sort_keys=True, default=str)] == best:
            return v
