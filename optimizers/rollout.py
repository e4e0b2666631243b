"""Running a program on one example, the same way for rollouts, the probe, validation and evaluation.

`with_own_lms` gives a copy of the program private copies of its LMs (for distinct samples, metering, and a
clean history of the caller's LM); `run_program` runs it and records the result or the error, with DSPy's
trace of every predictor call.
"""

from __future__ import annotations

import logging
from typing import Any

import dspy

from tfgrpo.base.util import clip, jsonable
from tfgrpo.optimizers.render import as_text, count_tool_calls
from tfgrpo.optimizers.rewards import score_attempt

logger = logging.getLogger(__name__)

MAX_VALUE_CHARS = 2000  # one recorded input or output value of a trace (head and tail kept)
CONTEXT_REFUSALS = ("contextwindowexceeded", "context length", "context_length_exceeded", "maximum context",
                    "context window", "exceeds the available context size")  # LiteLLM, OpenAI, vLLM, llama.cpp


def with_own_lms(program: dspy.Module, **overrides: Any) -> tuple[dspy.Module, list[dspy.BaseLM]]:
    """A deep copy of `program` whose predictors call private copies of their LMs (the predictor's own, else
    `dspy.settings.lm`), with `overrides` (such as rollout_id, temperature) set on the copies; and the copies."""
    program = program.deepcopy()
    copies: dict[int, dspy.BaseLM] = {}
    for name, predictor in program.named_predictors():
        base = predictor.lm or dspy.settings.lm
        if base is None:
            raise ValueError(f"predictor {name!r} has no LM: call dspy.configure(lm=dspy.LM(...)) or set one on it")
        if id(base) not in copies:
            copies[id(base)] = base.copy(**overrides)
        predictor.lm = copies[id(base)]
    return program, list(copies.values())


def run_program(program: dspy.Module, example: dspy.Example) -> tuple[dspy.Prediction | None, dict]:
    """Run `program` on `example`'s inputs. Returns the prediction (None when the program raised) and a JSON
    record of the run: `outputs`, `error` (the exception as text; an exception of the program is recorded,
    never raised), `trace` (every predictor call: name, inputs, outputs) and `tool_calls`."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            prediction = program(**example.inputs())
        outputs, error = jsonable(dict(prediction.items())), None
    except Exception as exc:
        prediction, outputs, error = None, None, f"{type(exc).__name__}: {exc}"
    record = {"outputs": outputs, "error": error, "trace": _record_trace(trace, program),
              "tool_calls": count_tool_calls(outputs)}
    return prediction, record


def run_and_score(program: dspy.Module, example: dspy.Example, metric, timeout_s: float | None) -> dict:
    """One attempt of `program` on `example`, scored: the one path of the probe and of validation (rollouts score
    theirs apart, once their group is known). The run's record with `reward` and `feedback`; an attempt that raised
    scores 0 without asking the metric; a metric call that times out scores 0, its message under `timeout`."""
    _, rec = run_program(program, example)
    return {**rec, **score_attempt(metric, example, rec, timeout_s)}


def _record_trace(trace: list, program: dspy.Module) -> list[dict]:
    names = {id(predictor): name for name, predictor in program.named_predictors()}
    return [{"predictor": names.get(id(predictor), type(predictor).__name__), "inputs": _clipped(inputs),
             "outputs": _clipped(dict(prediction.items()))} for predictor, inputs, prediction in trace]


def _clipped(values: dict[str, Any]) -> dict[str, Any]:
    kept = {}
    for name, value in jsonable(values).items():
        text = as_text(value)
        kept[name] = value if len(text) <= MAX_VALUE_CHARS else clip(text, MAX_VALUE_CHARS)
    return kept


def warn_context_refusals(step: int, errors: list[str]) -> None:
    """Say on the console (a warning) how many of a step's failed attempts the LM refused because the prompt did not
    fit its context window: they count as rollout failures, but the cure is another one (a shorter prompt or
    library, a larger context)."""
    refused = [e for e in errors if any(s in e.lower() for s in CONTEXT_REFUSALS)]
    if refused:
        logger.warning("Step %d: %d attempt(s) refused by the LM for context length: the prompt did not fit the "
                       "model's context window (they score 0; give the model a larger context, or a shorter prompt "
                       "or library). First: %s", step, len(refused), clip(refused[0], 300))
