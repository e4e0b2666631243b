"""The Game of 24 student: the model writes a short Python program, the sandbox runs it, and the last line
it prints is the answer. One LM call per attempt; the code runs in `tfgrpo.tasks.sandbox` (no network,
no host files, CPU and memory limits), never in this process."""

from __future__ import annotations

import re

import dspy

from tfgrpo.base.util import clip
from tfgrpo.tasks.sandbox import run_python

OUTPUT_CHARS = 600  # what is kept of the program's output (head and tail) for the learning calls


class WriteGame24Program(dspy.Signature):
    """Game of 24: combine the four given numbers with +, -, *, / and parentheses, using each number exactly
    once, so that the result is exactly 24. Write a short Python 3 program that finds such an expression
    and prints it. The last line your program prints is taken as the answer, so end by printing only the
    expression itself."""

    numbers: list[int] = dspy.InputField(desc="the four numbers of the puzzle")
    code: str = dspy.OutputField(desc="a complete Python 3 program")


def strip_fences(code: str) -> str:
    """The code inside a Markdown fence, if the model wrapped it in one."""
    fenced = re.findall(r"```[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", code, flags=re.S)  # an unclosed fence runs to the end
    return max(fenced, key=len) if fenced else code


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Game24Solver(dspy.Module):
    def __init__(self, *, timeout_s: float = 10.0):
        super().__init__()
        self.write_program = dspy.Predict(WriteGame24Program)
        self.timeout_s = timeout_s  # wall-clock limit of one run of the model's program

    def forward(self, numbers: str | list[int]) -> dspy.Prediction:
        if isinstance(numbers, str):  # "4 5 6 10", as the data files hold them
            numbers = [int(n) for n in numbers.split()]
        code = self.write_program(numbers=numbers).code or ""
        result = run_python(strip_fences(code), wall_timeout_s=self.timeout_s, cpu_time_s=int(self.timeout_s),
                            memory_mb=512)
        output = result.stdout.strip()
        if result.stderr.strip():
            output += "\n[stderr] " + result.stderr.strip()[-300:]
        if result.reason:
            output += f"\n[stopped: {result.reason}]"
        return dspy.Prediction(code=code, output=clip(output, OUTPUT_CHARS) or "(nothing printed)", answer=last_line(result.stdout),
                               ran=result.ok)
