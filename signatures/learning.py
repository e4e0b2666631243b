"""The three learning calls of Training-Free GRPO, as DSPy signatures and modules.

1. `SummarizeRollout`: one attempt -> a step-by-step account of what it did, which experiences it leaned on,
   and where it went wrong or wandered.
2. `ExtractGroupAdvantage`: the accounts of one group of attempts at the same query, with their rewards ->
   at most N operations on the library (the "semantic advantage": what the better attempts knew).
3. `ConsolidateOperations`: every operation proposed in a batch -> one clean revision plan for the library.

Without ground truth the `reference_answer` input is removed from the signatures, so no answer key can
reach the LM. The modules validate what comes back (pydantic) and ask once more, quoting the error, when a
reply cannot be parsed; a second failure raises `LearningCallError`, which the optimizer counts as a failed
call. A reply that does not parse thus costs exactly two LM calls: DSPy's fallback from the chat format to
JSON is turned off for these calls, and errors of the LM itself (timeouts, outages) are not retried here,
since the LM client retries those (`num_retries`).
"""

from __future__ import annotations

import copy
import json
import logging

import dspy
import pydantic
from dspy.adapters.chat_adapter import ChatAdapter
from dspy.utils.exceptions import AdapterParseError

from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)

PARSE_ERRORS = (AdapterParseError, pydantic.ValidationError)  # a reply that came back but cannot be used


class LearningCallError(RuntimeError):
    """A learning call whose reply could not be used, even after one retry."""


class SummarizeRollout(dspy.Signature):
    """You review one attempt by an AI system at a task. Retrace the attempt step by step in a compact summary.

    Say which of the listed experiences (by ID) the attempt applied or ignored, which steps moved it toward
    the goal, and where it made an error, took a detour or skipped a check. The outcome tells whether the
    attempt was judged successful; when a reference answer is given, use it to locate the first wrong step.
    Be concrete about methods and reasoning, not about this problem's particular numbers."""

    task_input: str = dspy.InputField(desc="the query the attempt worked on")
    attempt: str = dspy.InputField(desc="the attempt's reasoning, tool calls and final output")
    outcome: str = dspy.InputField(desc="how the attempt was judged (reward and any feedback)")
    reference_answer: str = dspy.InputField(desc="the correct answer")
    experiences: str = dspy.InputField(desc="the experiences the attempt had in its prompt, one per line with its ID")
    summary: str = dspy.OutputField(desc="numbered steps of what the attempt did, experiences used, errors and detours")


class ExtractGroupAdvantage(dspy.Signature):
    """Several attempts at the same query received different rewards. Compare the better attempts with the
    worse ones and decide how the experience library should change so future attempts do better.

    Propose at most `max_operations` operations:
    - "add": a new experience; `ids` stays empty.
    - "modify": rewrite an existing experience; `ids` holds exactly one ID copied from the library (like "E3").
    - "delete": remove an experience that misled the attempts; `ids` holds its ID.
    When the library is empty, only "add" is possible. An experience is one sentence of at most `max_words`
    words: it begins with "When" and the kind of problem or step it is about, then says what to do or check.
    It must help on other problems of the same kind: never mention this query's names, objects, numbers or
    answer. Return an empty list when the library already covers the lesson."""

    task_input: str = dspy.InputField(desc="the query all attempts worked on")
    reference_answer: str = dspy.InputField(desc="the correct answer")
    attempts: str = dspy.InputField(desc="summaries of the attempts, each with its reward")
    experiences: str = dspy.InputField(desc="the current experience library, one per line with its ID")
    max_operations: int = dspy.InputField(desc="the most operations you may propose")
    max_words: int = dspy.InputField(desc="the most words an experience may have")
    operations: list[Operation] = dspy.OutputField(desc="the proposed operations, possibly none")


