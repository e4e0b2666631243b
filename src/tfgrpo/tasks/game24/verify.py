"""The Game of 24 reward: parse the model's expression and check it with exact arithmetic.

A solution is an arithmetic expression over the puzzle's four numbers, each used exactly once and no
other number, with the binary operators + - * / and parentheses, whose value is exactly 24 (fractions
are computed exactly, so 8 / (3 - 8/3) counts). Nothing is string-matched against a stored answer.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

import dspy

TARGET = 24
MAX_EXPRESSION_CHARS = 200  # longer "expressions" are not answers (and would be slow to parse)
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
              ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
_SYMBOLS = str.maketrans({"×": "*", "x": "*", "X": "*", "÷": "/", "−": "-", "–": "-", "[": "(", "]": ")",
                          "{": "(", "}": ")"})
_CANDIDATE = re.compile(r"[\d\s+\-*/().]*\d[\d\s+\-*/().]*")


def puzzle_numbers(text: str) -> list[int]:
    """The puzzle's numbers from its text ("4 5 6 10")."""
    return [int(n) for n in re.findall(r"\d+", str(text))]


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """Value and numbers of `expression`; ValueError (with the reason) if it is not a legal expression."""
    expression = expression.strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError("no expression" if not expression else "expression too long")
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    numbers: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"only + - * /, parentheses and whole numbers are allowed, found {ast.unparse(node)!r}")

    return walk(tree), numbers


def extract_expression(text: str) -> str | None:
    """The last arithmetic expression in `text` (a trailing "= 24" is dropped), or None."""
    lines = [line.translate(_SYMBOLS) for line in str(text or "").splitlines() if line.strip()]
    for line in reversed(lines):
        sides = [s for s in line.split("=") if s.strip()]
        for side in sides:  # "(a+b)*c = 24" or "24 = (a+b)*c": the side that has an operator
            found = [m.group().strip() for m in _CANDIDATE.finditer(side)]
            found = [f for f in found if re.search(r"\d\s*[-+*/]\s*[\d(]|\)\s*[-+*/]", f)]
            if found:
                return max(found, key=len)
    return None


def _judge(numbers: list[int], answer: str) -> tuple[bool, str, list[int] | None]:
    """(solved, feedback, the numbers a legal expression in `answer` uses, or None if there is none)."""
    expression = extract_expression(answer)
    if expression is None:
        return False, "no arithmetic expression found in the answer", None
    try:
        value, used = evaluate_expression(expression)
    except ValueError as exc:
        return False, f"{expression}: {exc}", None
    if Counter(used) != Counter(numbers):
        return False, f"{expression} uses the numbers {sorted(used)}, but the puzzle gives {sorted(numbers)}", used
    if value != TARGET:
        shown = str(value) if value.denominator == 1 else f"{value} (= {float(value):.4g})"
        return False, f"{expression} equals {shown}, not {TARGET}", used
    return True, f"{expression} = {TARGET}: solved", used


def check(numbers: list[int], answer: str) -> tuple[bool, str]:
    """(solved, feedback) for one answer to the puzzle with these numbers."""
    solved, feedback, _ = _judge(numbers, answer)
    return solved, feedback


def game24_metric(example, pred, trace=None) -> dspy.Prediction:
    """Accuracy: 1 when the prediction's answer is a legal expression of the puzzle's numbers worth 24, else 0."""
    solved, feedback = check(puzzle_numbers(example.numbers), getattr(pred, "answer", "") or "")
    return dspy.Prediction(score=float(solved), feedback=feedback)


PARTIAL_RIGHT_NUMBERS = 0.3  # an expression of exactly the puzzle's numbers, with the wrong value
PARTIAL_EXPRESSION = 0.1  # some arithmetic expression, but not of the puzzle's numbers
PARTIAL_RAN = 0.05  # the program ran to its end without an error, but printed no expression


def game24_reward(example, pred, trace=None) -> dspy.Prediction:
    """The training reward: 1 when solved, partial credit for getting closer, 0 for a crash or no output.

    A small model rarely solves a puzzle before it has learned anything, so with accuracy as the reward most
    groups of attempts tie at 0 and teach nothing. Partial credit orders "the program crashed" < "it ran"
    < "it printed an expression" < "an expression of the right numbers" < solved. Report results with
    `game24_metric`, never with this."""
    numbers = puzzle_numbers(example.numbers)
    solved, feedback, used = _judge(numbers, getattr(pred, "answer", "") or "")
    if solved:
        return dspy.Prediction(score=1.0, feedback=feedback)
    if used is not None:
        score = PARTIAL_RIGHT_NUMBERS if Counter(used) == Counter(numbers) else PARTIAL_EXPRESSION
    else:
        score = PARTIAL_RAN if getattr(pred, "ran", False) else 0.0
        feedback += "" if score else "; the program did not run to its end (see its error)"
    return dspy.Prediction(score=score, feedback=feedback)
