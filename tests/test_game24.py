"""The Game of 24 task: data, the exact verifier, the partial-credit reward, and the code-writing student."""

import itertools
from fractions import Fraction

import dspy
import pytest

from scripted_lm import ScriptedLM, output_fields
from tfgrpo.tasks.game24 import (Game24Solver, check, evaluate_expression, extract_expression, game24_metric,
                                 game24_reward, load_game24, puzzle_numbers)


def ex(numbers):
    return dspy.Example(numbers=numbers).with_inputs("numbers")


@pytest.mark.parametrize("answer", ["(5 + 6 + 10) + 3",
                                    "(10 - 6) * 5 + 4",
                                    "The answer is (10-6)*5+4 = 24", "24 = 4 + 5 × (10 − 6)", "[(10 - 6) × 5] + 4"])
def test_solved_answers(answer):
    numbers = [4, 5, 6, 10] if "3" not in answer else [3, 5, 6, 10]
    solved, feedback = check(numbers, answer)
    assert solved, feedback


def test_exact_fractions():
    assert check([3, 3, 8, 8], "8 / (3 - 8 / 3)")[0]
    assert evaluate_expression("8 / (3 - 8 / 3)")[0] == Fraction(24)
    assert not check([1, 1, 1, 1], "(1 + 1) / 3 * 36")[0]  # other numbers


@pytest.mark.parametrize("numbers,answer,reason", [
    ([4, 5, 6, 10], "(10 - 6) * 5 + 5", "uses the numbers"),
    ([4, 5, 6, 10], "10 + 6 + 5 + 4", "equals 25"),
    ([4, 5, 6, 10], "4 * 6", "uses the numbers"),
    ([4, 5, 6, 10], "4 / (5 - 5) * 6 * 10", "division by zero"),
    ([4, 5, 6, 10], "-4 + 6 * 5 - 10 + 4", "only + - * /"),
    ([4, 5, 6, 10], "4.0 * 6 * (10 / 10)", "only + - * /"),
    ([4, 5, 6, 10], "2 ** 4 + 6 + 10 - 5 - 4 + 1", "only + - * /"),
    ([4, 5, 6, 10], "no idea", "no arithmetic expression"),
    ([4, 5, 6, 10], "", "no arithmetic expression"),
])
def test_refused_answers(numbers, answer, reason):
    solved, feedback = check(numbers, answer)
    assert not solved and reason in feedback


def test_extraction_takes_the_last_expression():
    assert extract_expression("trying 4+5\nfound: (10-6)*5+4\n") == "(10-6)*5+4"
    assert extract_expression("None") is None
    assert extract_expression("x" * 50) is None


def test_metric_is_strict_and_reward_gives_partial_credit():
    e = ex("4 5 6 10")
    right = dspy.Prediction(answer="(10-6)*5+4")
    assert game24_metric(e, right).score == 1.0 and game24_reward(e, right).score == 1.0
    right_numbers = dspy.Prediction(answer="4 + 5 + 6 + 10")
    assert game24_metric(e, right_numbers).score == 0.0 and game24_reward(e, right_numbers).score == 0.3
    other_numbers = dspy.Prediction(answer="4 * 6")
    assert game24_reward(e, other_numbers).score == 0.1
    assert game24_reward(e, dspy.Prediction(answer="")).score == 0.0
    assert game24_reward(e, dspy.Prediction(answer="None", ran=True)).score == 0.05  # ran, printed no expression
    assert game24_reward(e, dspy.Prediction(answer="", ran=False)).score == 0.0
    assert "equals 25" in game24_reward(e, right_numbers).feedback


def _solve(numbers):
    """Brute force over orders, operators and the five bracketings, with exact arithmetic."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b if b else None}
    shapes = ["(({a}{o}{b}){p}{c}){q}{d}", "({a}{o}({b}{p}{c})){q}{d}", "({a}{o}{b}){p}({c}{q}{d})",
              "{a}{o}(({b}{p}{c}){q}{d})", "{a}{o}({b}{p}({c}{q}{d}))"]
    for a, b, c, d in set(itertools.permutations(numbers)):
        for o, p, q in itertools.product(ops, repeat=3):
            for shape in shapes:
                expr = shape.format(a=a, b=b, c=c, d=d, o=o, p=p, q=q)
                try:
                    if evaluate_expression(expr)[0] == 24:
                        return expr
                except ValueError:
                    continue
    return None


def test_shipped_splits():
    train, test = load_game24("game24_train"), load_game24("game24_test")
    assert len(train) == 900 and len(test) == 100
    assert test[0].numbers == "4 5 6 10" and test[0].id == "game24-0901" and list(test[0].inputs()) == ["numbers"]
    assert not {e.id for e in train} & {e.id for e in test} and train[0].rank == 1
    with pytest.raises(ValueError, match="unknown Game of 24 set"):
        load_game24("nope")


def test_every_test_puzzle_is_solvable_and_verified():
    for e in load_game24("game24_test", limit=25):
        numbers = puzzle_numbers(e.numbers)
        expr = _solve(numbers)
        assert expr is not None and check(numbers, expr)[0], e.numbers


def _coder(code):
    def respond(messages, kwargs):
        assert output_fields(messages) == ["code"]
        assert "[4, 5, 6, 10]" in messages[-1]["content"]  # the numbers arrive as a Python list
        return {"code": code}
    return respond


def test_solver_runs_the_models_program_in_the_sandbox():
    search = ("```python\nimport itertools\nnums = [4, 5, 6, 10]\n"
              "print('trying')\nprint('(10-6)*5+4')\n```")
    dspy.configure(lm=ScriptedLM(_coder(search)))
    pred = Game24Solver()(numbers="4 5 6 10")
    assert pred.answer == "(10-6)*5+4" and "trying" in pred.output and pred.ran
    assert game24_metric(ex("4 5 6 10"), pred).score == 1.0


def test_solver_reports_a_crash_and_cannot_touch_the_host():
    dspy.configure(lm=ScriptedLM(_coder("print(open('/etc/hostname').read())")))
    pred = Game24Solver()(numbers="4 5 6 10")
    assert pred.answer == "" and "[stderr]" in pred.output and "Error" in pred.output and not pred.ran
    dspy.configure(lm=ScriptedLM(_coder("while True: pass")))
    pred = Game24Solver(timeout_s=2)(numbers="4 5 6 10")
    assert pred.answer == "" and "[stopped:" in pred.output
