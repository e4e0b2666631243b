"""Small helpers of the optimizer: parallel map, text rendering of examples and predictions, the metric's call."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from typing import Any, Callable

import dspy
import tqdm
from dspy.utils.parallelizer import ParallelExecutor

MAX_ATTEMPT_CHARS = 6000  # an attempt shown to a learning call is cut to this size (head and tail kept)


class Failed:
    """A unit of work that raised, kept as a value so the caller can count it and go on."""

    def __init__(self, error: BaseException):
        self.error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"Failed({self.error!r})"


class TooManyFailuresError(RuntimeError):
    """More of a stage's units failed than `max_failure_rate` allows: the step stops, unfinished."""


class StageBar:
    """A tqdm bar for one stage, as DSPy draws its own: the progress callback when the caller gives none."""

    def __init__(self):
        self.bar: tqdm.tqdm | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm.tqdm(total=total, desc=stage, dynamic_ncols=True, file=sys.stdout)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def run_parallel(fn: Callable, items: list, *, num_threads: int, stage: str,
                 progress: Callable[[str, int, int], None] | None = None) -> list:
    """Map `fn` over `items` on `num_threads` threads with DSPy settings propagated; order is kept.

    Nothing is swallowed: the first item that raises stops the map (items not yet started are skipped, those
    running finish) and its exception is raised again here. A failure that is a result, such as an LM call
    that may fail, must be caught inside `fn` (and returned as a `Failed`). `progress(stage, done, total)` is
    called after every finished item (from worker threads, under a lock); None draws a tqdm bar.
    """
    if not items:
        return []
    progress = progress or StageBar()
    lock, done, errors = threading.Lock(), [0], []

    def guarded(item):
        if errors:
            return None
        try:
            result = fn(item)
        except Exception as exc:
            with lock:
                errors.append(exc)
            return None
        with lock:
            done[0] += 1
            progress(stage, done[0], len(items))
        return result

    # timeout=0 turns off the executor's straggler re-submission, which would send duplicate LM calls.
    executor = ParallelExecutor(num_threads=num_threads, max_errors=len(items) + 1, disable_progress_bar=True,
                                timeout=0)
    results = executor.execute(guarded, items)
    if errors:
        raise errors[0]
    return results


def format_fields(values: dict[str, Any]) -> str:
    """`name: value` lines, values rendered as text (JSON for structured ones)."""
    return "\n".join(f"{k}: {as_text(v)}" for k, v in values.items())


def format_prediction(pred: Any) -> str:
    """A prediction as text for a learning call: ReAct trajectories step by step, then the other outputs."""
    if pred is None:
        return "(no output)"
    values = dict(pred.items()) if hasattr(pred, "items") else {"output": pred}
    parts = []
    trajectory = values.pop("trajectory", None)
    if isinstance(trajectory, dict):
        parts.append("trajectory:\n" + "\n".join(f"  {k}: {as_text(v)}" for k, v in trajectory.items()))
    elif trajectory is not None:
        parts.append(f"trajectory: {as_text(trajectory)}")
    parts.append(format_fields(values))
    return clip("\n".join(p for p in parts if p))


def clip(text: str, limit: int = MAX_ATTEMPT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def jsonable(value: Any) -> Any:
    """`value` made JSON-safe (for checkpoints): structures kept, anything else as text."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


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


def count_tool_calls(outputs: dict | None) -> int:
    """Tool calls in a ReAct trajectory (the final 'finish' is not a tool call); 0 for other programs."""
    trajectory = (outputs or {}).get("trajectory")
    if not isinstance(trajectory, dict):
        return 0
    return sum(1 for k, v in trajectory.items() if k.startswith("tool_name_") and v != "finish")


def majority(values: list[Any]) -> Any:
    """The most common value (first seen wins ties); None values do not vote."""
    votes = Counter(json.dumps(v, sort_keys=True, default=str) for v in values if v not in (None, ""))
    if not votes:
        return None
    best = max(votes.values())
    for v in values:
        if v not in (None, "") and votes[json.dumps(v, sort_keys=True, default=str)] == best:
            return v
