"""Learning calls sized for small reflection models: one better and one worse attempt in, one rule out.

The paper's path (summarize every attempt, compare the whole group, consolidate the batch in one call)
asks a lot of the reflection LM. A 1.5B model copies IDs and problem text from such prompts. This path
keeps the group-relative signal (attempts of the same query with different rewards) but asks one small
question per pair of attempts, and the reply's shape is built per call from the live library: while the
library is empty the only actions are "add" and "none", and `target_id` can only be an ID that exists.
With a backend that does constrained decoding (see `tfgrpo.programs.constrained`) an invented action or ID
cannot even be generated; elsewhere the same types are enforced when the reply is parsed.
"""

from __future__ import annotations

from typing import Literal

import dspy


class ContrastAttempts(dspy.Signature):
    """Two attempts at the same task got different results. Compare them and find the decisive difference:
    the first step where the worse attempt went wrong, or the technique that only the better attempt used.
    Then turn that difference into one rule that will help future attempts at other tasks of this kind.

    The rule is one imperative sentence that can be followed as written: it names the concrete technique
    (for a program: which library functions, which search, which checks, what to print), not a vague goal.
    It works on any input of this kind, so it never mentions the particular values, names or objects of
    this task. Choose "add" for a new rule, "modify" to improve the library rule given in `target_id`, or
    "none" when the library already states the lesson."""

    task: str = dspy.InputField(desc="the task both attempts worked on")
    better_attempt: str = dspy.InputField(desc="the attempt that scored higher, with its result")
    worse_attempt: str = dspy.InputField(desc="the attempt that scored lower, with its result")
    library: str = dspy.InputField(desc="the rules learned so far, one per line after its id")
    difference: str = dspy.OutputField(desc="one or two sentences: the concrete thing the better attempt did that the worse did not")
    action: Literal["add", "none"] = dspy.OutputField()
    rule: str = dspy.OutputField(desc="the rule (empty when the action is none)")


class GeneralizeRule(dspy.Signature):
    """A rule learned from one task repeats details of that task. Rewrite it as one general sentence about
    the method, so that it applies to every task of this kind, and leave the listed details out."""

    rule: str = dspy.InputField()
    details: str = dspy.InputField(desc="task-specific words and numbers that must not appear")
    general_rule: str = dspy.OutputField(desc="the rewritten rule, one sentence")


def contrast_signature(active_ids: list[str], max_words: int, predictors: list[str] = ()) -> type[dspy.Signature]:
    """`ContrastAttempts` with the actions and IDs that are legal against the current library, and in a program of
    several `predictors` the predictor the rule is for, one of their names (or "all")."""
    sig = ContrastAttempts.with_updated_fields(
        "rule", desc=f"the rule, one sentence of at most {max_words} words (empty when the action is none)")
    if len(predictors) > 1:
        sig = sig.prepend("predictors", dspy.InputField(desc="the program's predictors, one a line: name: what it "
                                                             "does"), type_=str)
        sig = sig.append("predictor", dspy.OutputField(desc='the predictor whose step the rule is about; "all" '
                                                            'when it helps every step'),
                         type_=Literal[tuple(predictors) + ("all",)])
    if not active_ids:
        return sig
    sig = sig.with_updated_fields("action", type_=Literal["add", "modify", "none"])
    return sig.insert(2, "target_id", dspy.OutputField(
        desc='the id of the rule to modify; "none" unless modifying'), type_=Literal[tuple(active_ids) + ("none",)])
