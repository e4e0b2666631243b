"""The two students of the paper's math setting: direct chain of thought, and ReAct with a Python tool."""

from __future__ import annotations

import dspy

from tfgrpo.base.util import clip
from tfgrpo.tasks.sandbox import run_python

TOOL_OUTPUT_CHARS = 2000  # what the agent sees of one tool call's output


class SolveMath(dspy.Signature):
    """Solve the math problem. Reason carefully, check the result, and give only the final answer (a number
    or a simplified expression, without units) in the answer field."""

    question: str = dspy.InputField()
    answer: str = dspy.OutputField(desc="the final answer only")


def python(code: str) -> str:
    """Run Python 3 code in a sandbox and return what it printed. Use print() to see results; the
    standard library (math, fractions, itertools) is available; no files or network."""
    result = run_python(code, wall_timeout_s=15, cpu_time_s=10, memory_mb=1024)
    out = (result.stdout + ("\n" + result.stderr if result.stderr else "")).strip() or "(nothing printed)"
    if result.reason:
        out += f"\n[stopped: {result.reason}]"
    return clip(out, TOOL_OUTPUT_CHARS)


def direct_program() -> dspy.Module:
    return dspy.ChainOfThought(SolveMath)


def react_program(max_iters: int = 4) -> dspy.Module:
    return dspy.ReAct(SolveMath, tools=[python], max_iters=max_iters)


def make_program(kind: str, *, max_iters: int = 4) -> dspy.Module:
    if kind == "cot":
        return direct_program()
    if kind == "react":
        return react_program(max_iters)
    raise ValueError(f"unknown math program {kind!r}; choose 'cot' or 'react'")
