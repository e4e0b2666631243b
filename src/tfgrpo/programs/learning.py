"""The learning calls of Training-Free GRPO as DSPy modules around the signatures in `src/tfgrpo/signatures/learning.py`.

`Summarizer` (one attempt -> a step-by-step summary), `AdvantageExtractor` (a group's summaries -> at most N
operations on the library) and `Consolidator` (a batch's operations -> one plan). Without ground truth the
`reference_answer` input is removed from the signatures, so no answer key can reach the LM.

In a program of several predictors (`roles`: each one's name and what it does), the advantage and consolidation calls
are told the predictors and each operation names those its experience is for (`placed`, typed by their names).

The modules validate what comes back (pydantic) and ask once more, quoting the error, when a reply cannot be
parsed; a second failure raises `LearningCallError`, which the optimizer counts as a failed call. A reply
that does not parse thus costs exactly two LM calls: DSPy's fallback from the chat format to JSON is turned
off for these calls, and errors of the LM itself (timeouts, outages) are not retried here, since the LM
client retries those (`num_retries`).
"""

from __future__ import annotations

import copy
import json
import logging

import dspy
import pydantic
from dspy.adapters.chat_adapter import ChatAdapter
from dspy.utils.exceptions import AdapterParseError

from tfgrpo.base.util import clip
from tfgrpo.signatures.learning import ConsolidateOperations, ExtractGroupAdvantage, SummarizeRollout
from tfgrpo.signatures.operations import Operation, placed

logger = logging.getLogger(__name__)

PARSE_ERRORS = (AdapterParseError, pydantic.ValidationError)  # a reply that came back but cannot be used


class LearningCallError(RuntimeError):
    """A learning call whose reply could not be used, even after one retry."""


def _signature(sig: type[dspy.Signature], use_ground_truth: bool) -> type[dspy.Signature]:
    return sig if use_ground_truth or "reference_answer" not in sig.input_fields else sig.delete("reference_answer")


def single_call_adapter() -> dspy.Adapter:
    """The configured adapter (DSPy's chat adapter by default) without its JSON fallback, which would send a
    second call for every reply that does not parse."""
    adapter = copy.copy(dspy.settings.adapter) if dspy.settings.adapter is not None else ChatAdapter()
    if isinstance(adapter, ChatAdapter):
        adapter.use_json_adapter_fallback = False
    return adapter


ROLES = ("The program has several predictors, listed in `predictors` with what each does. Each operation names the "
         "predictors its experience is for (`predictors`): a lesson about one step goes to that step's predictor "
         "only; \"all\" where it helps every one.")


def _placed(signature: type[dspy.Signature], roles: dict[str, str] | None) -> type[dspy.Signature]:
    """`signature` told the program's predictors (`roles`: name -> what it does) and its operations placed on them
    (its output of type `list[Operation]`); as it is for a program of one predictor (`roles` None)."""
    if not roles:
        return signature
    output = next(name for name, f in signature.output_fields.items() if f.annotation == list[Operation])
    signature = signature.with_updated_fields(output, type_=list[placed(list(roles))])
    return signature.prepend("predictors", dspy.InputField(desc="the program's predictors, one a line: name: what it "
                                                                "does"), type_=str).with_instructions(
        f"{signature.instructions}\n\n{ROLES}")


class _ValidatedCall(dspy.Module):
    """A predictor that, when its reply cannot be parsed, asks once more and then gives up loudly."""

    def __init__(self, signature: type[dspy.Signature], use_ground_truth: bool, roles: dict[str, str] | None = None):
        super().__init__()
        self.use_ground_truth, self.roles = use_ground_truth, roles
        self.predict = dspy.Predict(_placed(_signature(signature, use_ground_truth), roles))

    def forward(self, **inputs):
        if self.roles:
            inputs["predictors"] = "\n".join(f"{name}: {role}" for name, role in self.roles.items())
        if not self.use_ground_truth:
            inputs.pop("reference_answer", None)
        with dspy.context(adapter=single_call_adapter()):
            return call_with_one_retry(self.predict, inputs, caller=type(self).__name__)


def call_with_one_retry(predict: dspy.Predict, inputs: dict, *, caller: str) -> dspy.Prediction:
    """`predict(**inputs)`; a reply that does not parse is asked for once more, quoting the error, then
    `LearningCallError`. Errors of the LM itself are left to the LM client's own retries."""
    try:
        return predict(**inputs)
    except PARSE_ERRORS as first:
        retry = dspy.Predict(predict.signature.with_instructions(
            f"{predict.signature.instructions}\n\nA previous reply could not be used ({_one_line(first)}). "
            "Reply again and follow the output format exactly."))
        retry.lm = predict.lm  # the changed instructions make a new prompt: no cached reply comes back
        try:
            return retry(**inputs)
        except PARSE_ERRORS as second:
            raise LearningCallError(f"{caller}: unusable reply twice ({_one_line(second)})") from second


def _one_line(exc: Exception) -> str:
    return clip(f"{type(exc).__name__}: {exc}".replace("\n", " "), 300)


class Summarizer(_ValidatedCall):
    def __init__(self, use_ground_truth: bool = True):
        super().__init__(SummarizeRollout, use_ground_truth)

    def forward(self, **inputs) -> str:
        summary = (super().forward(**inputs).summary or "").strip()
        if not summary:
            raise LearningCallError("Summarizer: empty summary")
        return summary


class AdvantageExtractor(_ValidatedCall):
    def __init__(self, use_ground_truth: bool = True, roles: dict[str, str] | None = None):
        super().__init__(ExtractGroupAdvantage, use_ground_truth, roles)

    def forward(self, **inputs) -> list[Operation]:
        ops = list(super().forward(**inputs).operations or [])
        cap = inputs["max_operations"]
        if len(ops) > cap:
            logger.warning("Group advantage proposed %d operations, keeping the first %d", len(ops), cap)
        return ops[:cap]


class Consolidator(_ValidatedCall):
    def __init__(self, roles: dict[str, str] | None = None, room: str = ""):
        super().__init__(ConsolidateOperations, use_ground_truth=True, roles=roles)
        if room:  # the libraries would pass their budget: the plan is asked to make room first
            self.predict.signature = self.predict.signature.with_instructions(
                f"{self.predict.signature.instructions}\n\n{room}")

    def forward(self, *, experiences: str, proposals: list[tuple[str, Operation]], max_words: int) -> list[Operation]:
        rendered = json.dumps([{"from_query": q, **op.model_dump()} for q, op in proposals], ensure_ascii=False, indent=1)
        return list(super().forward(experiences=experiences, proposals=rendered, max_words=max_words).plan or [])
