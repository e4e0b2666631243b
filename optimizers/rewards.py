"""Rewards: what the metric says of an attempt, or of its group's majority answer without ground truth."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

import dspy

from tfgrpo.optimizers.render import format_fields
from tfgrpo.util import clip


def metric_result(result: Any) -> tuple[float, str]:
    """(score, feedback) from what a metric returned: a number, or a dspy.Prediction(score=..., feedback=...)."""
    if hasattr(result, "score"):
        return float(result.score), str(getattr(result, "feedback", "") or "")
    return float(result), ""


class MetricError(RuntimeError):
    """The metric raised, or returned something that is not a reward in [0, 1]: the run cannot go on."""


def call_metric(metric: Callable, example: dspy.Example, prediction: dspy.Prediction) -> tuple[float, str]:
    """(score, feedback) of `metric` on one prediction; a metric that fails raises a `MetricError` naming the
    metric and the example, so that a typo never reads as "every attempt was wrong"."""
    where = f"metric {getattr(metric, '__name__', type(metric).__name__)!r} on the example " \
            f"{clip(format_fields(example.inputs()), 300)!r}"
    try:
        score, feedback = metric_result(metric(example, prediction, None))
    except Exception as exc:
        raise MetricError(f"{where} raised {type(exc).__name__}: {exc}") from exc
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
