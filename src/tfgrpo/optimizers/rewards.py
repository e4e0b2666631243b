"""Rewards: the metric's protocol, and what it says of an attempt, or of its group's majority answer without ground
truth."""

from __future__ import annotations

import contextvars
import inspect
import json
import logging
import numbers
import threading
from collections import Counter
from typing import Any, Callable

import dspy

from tfgrpo.base.util import clip
from tfgrpo.optimizers.records import Attempt, Scored
from tfgrpo.programs.render import MAX_FEEDBACK_CHARS, format_fields

logger = logging.getLogger(__name__)


class MetricError(RuntimeError):
    """The metric raised, or returned something that is not a reward in [0, 1]: the run cannot go on."""


class MetricTimeout(TimeoutError):
    """The metric did not return within `metric_timeout_s`: that call counts as a failure, the run goes on."""


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


def call_metric(metric: Callable, example: dspy.Example, prediction: dspy.Prediction,
                timeout_s: float | None = None) -> tuple[float, str]:
    """(score, feedback) of `metric` on one prediction; a metric that fails raises a `MetricError` naming the
    metric and the example, so that a typo never reads as "every attempt was wrong". With `timeout_s`, a call that
    has not returned by then raises `MetricTimeout` (the call itself is abandoned on a daemon thread)."""
    where = f"metric {getattr(metric, '__name__', type(metric).__name__)!r} on the example " \
            f"{clip(format_fields(example.inputs()), 300)!r}"
    args = (example, prediction, None) if metric_takes_trace(metric) else (example, prediction)
    try:
        result = metric(*args) if timeout_s is None else _within(timeout_s, metric, args, where)
    except MetricTimeout:
        raise
    except Exception as exc:
        raise MetricError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    # a number or bool, or a dspy.Prediction(score=..., feedback=...); anything else (the string "1", None, a list) is
    # refused: it is never read as a number
    score, feedback = (result.score, str(getattr(result, "feedback", "") or "")) if hasattr(result, "score") \
        else (result, "")
    if not isinstance(score, numbers.Real) and type(score).__name__ != "bool_":  # numpy's bool is no numbers.Real
        raise MetricError(f"{where} returned {score!r} ({type(score).__name__}); a metric must return {METRIC_RETURNS}")
    score = float(score)
    if not 0.0 <= score <= 1.0:
        raise MetricError(f"{where} returned {score}; rewards must lie in [0, 1]")
    return score, feedback


def _within(timeout_s: float, metric: Callable, args: tuple, where: str) -> Any:
    """`metric(*args)` on a daemon thread (with this thread's DSPy settings), or `MetricTimeout` after `timeout_s`.
    A daemon thread, so that a call that never returns cannot keep the process alive."""
    box: dict = {}
    context = contextvars.copy_context()

    def target():
        try:
            box["result"] = context.run(metric, *args)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="tfgrpo-metric")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise MetricTimeout(f"{where} did not return within metric_timeout_s={timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def score_attempt(metric: Callable, example: dspy.Example, attempt: Attempt, timeout_s: float | None = None,
                  g: int = 0) -> Scored:
    """The attempt with its reward and feedback; an attempt that raised scores 0 without asking the metric. A metric
    call that times out (`timeout_s`) scores 0 too, with the timeout under `timeout`, and so does one that raises,
    its error under `metric_error` (a metric that returns what is no reward raises `MetricError`). A
    feedback longer than `MAX_FEEDBACK_CHARS` is cut to it (head and tail kept), its length before in
    `feedback_chars`: every learning call reads it."""
    if attempt.error or attempt.outputs is None:
        return Scored.of(attempt, {"reward": 0.0, "feedback": f"the attempt failed: {attempt.error}"}, g)
    try:
        score, feedback = call_metric(metric, example, as_returned(attempt), timeout_s)
    except MetricTimeout as exc:
        return Scored.of(attempt, {"reward": 0.0, "feedback": "the metric timed out on this attempt",
                                   "timeout": str(exc)}, g)
    except MetricError as exc:
        if attempt.bare:  # a program that returned no Prediction (dspy.BestOfN's None when every try failed): a
            # metric that cannot read it scores it 0, as dspy.Evaluate's failure_score does
            returned = attempt.outputs["returned"]
            return Scored.of(attempt, {"reward": 0.0, "feedback": f"the program returned {returned!r} and the metric "
                                                                  f"raised on it: {exc.__cause__ or exc}"}, g)
        if exc.__cause__ is None:  # it returned what no reward is: a bug of the metric's, the same on every attempt
            raise
        # it raised on this attempt: scored 0 as dspy.Evaluate scores it (its failure_score) and counted; more than
        # max_failure_rate of a step's attempts stops the step, naming the first
        return Scored.of(attempt, {"reward": 0.0, "feedback": "the metric raised on this attempt",
                                   "metric_error": str(exc)}, g)
    if len(feedback) > MAX_FEEDBACK_CHARS:
        return Scored.of(attempt, {"reward": score, "feedback": clip(feedback, MAX_FEEDBACK_CHARS),
                                   "feedback_chars": len(feedback)}, g)
    return Scored.of(attempt, {"reward": score, "feedback": feedback}, g)


def as_returned(attempt: Attempt):
    """What the program returned, as the metric receives it (as `dspy.Evaluate` gives it): the prediction itself, or
    for an attempt made elsewhere with its outputs alone (`learn_from_groups` on saved rollouts), a prediction of
    them."""
    if attempt.prediction is not None or attempt.bare:
        return attempt.prediction
    return dspy.Prediction(**attempt.outputs)


def reference_example(example: dspy.Example, group: list[Attempt], use_ground_truth: bool) -> dspy.Example:
    """The example to score a group against: itself, or (without ground truth) its group's majority answers: per label,
    the most common value of the group's outputs (the first seen wins a tie; an empty one does not vote)."""
    if use_ground_truth:
        return example
    labels = {}
    for k in example.labels().keys():
        values = [v for a in group if (v := (a.outputs or {}).get(k)) not in (None, "")]
        keyed = {json.dumps(v, sort_keys=True, default=str): v for v in reversed(values)}  # the first seen kept
        votes = Counter(json.dumps(v, sort_keys=True, default=str) for v in values)  # counts, in order first seen
        labels[k] = keyed[votes.most_common(1)[0][0]] if votes else None
    return dspy.Example(**example.inputs(), **labels).with_inputs(*example.inputs().keys())
