"""An attempt's whole path through the program, for the learning calls.

Experiences go into every predictor, so the learning calls must see what every predictor did, not only the
final prediction. `run_program` (rollout.py) records each predictor call from DSPy's trace, as DSPy's own
optimizers read it; `format_attempt` writes the attempt as the summarizer reads it.
"""

from __future__ import annotations

from tfgrpo.optimizers.utils import as_text, clip, format_fields, format_prediction, jsonable


def format_attempt(task_inputs: dict, outputs: dict | None, steps: list[dict], error: str | None) -> str:
    """An attempt as text: the prediction alone when one predictor call made it, else every call in order.

    A step shows its outputs, and of its inputs only what is new: the task's own inputs are left out (the
    learning call sees them), an earlier step's output is named by reference, and an input that grew since
    the previous call (a ReAct trajectory) shows only its new tail.
    """
    if len(steps) <= 1:
        text = format_prediction(outputs) if outputs is not None else ""
    else:
        text = _format_steps(task_inputs, outputs or {}, steps)
    if error:
        text = f"{text}\n(the program failed: {error})" if text else f"(the program failed: {error})"
    return clip(text)


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