class ConsolidateOperations(dspy.Signature):
    """You maintain a library of experiences that guides an AI system. Edits were proposed independently
    from several queries; turn them into one consistent revision plan for the library.

    Keep the proposals that carry general, useful lessons; fold overlapping proposals into one; when a
    proposal repeats an existing experience, modify that experience instead of adding a copy; "merge" two or
    more existing experiences that say the same thing (give their IDs and the merged wording); "delete"
    experiences that are wrong or redundant. `ids` may only hold IDs listed in the library ("add" has none).
    Drop proposals that mention a particular problem's names or numbers. Every resulting experience is one
    sentence of at most `max_words` words that names the kind of situation first, then the strategy."""

    experiences: str = dspy.InputField(desc="the current experience library, one per line with its ID")
    proposals: str = dspy.InputField(desc="the operations proposed in this batch, as JSON")
    max_words: int = dspy.InputField(desc="the most words an experience may have")
    plan: list[Operation] = dspy.OutputField(desc="the final operations to apply, in order")


def _signature(sig: type[dspy.Signature], use_ground_truth: bool) -> type[dspy.Signature]:
    return sig if use_ground_truth or "reference_answer" not in sig.input_fields else sig.delete("reference_answer")


def _single_call_adapter() -> dspy.Adapter:
    """The configured adapter (DSPy's chat adapter by default) without its JSON fallback, which would send a
    second call for every reply that does not parse."""
    adapter = copy.copy(dspy.settings.adapter) if dspy.settings.adapter is not None else ChatAdapter()
    if isinstance(adapter, ChatAdapter):
        adapter.use_json_adapter_fallback = False
    return adapter


class _ValidatedCall(dspy.Module):
    """A predictor that, when its reply cannot be parsed, asks once more and then gives up loudly."""

    def __init__(self, signature: type[dspy.Signature], use_ground_truth: bool):
        super().__init__()
        self.use_ground_truth = use_ground_truth
        self.predict = dspy.Predict(_signature(signature, use_ground_truth))

    def forward(self, **inputs):
        if not self.use_ground_truth:
            inputs.pop("reference_answer", None)
        with dspy.context(adapter=_single_call_adapter()):
            try:
                return self.predict(**inputs)
            except PARSE_ERRORS as first:
                retry = dspy.Predict(self.predict.signature.with_instructions(
                    f"{self.predict.signature.instructions}\n\nA previous reply could not be used ({_short(first)}). "
                    "Reply again and follow the output format exactly."))
                retry.lm = self.predict.lm  # the changed instructions make a new prompt: no cached reply comes back
                try:
                    return retry(**inputs)
                except PARSE_ERRORS as second:
                    raise LearningCallError(f"{type(self).__name__}: unusable reply twice ({_short(second)})") \
                        from second


def _short(exc: Exception, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Summarizer(_ValidatedCall):
    def __init__(self, use_ground_truth: bool = True):
        super().__init__(SummarizeRollout, use_ground_truth)

    def forward(self, **inputs) -> str:
        summary = (super().forward(**inputs).summary or "").strip()
        if not summary:
            raise LearningCallError("Summarizer: empty summary")
        return summary


class AdvantageExtractor(_ValidatedCall):
    def __init__(self, use_ground_truth: bool = True):
        super().__init__(ExtractGroupAdvantage, use_ground_truth)

    def forward(self, **inputs) -> list[Operation]:
        ops = list(super().forward(**inputs).operations or [])
        cap = inputs["max_operations"]
        if len(ops) > cap:
            logger.warning("Group advantage proposed %d operations, keeping the first %d", len(ops), cap)
        return ops[:cap]


class Consolidator(_ValidatedCall):
    def __init__(self):
        super().__init__(ConsolidateOperations, use_ground_truth=True)

    def forward(self, *, experiences: str, proposals: list[tuple[str, Operation]], max_words: int) -> list[Operation]:
        rendered = json.dumps([{"from_query": q, **op.model_dump()} for q, op in proposals], ensure_ascii=False, indent=1)
        return list(super().forward(experiences=experiences, proposals=rendered, max_words=max_words).plan or [])


class GenerateExperiences(dspy.Signature):
    """Write general advice for an AI system that will work on tasks like the examples shown, before it has
    tried any of them. Give exactly `count` pieces of advice, each one sentence of at most `max_words` words
    that starts with the situation it applies to ("When ..., ...") and states a reusable strategy or check."""

    task_examples: str = dspy.InputField(desc="a few example queries of the task")
    count: int = dspy.InputField(desc="how many pieces of advice to write")
    max_words: int = dspy.InputField(desc="the most words per piece of advice")
    experiences: list[str] = dspy.OutputField(desc="the advice, one string per item")
