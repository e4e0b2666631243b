"""Reward for the math task: find the final answer in a model's text, check it against the gold one.

Equivalence is decided by ``math_verify`` (parses LaTeX or plain text into sympy, compares numerically
and symbolically) after cheap shortcuts (normalized strings, exact plain numbers) that settle most
GSM8K/AIME answers. math_verify's own time limits use ``signal.alarm``, which fails outside the main
thread, and DSPy calls metrics from worker threads; so they are switched off (``parsing_timeout=None``,
``timeout_seconds=None``) and the sympy work runs in a daemon helper thread that the caller waits on
for at most ``DEFAULT_TIMEOUT_S`` seconds before scoring 0 and raising an exception inside the helper
to stop it. That exception lands only between bytecodes, so a single huge C-level integer operation
could outlast the deadline: answers whose exact value could exceed ``MAX_RESULT_BITS`` bits (power
towers, big factorials or products) are refused before comparing, and input lengths are capped.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import threading
from fractions import Fraction
from typing import Any

import dspy

from tfgrpo.base.util import clip

DEFAULT_TIMEOUT_S = 5.0  # per comparison, parsing included; read at call time
MAX_TEXT_CHARS = 20_000  # extraction only looks at this much of the end of a text
MAX_ANSWER_CHARS = 400  # longer answers are only compared as normalized strings
MAX_RESULT_BITS = 1_000_000  # refuse values that could need more bits than this
FEEDBACK_CHARS = 200  # an extracted or expected answer is shown this long in the feedback


class _Abandon(BaseException):
    """Raised inside an abandoned helper thread to stop it (BaseException: math_verify lets it pass)."""


# math_verify warns once that its timeouts are off; this module supplies its own, so hide that.
for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(lambda r: not str(r.msg).startswith("Timeout is disabled"))

# ------------------------------------------------------------------------------ answer extraction

_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
_PHRASE = re.compile(r"(?<![</])\b(?:final\s+answer|answer)\b\s*(?:is\b|=|:)?\s*:?|####", re.I)
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_SENTENCE_END = re.compile(r"\.(?=\s|$)|;|\n")
_WORD = re.compile(r"(?<![A-Za-z])[A-Za-z]{3,}")
_NUMBER = re.compile(
    r"-?\\[dt]?frac\s*\{\s*\d+\s*\}\s*\{\s*\d+\s*\}"  # \frac{3}{4}
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,234,567.89
    r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"  # 42, 3.5, 7/8, .35
)


def _braced(text: str, start: int) -> str | None:
    """Content of the {...} group opening at ``text[start]`` (escaped braces skipped), or None."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "{}" and text[i - 1 : i] != "\\":
            depth += 1 if text[i] == "{" else -1
            if depth == 0:
                return text[start + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    r"""Content of the last non-empty ``\boxed{...}`` (also ``\fbox``, and ``\boxed 5``)."""
    for match in list(_BOX.finditer(text))[-20:][::-1]:  # the last few only: bounded work
        end = match.end()
        if text[end : end + 1] == "{":
            content = _braced(text, end)
        else:
            content = re.match(r"[^\s$]*", text[end:]).group(0)
        if content and content.strip():
            return content.strip()
    return None


def _tidy(answer: str) -> str:
    """Strip surrounding math delimiters, markdown bold and trailing punctuation."""
    answer = answer.strip()
    for mark, end in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(mark) and answer.endswith(end) and len(answer) > 2 * len(mark):
            answer = answer[len(mark) : -len(end)].strip()
    return answer.rstrip(".,;:!").strip().strip("$").strip()


def _words(text: str) -> int:
    """Number of English-looking words (3+ letters; LaTeX commands do not count)."""
    return len(_WORD.findall(re.sub(r"\\[A-Za-z]+", " ", text)))


def _after_phrase(rest: str) -> str | None:
    """The answer after 'answer is': a math span, or the text up to the end of the sentence."""
    rest = rest.lstrip(" *:")
    span = _MATH_SPAN.match(rest)
    if span:
        return next(g for g in span.groups() if g is not None).strip() or None
    segment = _tidy(_SENTENCE_END.split(rest, maxsplit=1)[0])
    if _words(segment) > 2:  # "18 because she sells ..." -> just the number
        numbers = _NUMBER.findall(segment)
        segment = numbers[0] if numbers else ""
    return segment if re.search(r"\w", segment) else None


def extract_answer(text: str) -> str | None:
    r"""The final answer as the model wrote it, or None.

    In order: the last ``\boxed{}``; the last "answer is X" / "Answer: X" / "#### X"; the whole text
    when it is itself a short bare answer (``\frac{1}{2}``, ``x=3``, ``18 dollars``); the last number.
    """
    if text is None:
        return None
    text = str(text)[-MAX_TEXT_CHARS:].strip()
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    text = re.sub(r"\\(?:boxed|fbox)\s*\{\s*\}", " ", text)  # an empty box holds no answer
    for match in list(_PHRASE.finditer(text))[-20:][::-1]:
        found = _after_phrase(text[match.end() :].replace("**", ""))
        if found:
            return found
    bare = _tidy(re.sub(r"^(?:so|thus|hence|it is|it's|is|=)\s+", "", text, flags=re.I))  # "so 42"
    if bare and len(bare) <= 80 and "\n" not in bare and _words(bare) <= 1:
        return bare
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


# ------------------------------------------------------------------------------ cheap comparisons

_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _normalize(answer: str) -> str:
    """A canonical spelling for string comparison: formatting noise removed, meaning kept."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", answer)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right|\\[!,;: ]|\{,\}|~|\\?\$|\^\s*\{?\s*\\circ\s*\}?|°", "", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a normalized plain number (12, -3.5, .25, 7/8), else None."""
    if len(s) < 100 and _PLAIN_NUMBER.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


# ------------------------------------------------------------------------------ bounded math_verify


def _count(log2_size: float) -> float:
    """2**log2_size, or inf when it is far too big to matter."""
    return 2.0**log2_size if log2_size < 64 else math.inf


def _log2_bound(expr: Any, budget: list[int], env: dict) -> float:
    """Rough upper bound of log2|value| of a sympy tree; ``env`` bounds sum/product variables."""
    import sympy
    from sympy.functions.combinatorial.factorials import CombinatorialFunction

    budget[0] -= 1
    if budget[0] < 0:  # an absurdly large tree is refused like a huge number
        return math.inf
    if isinstance(expr, sympy.Rational):  # Integer included
        return max(math.log2(abs(expr.p) or 1), math.log2(abs(expr.q) or 1))
    if isinstance(expr, sympy.Float):
        return math.log2(abs(float(expr)) + 1)
    if isinstance(expr, sympy.Symbol):  # free symbols stay symbolic: sympy computes nothing
        return env.get(expr, 0.0)
    if isinstance(expr, (sympy.Sum, sympy.Product)):
        inner, terms = dict(env), 1.0
        for var, *ends in expr.limits:  # the running variable is bounded by its limits
            inner[var] = max((_log2_bound(e, budget, inner) for e in ends), default=math.inf)
            terms *= _count(inner[var]) + 1
        term = _log2_bound(expr.function, budget, inner)
        return term * terms if isinstance(expr, sympy.Product) else term + math.log2(terms)
    if isinstance(expr, sympy.Pow):
        base, exponent = (_log2_bound(a, budget, env) for a in expr.args)
        return 0.0 if base == 0 else base * _count(exponent)
    args = list(expr) if isinstance(expr, sympy.MatrixBase) else getattr(expr, "args", ())
    sizes = [_log2_bound(a, budget, env) for a in args if isinstance(a, (sympy.Basic, sympy.MatrixBase))]
    if isinstance(expr, CombinatorialFunction):  # n!, binomial(n, k), ... stay below n**n
        n = _count(max(sizes, default=0.0))
        return n * math.log2(n + 1)
    if isinstance(expr, sympy.Mul):
        return sum(sizes)
    return max(sizes, default=0.0) + (1 if isinstance(expr, sympy.Add) else 0)


def _too_big(parsed: list) -> bool:
    budget = [5000]
    return any(
        not isinstance(x, str) and _log2_bound(x, budget, {}) > MAX_RESULT_BITS for x in parsed
    )


def _read(answer: str, *, latex: bool) -> list:
    """math_verify's parse of an answer, read as one LaTeX expression or as free text."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if not latex:
        config = [LatexExtractionConfig(), ExprExtractionConfig()]
        return parse(answer, extraction_config=config, parsing_timeout=None)
    balanced = _braced("{" + answer + "}", 0) == answer  # \boxed{} needs balanced braces
    wrapped = f"\\boxed{{{answer}}}" if balanced else f"${answer}$"
    return parse(wrapped, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def _sympy_verdict(predicted: str, gold: str) -> str:
    """'yes', 'no' or 'too_big' from math_verify. Runs in the helper thread."""
    from math_verify import verify

    readings = [True]
    if not re.search(r"[\\{}]", predicted + gold) and re.search("[A-Za-z]{2}", predicted):
        # Words in plain text ("18 dollars", "It is 18") read as LaTeX become a product of symbols;
        # math_verify's free-text reading finds the number instead. Not used for bare expressions
        # such as "8n^2 + 4n + 1", where it could pick out a stray "1".
        readings.append(False)
    for latex in readings:
        gold_parsed, pred_parsed = _read(gold, latex=latex), _read(predicted, latex=latex)
        if not gold_parsed or not pred_parsed:
            continue
        if _too_big(gold_parsed) or _too_big(pred_parsed):
            return "too_big"
        if verify(gold_parsed, pred_parsed, timeout_seconds=None):
            return "yes"
    return "no"


def _with_deadline(func, args: tuple, seconds: float) -> Any:
    """``func(*args)`` run in a daemon helper thread; 'timeout' or 'error' when it fails."""
    result: dict[str, Any] = {}
    lock = threading.Lock()  # orders "helper finished" against "caller gives up"

    def work() -> None:
        try:
            try:
                value = func(*args)
            except Exception:  # noqa: BLE001 - reported as a failed check
                value = "error"
            with lock:
                result["value"] = value
        except _Abandon:  # the caller gave up on us: just end quietly
            pass

    helper = threading.Thread(target=work, name="tfgrpo-math-verify", daemon=True)
    helper.start()
    helper.join(seconds)
    with lock:
        if "value" in result:
            return result["value"]
        # Still working (and cannot finish while we hold the lock, so its id is surely its own):
        # raise _Abandon in it at its next bytecode. CPython API; elsewhere it just runs out.
        raise_in = getattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", None)
        if raise_in is not None:
            raise_in(ctypes.c_ulong(helper.ident), ctypes.py_object(_Abandon))
    return "timeout"


_WARMING = threading.Lock()
_warm = False


def _warm_up() -> None:
    """Build math_verify's parsers once per process in the calling thread, before any helper runs. A helper that is
    abandoned while they are first built (a first check slower than its deadline, on a busy CPU) leaves them broken,
    and every later check of the process then reads nothing and answers "no"."""
    global _warm
    with _WARMING:
        if not _warm:
            for pair in (("18 dollars", "18"), (r"\frac{1}{3}", r"x=\sqrt{9}")):  # both readings, verify, a fraction
                try:
                    _sympy_verdict(*pair)
                except Exception:  # noqa: BLE001 - the checks report their own failures
                    pass
            _warm = True


def _check(predicted: Any, gold: Any, timeout: float | None = None) -> tuple[bool, str | None]:
    """(equivalent, reason the check could not be completed or None)."""
    predicted, gold = ("" if x is None else str(x).strip() for x in (predicted, gold))
    if not predicted or not gold:
        return False, "empty answer"
    pred_norm, gold_norm = _normalize(predicted), _normalize(gold)
    if pred_norm and pred_norm == gold_norm:
        return True, None
    pred_num, gold_num = _as_fraction(pred_norm), _as_fraction(gold_norm)
    if pred_num is not None and gold_num is not None:
        if pred_num == gold_num:
            return True, None
        if pred_num.denominator == gold_num.denominator == 1:  # two different integers
            return False, None
    if len(predicted) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False, "answer too long to check"
    seconds = DEFAULT_TIMEOUT_S if timeout is None else timeout
    _warm_up()
    verdict = _with_deadline(_sympy_verdict, (predicted, gold), seconds)
    why = {"timeout": f"check timed out after {seconds:g}s", "too_big": "value too large to check"}
    return verdict == "yes", why.get(verdict, "the checker failed" if verdict == "error" else None)


def is_equivalent(predicted: str, gold: str, *, timeout: float | None = None) -> bool:
    """Whether two final answers denote the same value. Never raises: False on any failure."""
    try:
        return _check(predicted, gold, timeout)[0]
    except Exception:  # noqa: BLE001 - a reward must not crash its caller
        return False


# ------------------------------------------------------------------------------ the DSPy metric


def _prediction_texts(prediction: Any) -> list[str]:
    """Texts that may hold the answer: the ``answer`` field; only when it is absent or empty, the
    other string fields (reasoning last)."""
    if prediction is None or isinstance(prediction, str):
        return [prediction] if prediction else []
    try:
        fields = dict(prediction.items())
    except Exception:  # noqa: BLE001 - no items(): only the attribute is left to try
        fields = {"answer": getattr(prediction, "answer", None)}
    answer = fields.get("answer")
    if answer is not None and str(answer).strip():
        return [str(answer)]
    last = ("reasoning", "rationale")
    keys = sorted(k for k in fields if k not in last) + list(last)
    return [fields[k] for k in keys if isinstance(fields.get(k), str) and fields[k].strip()]


def math_metric(example: Any, prediction: Any, trace: Any = None) -> dspy.Prediction:
    """DSPy metric: score 1.0 when the prediction's final answer equals ``example.answer``, else 0.0.

    ``feedback`` says what was extracted and what was expected, or what went wrong. Never raises.
    """
    try:
        gold = example.get("answer") if isinstance(example, dict) else getattr(example, "answer", None)
        gold = "" if gold is None else str(gold).strip()
        texts = _prediction_texts(prediction)
        extracted = next((a for a in map(extract_answer, texts) if a), None)
        if not gold:
            feedback = "the example has no gold answer"
        elif extracted is None:
            found = "no final answer found in the prediction" if texts else "the prediction is empty"
            feedback = f"{found}, expected {clip(gold, FEEDBACK_CHARS)}"
        else:
            same, problem = _check(extracted, gold)
            feedback = f"extracted {clip(extracted, FEEDBACK_CHARS)}, expected {clip(gold, FEEDBACK_CHARS)}"
            if problem:
                feedback += f" ({problem}; counted as wrong)"
            return dspy.Prediction(score=1.0 if same else 0.0, feedback=feedback)
        return dspy.Prediction(score=0.0, feedback=feedback)
    except Exception as exc:  # noqa: BLE001 - a reward must not crash its caller
        return dspy.Prediction(score=0.0, feedback=clip(f"could not score the prediction: {exc!r}", FEEDBACK_CHARS))
