"""The rules every fake LM of the project reads a DSPy prompt by (tfgrpo.testing.prompts), checked against the
prompts DSPy really builds from tfgrpo's signatures: renaming a learning call's output field fails here."""

import dspy
import pytest

from tfgrpo.signatures.contrast import GeneralizeRule, contrast_signature
from tfgrpo.signatures.learning import ConsolidateOperations, ExtractGroupAdvantage, GenerateExperiences, SummarizeRollout
from tfgrpo.testing import KINDS, field_values, kind_of, output_fields

CALLS = [(SummarizeRollout, "summary"), (ExtractGroupAdvantage, "advantage"), (ConsolidateOperations, "consolidation"),
         (contrast_signature([], 20), "contrast"), (contrast_signature(["E1"], 20), "contrast"),
         (GeneralizeRule, "rewrite"), (GenerateExperiences, "direct"),
         (dspy.Signature("question -> answer"), "student"),
         (dspy.ChainOfThought("question -> answer").predict.signature, "student"),
         (dspy.Signature("numbers -> code"), "student")]


@pytest.mark.parametrize("signature, kind", CALLS, ids=[f"{k}-{i}" for i, (_, k) in enumerate(CALLS)])
def test_each_call_of_tfgrpo_is_told_apart_by_its_prompt(signature, kind):
    messages = dspy.ChatAdapter().format(signature, demos=[], inputs={k: "x" for k in signature.input_fields})
    fields = output_fields(messages[0]["content"])
    assert fields == list(signature.output_fields)
    assert kind_of(fields) == kind and kind in KINDS


def test_field_values_reads_the_sections_of_a_message():
    assert field_values("[[ ## task ## ]]\nWhat is 1 + 2?\n\n[[ ## library ## ]]\n(empty)") == {
        "task": "What is 1 + 2?", "library": "(empty)"}
