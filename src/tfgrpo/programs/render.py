"""Text the learning calls read: fields, predictions and whole attempts, clipped to a sensible size.

Experiences go into every predictor, so an attempt of several predictor calls is shown call by call, from
the trace `run_program` (src/tfgrpo/optimizers/workers.py) records, not by its final prediction alone.
"""

from __future__ import annotations

import json
from typing import Any

from tfgrpo.base.util import clip, jsonable

MAX_ATTEMPT_CHARS = 6000  # an attempt shown to a learning call is cut to this size (head and tail kept)
MAX_FEEDBACK_CHARS = 2000  # and a metric's feedback on it to this one


def format_fields(values: dict[str, Any]) -> str:
    """`name: value` lines, values rendered as text (JSON for structured ones)."""
    return "\n".join(f"{k}: {as_text(v)}" for k, v in values.items())


def format_prediction(pred: Any, limit: int | None = MAX_ATTEMPT_CHARS) -> str:
    """A prediction as text for a learning call: ReAct trajectories step by step, then the other outputs (cut to
    `limit` characters; None: whole)."""
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
    text = "\n".join(p for p in parts if p)
    return text if limit is None else clip(text, limit)


def format_attempt(task_inputs: dict, outputs: dict | None, steps: list[dict], error: str | None, *,
                   completions: list[dict] = (), limit: int | None = MAX_ATTEMPT_CHARS) -> str:
    """An attempt as text, cut to `limit` characters (None: whole): the prediction alone when one predictor call made
    it, else every call in order; where the program returned several completions (`dspy.Predict(..., n=3)`), each of
    them after it.

    A step shows its outputs, and of its inputs only what is new: the task's own inputs are left out (the
    learning call sees them), an earlier step's output is named by reference, and an input that grew since
    the previous call (a ReAct trajectory) shows only its new tail.
    """
    if len(steps) <= 1:
        text = format_prediction(outputs, None) if outputs is not None else ""
    else:
        text = _format_steps(task_inputs, outputs or {}, steps)
    if len(completions) > 1:
        text += f"\nits {len(completions)} completions:\n" + "\n".join(
            f"[{i}] " + "; ".join(f"{k}: {as_text(v)}" for k, v in c.items()) for i, c in enumerate(completions, 1))
    if error:
        text = f"{text}\n(the program failed: {error})" if text else f"(the program failed: {error})"
    return text if limit is None else clip(text, limit)


def _format_steps(task_inputs: dict, outputs: dict, steps: list[dict]) -> str:
    task = {k: as_text(v) for k, v in jsonable(task_inputs).items()}
    produced: dict[str, str] = {}  # output text -> where it was produced
    last_input: dict[str, str] = {}
    lines = []
    for i, step in enumerate(steps, 1):
        lines.append(f"[{i}] {step['predictor']}")
        for name, value in step["inputs"].items():
            text = as_text(value)
            if not text or task.get(name) == text:
                continue
            before, last_input[name] = last_input.get(name), text
            if text in produced:
                lines.append(f"  {name}: (the {produced[text]})")
            elif before and text.startswith(before):
                lines.append(f"  {name}: (as in the previous call, then:) {text[len(before):].strip()}")
            else:
                lines.append(f"  {name}: {text}")
        for name, value in step["outputs"].items():
            produced.setdefault(as_text(value), f"{name} of [{i}]")
            lines.append(f"  -> {name}: {as_text(value)}")
    last = steps[-1]["outputs"]
    final = {k: v for k, v in outputs.items() if k != "trajectory" and last.get(k) != v}
    if final:  # the program changed or added outputs after its last predictor call: what the metric judged
        lines.append("final output:\n" + format_fields(final))
    return "\n".join(lines)


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def query_key(example, index: int) -> str:
    """How a training query is named in provenance and logs: its index, and its id where it has one."""
    ident = example.get("id") if hasattr(example, "get") else None
    return f"train#{index}" + (f":{ident}" if ident is not None else "")


def outcome(attempt) -> str:
    """How a scored attempt (`attempts.Scored`) was judged, as the learning calls read it."""
    verdict = "judged correct" if attempt.reward >= 1 else "judged wrong" if attempt.reward <= 0 else "partly right"
    return f"{verdict} (reward {attempt.reward:.2f})" + (f"; {attempt.feedback}" if attempt.feedback else "")


def count_tool_calls(outputs: dict | None) -> int:
    """Tool calls in a ReAct trajectory (the final 'finish' is not a tool call); 0 for other programs."""
    trajectory = (outputs or {}).get("trajectory")
    if not isinstance(trajectory, dict):
        return 0
    return sum(1 for k, v in trajectory.items() if k.startswith("tool_name_") and v != "finish")


def tool_observations(outputs: dict | None) -> list[str]:
    """What the tools returned during an attempt with these outputs (a ReAct-style trajectory's observations)."""
    trajectory = (outputs or {}).get("trajectory")
    if not isinstance(trajectory, dict):
        return []
    return [as_text(v) for k, v in trajectory.items() if k.startswith("observation_")]


FAILED_TOOL = ("Execution error", "refused", "search failed", "HTTP ", "could not open", "timed out")  # failures stay visible


def tool_actions(outputs: dict | None) -> list[str]:
    """A tool-using attempt (by its outputs) as what it did: each call with its arguments, then its answer. What a
    tool returned is left out (only its size, or a failure's message), so a learner sees the strategy, not the facts
    it found."""
    outputs = outputs or {}
    trajectory = outputs.get("trajectory")
    if not isinstance(trajectory, dict):
        return []
    lines, i = [], 0
    while f"tool_name_{i}" in trajectory:
        name, args = trajectory[f"tool_name_{i}"], trajectory.get(f"tool_args_{i}") or {}
        if name == "finish":
            break
        shown = ", ".join(f"{clip(as_text(v), 300)}" for v in args.values()) if isinstance(args, dict) else as_text(args)
        seen = as_text(trajectory.get(f"observation_{i}", ""))
        result = clip(seen, 160) if seen.startswith(FAILED_TOOL) else f"({len(seen)} characters returned)"
        lines.append(f"{i + 1}. {name}({shown}) -> {result}")
        i += 1
    answer = {k: v for k, v in outputs.items() if k not in ("trajectory", "reasoning")}
    lines.append(f"{i + 1}. final: {format_fields(answer)}" if answer else f"{i + 1}. no final answer")
    return lines
