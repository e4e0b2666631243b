"""Calls, tokens and cost of a stage's LM calls, measured so that no DSPy setting can blind a budget.

Calls and tokens come from DSPy's usage-tracker hook, which every LM call that reaches the provider reports
to, whether or not DSPy keeps its history (`dspy.configure(disable_history=True)`); replies served from the
cache are not counted. The price of a call is only kept in the history, so cost is read from there, and a
`max_cost` budget is refused while the history is off (see `history_kept`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import dspy
import pydantic
from dspy.utils.usage_tracker import UsageTracker


class UsageMeter(UsageTracker):
    """A usage tracker that every thread of a stage shares and that counts calls reporting no tokens too."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo) -> UsageMeter:
        return self  # DSPy's parallel executor gives each thread a copy of the tracker, which would lose the counts

    def add_usage(self, lm: str, usage_entry: dict[str, Any]) -> None:
        entry = {k: v.model_dump() if isinstance(v, pydantic.BaseModel) else v for k, v in (usage_entry or {}).items()}
        with self._lock:
            self.usage_data[lm].append(entry)


@contextmanager
def metered() -> Iterator[UsageMeter]:
    """Meter the LM calls made inside the block, in this thread and in those DSPy starts from it. An enclosing
    `dspy.track_usage()` still receives them."""
    with metered_stages(["all"]) as meters:
        with dspy.context(usage_tracker=meters["all"]):
            yield meters["all"]


@contextmanager
def metered_stages(stages) -> Iterator[dict[str, UsageMeter]]:
    """One meter per stage, for units that run with their stage's meter as DSPy's usage tracker (`run_flows`); an
    enclosing `dspy.track_usage()` still receives every call once."""
    meters, outer = {stage: UsageMeter() for stage in stages}, dspy.settings.usage_tracker
    try:
        yield meters
    finally:
        if outer is not None:
            for meter in meters.values():
                for lm, entries in meter.usage_data.items():
                    outer.usage_data[lm].extend(e for e in entries if e)


def history_kept() -> bool:
    """Whether DSPy records each call (with its price) in the LM's history."""
    return not dspy.settings.disable_history and dspy.settings.max_history_size > 0


def stage_usage(meter: UsageMeter, lms: list[dspy.BaseLM]) -> dict[str, float]:
    """Calls and tokens the meter saw; cost (USD, where LiteLLM knows the price) from the history of `lms`, the
    stage's own LM copies, which then forget it. Without a history the cost is left out, not reported as 0."""
    usage = meter_totals(meter)
    if history_kept():  # a reply from the cache has no usage and cost nothing now
        usage["cost"] = sum(float(h.get("cost") or 0.0) for lm in lms for h in lm.history if h.get("usage"))
    for lm in lms:
        lm.history.clear()
    return usage


def meter_totals(meter: UsageMeter) -> dict[str, float]:
    """Calls and tokens the meter has seen so far; safe to read while a stage's threads still report to it."""
    with meter._lock:
        entries = [e for lm_entries in list(meter.usage_data.values()) for e in lm_entries]
    return {"calls": len(entries),
            "prompt_tokens": sum(int(e.get("prompt_tokens") or 0) for e in entries),
            "completion_tokens": sum(int(e.get("completion_tokens") or 0) for e in entries),
            "cached_tokens": sum(int((e.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for e in entries)}


def add_usage(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


def over_budget(totals: dict[str, dict], *, max_total_tokens: int | None, max_cost: float | None,
                metric_calls: int = 0, max_metric_calls: int | None = None) -> str | None:
    """Why the run must stop, when the usage `totals` (per role) or the `metric_calls` so far reached a budget; else
    None."""
    if max_metric_calls is not None and metric_calls >= max_metric_calls:
        return f"{metric_calls} metric calls made, max_metric_calls={max_metric_calls}"
    tokens = sum(u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) for u in totals.values())
    cost = sum(u.get("cost", 0.0) for u in totals.values())
    if max_total_tokens is not None and tokens >= max_total_tokens:
        return f"{tokens} tokens used, max_total_tokens={max_total_tokens}"
    if max_cost is not None and cost >= max_cost:
        return f"${cost:.4f} spent, max_cost={max_cost}"
    return None
