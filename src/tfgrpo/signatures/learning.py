"""The learning calls of Training-Free GRPO as DSPy signatures (the modules that call them: src/tfgrpo/programs/learning.py).

1. `SummarizeRollout`: one attempt -> a step-by-step account of what it did, which experiences it leaned on,
   and where it went wrong or wandered.
2. `ExtractGroupAdvantage`: the accounts of one group of attempts at the same query, with their rewards ->
   at most N operations on the library (the "semantic advantage": what the better attempts knew).
3. `ConsolidateOperations`: every operation proposed in a batch -> one clean revision plan for the library.
4. `GenerateExperiences`: the "directly generated experiences" baseline's single call.
"""

import dspy

from tfgrpo.signatures.operations import Operation


class SummarizeRollout(dspy.Signature):
    """You review one attempt by an AI system at a task. Retrace the attempt step by step in a compact summary.

    Say which of the listed experiences (by ID) the attempt applied or ignored, which steps moved it toward
    the goal, and where it made an error, took a detour or skipped a check. The outcome tells whether the
    attempt was judged successful; when a reference answer is given, use it to locate the first wrong step.
    Be concrete about methods and reasoning, not about this problem's particular numbers."""

    # the inputs a step's calls share come first (the library, then the group's query), so that a provider that caches
    # a repeated prompt prefix bills them once
    experiences: str = dspy.InputField(desc="the experiences the attempt had in its prompt, one per line with its ID")
    task_input: str = dspy.InputField(desc="the query the attempt worked on")
    reference_answer: str = dspy.InputField(desc="the correct answer")
    attempt: str = dspy.InputField(desc="the attempt's reasoning, tool calls and final output")
    outcome: str = dspy.InputField(desc="how the attempt was judged (reward and any feedback)")
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

    experiences: str = dspy.InputField(desc="the current experience library, one per line with its ID")
    max_operations: int = dspy.InputField(desc="the most operations you may propose")
    max_words: int = dspy.InputField(desc="the most words an experience may have")
    task_input: str = dspy.InputField(desc="the query all attempts worked on")
    reference_answer: str = dspy.InputField(desc="the correct answer")
    attempts: str = dspy.InputField(desc="summaries of the attempts, each with its reward")
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


class GenerateExperiences(dspy.Signature):
    """Write general advice for an AI system that will work on tasks like the examples shown, before it has
    tried any of them. Give exactly `count` pieces of advice, each one sentence of at most `max_words` words
    that starts with the situation it applies to ("When ..., ...") and states a reusable strategy or check."""

    task_examples: str = dspy.InputField(desc="a few example queries of the task")
    count: int = dspy.InputField(desc="how many pieces of advice to write")
    max_words: int = dspy.InputField(desc="the most words per piece of advice")
    experiences: list[str] = dspy.OutputField(desc="the advice, one string per item")
