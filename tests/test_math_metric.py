"""The math reward: answer extraction, equivalence on real rows of every shipped set, threads, odd input."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dspy
import pytest

from tfgrpo.tasks.math import extract_answer, is_equivalent, load_math, math_metric
from tfgrpo.tasks.math import metric as metric_module

SETS = ["dapo100", "aime24", "aime25", "gsm8k_test", "math500"]


@pytest.fixture(scope="module")
def rows():
    """Every shipped evaluation set, indexed by row id."""
    return {name: {ex.id: ex for ex in load_math(name)} for name in SETS}


# (set, row id, a model-style output that states the gold answer in another format, a wrong output)
REAL_CASES = [
    ("dapo100", 1, "Each swap fixes one block, so the answer is 2,013.", r"$\boxed{2014}$"),
    ("dapo100", 23, r"Summing up, we get $\boxed{13,483,236}$.", "The answer is 13,483,263."),
    ("dapo100", 86, r"Therefore $x = -2$, i.e. $\boxed{x=-2}$", r"\boxed{2}"),
    ("dapo100", 57, r"The final answer is $\boxed{2^{10}}$.", r"\boxed{2^{11}}"),
    ("aime24", "2024-I-1", "The walk takes 204 minutes.\n\n**Answer:** 204", "Answer: 240"),
    ("aime24", "2024-II-4", r"so $m+n = \boxed{033}$", r"\boxed{34}"),
    ("aime25", "2025-I-1", r"The bases are 21 and 49, whose sum is $\boxed{70}$.", r"\boxed{21 + 48}"),
    ("aime25", "2025-I-2", "#### 588", "#### 558"),
    ("gsm8k_test", "gsm8k-test-0", r"She sells 9 eggs at $2 each, so she makes \$18 every day.", "She makes $16."),
    ("gsm8k_test", "gsm8k-test-2", "So his profit was $70,000.", "So his profit was $7,000."),
    ("gsm8k_test", "gsm8k-test-63", "The answer is 1,596.", "The answer is 1,569."),
    ("gsm8k_test", "gsm8k-test-1", "It takes 3.0 bolts in total.", "It takes 2 bolts in total."),
    ("math500", "test/counting_and_probability/282.json", "The probability is 0.5", r"\boxed{\frac{1}{3}}"),
    ("math500", "test/prealgebra/1655.json", r"$\boxed{0.34}$", r"$\boxed{0.35}$"),
    ("math500", "test/algebra/2584.json", r"\boxed{\dfrac{14}{3}}", r"\boxed{\frac{3}{14}}"),
    ("math500", "test/prealgebra/153.json", "The answer is 5/9.", "The answer is 9/5."),
    ("math500", "test/algebra/2193.json", r"\boxed{5}", r"\boxed{x=6}"),
    ("math500", "test/precalculus/807.json", r"$\boxed{(3, \pi/2)}$", r"$\boxed{(3, \pi)}$"),
    ("math500", "test/precalculus/819.json", r"The curve is a cylinder: \boxed{\text{C}}", r"\boxed{(E)}"),
    ("math500", "test/counting_and_probability/508.json", r"\boxed{10080}", r"\boxed{10800}"),
    ("math500", "test/prealgebra/260.json", r"The angle is $\boxed{36^{\circ}}$.", r"\boxed{54^\circ}"),
    ("math500", "test/algebra/2036.json", r"\boxed{\sqrt{117}}", r"\boxed{\sqrt{113}}"),
    ("math500", "test/algebra/2780.json", r"It costs \boxed{\$18.9}", r"\boxed{\$19.80}"),
    ("math500", "test/intermediate_algebra/1388.json", r"\boxed{-2, 1}", r"\boxed{-1, 2}"),
    ("math500", "test/precalculus/1300.json", r"\boxed{\begin{pmatrix} -\frac13 \\ \frac23 \\ \frac53 \end{pmatrix}}", r"\boxed{\begin{pmatrix} 1 \\ 2 \\ 5 \end{pmatrix}}"),
    ("math500", "test/precalculus/695.json", r"\boxed{(-\infty,0]}", r"\boxed{(-\infty,0)}"),
    ("math500", "test/algebra/2470.json", r"\boxed{137.5}", r"\boxed{138.5}"),
    ("math500", "test/precalculus/990.json", r"\boxed{6-5i}", r"\boxed{6+5i}"),
    ("math500", "test/number_theory/410.json", r"\boxed{0.35625}", r"\boxed{0.3625}"),
]


@pytest.mark.parametrize("name, row_id, right, wrong", REAL_CASES)
def test_real_rows_right_format_variants_pass_and_wrong_answers_fail(rows, name, row_id, right, wrong):
    example = rows[name][row_id]
    good = math_metric(example, dspy.Prediction(answer=right))
    assert good.score == 1.0, good.feedback
    assert good.feedback.startswith("extracted ") and f"expected {example.answer}" in good.feedback
    bad = math_metric(example, dspy.Prediction(answer=wrong))
    assert bad.score == 0.0, bad.feedback


@pytest.mark.parametrize("name", SETS)
def test_every_gold_answer_verifies_against_itself_boxed(rows, name):
    for example in rows[name].values():
        output = f"Let me work it out step by step.\n\nThe final answer is $\\boxed{{{example.answer}}}$."
        assert extract_answer(output) == example.answer
        assert math_metric(example, dspy.Prediction(answer=output)).score == 1.0, example.id


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is $\boxed{\dfrac{14}{3}}$.", r"\dfrac{14}{3}"),
        (r"first \boxed{5}, on second thought \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed 7", "7"),
        ("The answer is 1,234.", "1,234"),
        ("The answer is $1,234.", "1,234"),
        ("**Answer:** 18", "18"),
        (r"Answer: $\frac{1}{2}$", r"\frac{1}{2}"),
        ("Final Answer: The final answer is 204. I hope it is correct.", "204"),
        ("The answer is 18 because she sells 9 eggs at $2 each.", "18"),
        ("#### 72", "72"),
        ("<answer>42</answer>", "42"),
        (r"\frac{1}{2}", r"\frac{1}{2}"),
        ("x=3", "x=3"),
        ("so 42", "42"),
        ("It is 18", "18"),
        (r"So she makes \$18 every day.", "18"),
        ("The total is 1,234,567.89 dollars in the end, nothing else", "1,234,567.89"),
        ("We get 3.5. Done", "3.5"),
        (r"The answer is \(\sqrt{2}\).", r"\sqrt{2}"),
        ("", None),
        ("no numbers here at all, sorry", None),
        (r"The answer is: \boxed{}", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, gold, same",
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{1}{2}", r"\frac12", True),
        ("x=3", "3", True),
        ("1,234", "1234", True),
        ("18 dollars", "18", True),
        (r"3\sqrt{2}", r"\sqrt{18}", True),
        ("9", "3^2", True),
        ("0.3333333", r"\frac{1}{3}", True),
        ("-2, 1+\\sqrt{5}, 1-\\sqrt{5}", r"\{1\pm\sqrt{5},-2\}", True),
        ("2", r"\frac{1}{2}", False),
        ("1,8", "18", False),
        ("8n^2 + 4n + 1", "1", False),  # a stray trailing 1 must not count
        ("0.333", r"\frac{1}{3}", False),
        ("3.14", r"\pi", False),
        ("-2", "2", False),
        ("", "2", False),
        (None, "2", False),
    ],
)
def test_is_equivalent(predicted, gold, same):
    assert is_equivalent(predicted, gold) is same


def _thread_cases(rows):
    cases = []
    for name, row_id, right, wrong in REAL_CASES:
        example = rows[name][row_id]
        cases += [(example, dspy.Prediction(answer=right)), (example, dspy.Prediction(answer=wrong))]
    return cases


def test_metric_in_eight_threads_matches_sequential(rows):
    cases = _thread_cases(rows) * 2
    sequential = [(r.score, r.feedback) for r in (math_metric(e, p) for e, p in cases)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        threaded = [(r.score, r.feedback) for r in pool.map(lambda c: math_metric(*c), cases)]
    assert threaded == sequential
    assert sum(score for score, _ in threaded) == len(REAL_CASES) * 2  # every right variant scored 1


HUGE = "9" * 1_000_000


@pytest.mark.parametrize(
    "prediction",
    [
        None,
        "",
        "   ",
        dspy.Prediction(),
        dspy.Prediction(answer=None),
        dspy.Prediction(answer=""),
        dspy.Prediction(answer=12345),
        dspy.Prediction(answer=["a", "list"]),
        dspy.Prediction(answer="The answer is " + HUGE),
        dspy.Prediction(answer="x" * 2_000_000),
        dspy.Prediction(answer=r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}"),
        dspy.Prediction(answer=r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"),
        dspy.Prediction(answer=r"\boxed{\frac{1}{"),
        dspy.Prediction(answer=r"\boxed{2^{2^{100}}}"),
        dspy.Prediction(answer=r"\boxed{9^{9^{9}}}"),
        dspy.Prediction(answer=r"\boxed{(10^{100})!}"),
        dspy.Prediction(answer=r"\boxed{\prod_{k=1}^{10^{9}} k}"),
        dspy.Prediction(answer=r"\boxed{\binom{10^{9}}{5 \cdot 10^{8}}}"),
        dspy.Prediction(answer="\x00\x01\ufffd $$ \\ { } ^ _"),
        dspy.Prediction(answer="\\boxed{" * 5000),
        dspy.Prediction(answer="The answer is " * 5000),
        {"answer": "205"},
        object(),
    ],
)
def test_odd_predictions_never_raise_and_score_zero(prediction):
    example = dspy.Example(question="q", answer="204").with_inputs("question")
    start = time.monotonic()
    result = math_metric(example, prediction)
    assert result.score == 0.0 and isinstance(result.feedback, str) and result.feedback
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("example", [None, dspy.Example(question="q"), dspy.Example(question="q", answer="")])
def test_examples_without_gold_score_zero(example):
    result = math_metric(example, dspy.Prediction(answer="5"))
    assert result.score == 0.0 and "no gold answer" in result.feedback


def test_answer_field_falls_back_to_other_fields():
    example = dspy.Example(question="q", answer="42").with_inputs("question")
    assert math_metric(example, dspy.Prediction(solution=r"so \boxed{42}")).score == 1.0
    assert math_metric(example, dspy.Prediction(answer="", reasoning="... #### 42")).score == 1.0
    assert math_metric(example, "The answer is 42.").score == 1.0
    # A present answer field is the only one read: no credit for a number found elsewhere.
    unsure = dspy.Prediction(answer="I could not solve it", reasoning="maybe 42", trajectory={"o": "42"})
    assert math_metric(example, unsure).score == 0.0


def test_huge_value_is_refused_with_a_reason():
    example = dspy.Example(question="q", answer="204").with_inputs("question")
    result = math_metric(example, dspy.Prediction(answer=r"\boxed{2^{2^{100}}}"))
    assert result.score == 0.0 and "too large" in result.feedback


def test_a_hanging_check_is_cut_off_from_a_worker_thread(monkeypatch):
    """A check that never ends costs the caller only the deadline, and the helper thread is stopped."""

    def spin(predicted, gold):
        while True:  # pure Python, so the stop request lands
            pass

    monkeypatch.setattr(metric_module, "_sympy_verdict", spin)
    monkeypatch.setattr(metric_module, "DEFAULT_TIMEOUT_S", 0.3)
    example = dspy.Example(question="q", answer=r"\frac{1}{2}").with_inputs("question")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        result = pool.submit(math_metric, example, dspy.Prediction(answer=r"\boxed{x+1}")).result()
    assert time.monotonic() - start < 3
    assert result.score == 0.0 and "timed out" in result.feedback
    deadline = time.monotonic() + 5
    while any(t.name == "tfgrpo-math-verify" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the abandoned helper thread kept running"
        time.sleep(0.05)


def test_a_first_check_abandoned_at_its_deadline_breaks_no_later_check():
    """math_verify builds its parsers on first use; a helper abandoned while building them (a first check slower than
    its deadline on a busy CPU) left them broken for the whole process, and every later check answered "no" (seen in
    CI after the real-model tests). In a fresh process: the first check times out at once, the next ones still work."""
    import subprocess
    import sys

    code = ("import time\nfrom tfgrpo.tasks.math.metric import _check, is_equivalent\n"
            "print(_check('x=3', '3', timeout=0.05))\ntime.sleep(2)\n"
            "print(is_equivalent('x=3', '3'), is_equivalent('9', '3^2'), _check(r'2^{2^{100}}', '204')[1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert out[0] in ("(False, 'check timed out after 0.05s')", "(True, None)")  # 0.05 s: mid-build, before the fix
    assert out[1] == "True True value too large to check"
