"""Rewards of the web task: an LLM judge (the paper's), and exact match / token F1 for short answers.

EM and F1 use the SQuAD normalisation that HotpotQA's official script uses (lower case, no punctuation, no
articles, single spaces). The judge is a DSPy signature with its own LM; its verdicts are kept per
(question, response), in memory and optionally in a JSONL file, so re-scoring the same answer costs nothing.
A judge reply that cannot be read is asked for once more, then raises `JudgeError`: an unreadable verdict is
never counted as "wrong".
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import re
import string
import threading
from pathlib import Path
from typing import Literal

import dspy

from tfgrpo.programs.constrained import ConstrainedJSONAdapter, Mode
from tfgrpo.programs.learning import LearningCallError, call_with_one_retry, single_call_adapter

logger = logging.getLogger(__name__)


PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in str(text).lower() if ch not in PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer"):
        if pred != ref:  # HotpotQA's rule: a yes/no answer gets no partial credit
            return 0.0
    common = collections.Counter(pred.split()) & collections.Counter(ref.split())
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(ref.split())
    return 2 * precision * recall / (precision + recall)


class JudgeAnswer(dspy.Signature):
    """You grade an answer to a question against the reference answer. The answer is correct when it states
    the same fact as the reference (other wording, spelling or extra detail is fine; a different or missing
    fact, or several candidate answers, is not)."""

    question: str = dspy.InputField()
    reference_answer: str = dspy.InputField()
    response: str = dspy.InputField(desc="the answer to grade")
    reason: str = dspy.OutputField(desc="one short sentence", max_length=200)
    verdict: Literal["correct", "incorrect"] = dspy.OutputField()


class JudgeError(RuntimeError):
    """The judge's reply could not be read twice for one answer."""


class LLMJudge:
    """`judge(question, reference, response) -> (correct, reason)`, cached per (question, response).

    lm: the judge's LM (None: the LM configured in DSPy when called); constrained: "json_object" (llama.cpp
    servers) or "json_schema" to decode the verdict under its JSON schema; cache_path: a JSONL file that keeps
    verdicts across runs (read at start, one line appended per new verdict)."""

    def __init__(self, lm: dspy.BaseLM | None = None, *, constrained: Mode | None = None,
                 cache_path: str | Path | None = None):
        self.lm = lm
        self.predict = dspy.Predict(JudgeAnswer)
        self.adapter = ConstrainedJSONAdapter(constrained) if constrained else None
        self.cache_path = Path(cache_path) if cache_path else None
        self._lock = threading.Lock()
        self._verdicts: dict[str, tuple[bool, str]] = self._read_cache() if self.cache_path else {}
        self.calls = 0  # verdicts that were not in the cache

    @staticmethod
    def key(question: str, response: str) -> str:
        return hashlib.sha256(json.dumps([question.strip(), response.strip()]).encode()).hexdigest()

    def __call__(self, question: str, reference: str, response: str) -> tuple[bool, str]:
        key = self.key(question, response)
        with self._lock:
            if key in self._verdicts:
                return self._verdicts[key]
        settings = {"lm": self.lm} if self.lm is not None else {}
        settings["adapter"] = self.adapter or single_call_adapter()  # one call per reply; a bad one is asked again
        try:
            with dspy.context(**settings):
                reply = call_with_one_retry(self.predict, dict(question=question, reference_answer=reference,
                                                               response=response), caller="the judge")
        except LearningCallError as exc:
            raise JudgeError(f"{exc} (question {question[:80]!r})") from exc
        verdict = (reply.verdict == "correct", str(reply.reason or "").strip())
        with self._lock:
            self.calls += 1
            self._verdicts[key] = verdict
            if self.cache_path:
                with self.cache_path.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps({"key": key, "question": question, "response": response,
                                             "correct": verdict[0], "reason": verdict[1]}, ensure_ascii=False) + "\n")
        return verdict

    def _read_cache(self) -> dict[str, tuple[bool, str]]:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        verdicts, bad = {}, 0
        if self.cache_path.exists():
            for line in self.cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    verdicts[row["key"]] = (bool(row["correct"]), str(row["reason"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    bad += 1  # a line cut by a crash: that verdict is asked for again
        if bad:
            logger.warning("%s: %d unreadable line(s) skipped", self.cache_path, bad)
        return verdicts


def answer_of(prediction) -> str:
    return str(getattr(prediction, "answer", "") or "").strip()


def em_metric(example, prediction, trace=None) -> float:
    return exact_match(answer_of(prediction), example.answer)


def f1_metric(example, prediction, trace=None) -> dspy.Prediction:
    answer = answer_of(prediction)
    score = token_f1(answer, example.answer)
    return dspy.Prediction(score=score, feedback=f"token F1 {score:.2f} against the reference {example.answer!r}")


def judge_metric(judge: LLMJudge):
    """A DSPy metric that asks `judge`; an empty answer is wrong without a call."""

    def judge_reward(example, prediction, trace=None) -> dspy.Prediction:
        answer = answer_of(prediction)
        if not answer:
            return dspy.Prediction(score=0.0, feedback="no answer was given")
        correct, reason = judge(example.question, example.answer, answer)
        return dspy.Prediction(score=float(correct), feedback=f"judge: {'correct' if correct else 'incorrect'}; {reason}")

    return judge_reward
