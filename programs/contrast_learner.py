"""The small-reflector learning call as a DSPy module: a better and a worse attempt in, at most one
validated `Operation` out.

Every reply is typed by a signature built from the live library (`contrast_signature`), optionally decoded
under its JSON schema (`ConstrainedJSONAdapter`), and checked in code for generality: a rule that repeats
the query's names, numbers or phrases (or the learning prompt's own words: "the better attempt", "a new
rule") is sent back once to be rewritten, and refused if it still does.
The result is a plain dict (for checkpoints) that says what happened, so every refusal can be counted.
"""

from __future__ import annotations

import dspy
from dspy.adapters import ChatAdapter

from tfgrpo.programs.constrained import ConstrainedJSONAdapter, Mode
from tfgrpo.programs.excerpt import checked_excerpt
from tfgrpo.programs.generality import parroted_phrases, restated_words, specific_terms
from tfgrpo.programs.learning import call_with_one_retry, single_call_adapter
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.contrast import GeneralizeRule, PickExcerpt, contrast_signature
from tfgrpo.signatures.operations import ExcerptOperation, Operation

EMPTY = "(empty: no rules yet)"


class ContrastLearner(dspy.Module):
    def __init__(self, *, max_words: int = 32, constrained: Mode | None = None, max_excerpt_lines: int = 0,
                 whole_attempt: bool = False):
        super().__init__()
        self.max_words = max_words  # the longest rule the library accepts
        self.max_excerpt_lines = max_excerpt_lines  # > 0: an added rule carries lines copied from the better attempt
        self.whole_attempt = whole_attempt  # the excerpt is the better attempt itself when it fits, no LM call
        self.adapter = ConstrainedJSONAdapter(constrained) if constrained else None  # None: DSPy's default adapter

    def forward(self, *, task: str, better_attempt: str, worse_attempt: str, library: ExperienceLibrary,
                allowed: str = "", seen: str = "", better_code: str = "") -> dict:
        """`allowed`: text whose words and numbers belong to the task itself (the program's instructions);
        `seen`: what the attempts' tools returned (search results, pages), whose names and facts are as specific
        to this task as the task's own; `better_code`: the better attempt as written, where an excerpt is copied
        from (with `max_excerpt_lines`)."""
        sig = contrast_signature(list(library.active), self.max_words)
        reply = self._call(sig, task=task, better_attempt=better_attempt, worse_attempt=worse_attempt,
                           library=library.render() or EMPTY)
        rec = {"difference": str(reply.difference or ""), "action": reply.action,
               "target_id": str(getattr(reply, "target_id", "none")), "rule": str(reply.rule or "").strip(),
               "specific": [], "rewritten": False, "operation": None, "refused": None}
        if rec["action"] == "none":
            return rec
        if rec["action"] == "modify" and rec["target_id"] == "none":
            rec["refused"] = "modify without a target id"
            return rec
        specific_to = f"{task}\n{seen}" if seen else task
        terms = self._specific(rec["rule"], task, specific_to, allowed)
        if terms:  # one chance to say it generally
            rec["specific"], rec["rewritten"] = terms, True
            rec["rule"] = str(self._call(GeneralizeRule, rule=rec["rule"], details=", ".join(terms)).general_rule
                              or "").strip()
            still = self._specific(rec["rule"], task, specific_to, allowed)
            if still:
                rec["refused"] = f"repeats task-specific terms: {', '.join(still)}"
                return rec
        if not rec["rule"]:
            rec["refused"] = "empty rule"
            return rec
        ids = [rec["target_id"]] if rec["action"] == "modify" else []
        if self.max_excerpt_lines and better_code:
            rec["excerpt"], rec["excerpt_refused"] = self._excerpt(rec["rule"], better_code, specific_to, allowed)
            if rec["excerpt"]:
                rec["operation"] = ExcerptOperation(action=rec["action"], ids=ids, text=rec["rule"],
                                                    excerpt=rec["excerpt"]).model_dump()
                return rec
        rec["operation"] = Operation(action=rec["action"], ids=ids, text=rec["rule"]).model_dump()
        return rec

    @staticmethod
    def _specific(rule: str, task: str, specific_to: str, allowed: str) -> list[str]:
        """What makes `rule` a restatement of its query, or of `specific_to` (the query and what the tools returned:
        names and numbers only, as a page's common words are anyone's), or of the learning prompt; empty when it
        reads as general."""
        terms = specific_terms(rule, specific_to, allowed=allowed) or restated_words(rule, task, allowed=allowed)
        return terms + parroted_phrases(rule)

    def _excerpt(self, rule: str, attempt: str, specific_to: str, allowed: str) -> tuple[str, str | None]:
        """The lines of `attempt` that carry `rule` out, picked by the LM and checked in code (programs/excerpt.py);
        with `whole_attempt`, the attempt's own code when it fits (the query's values masked)."""
        if self.whole_attempt:
            whole = checked_excerpt(attempt, attempt, specific_to, max_lines=self.max_excerpt_lines, allowed=allowed)
            if whole[0]:
                return whole
        with dspy.context(adapter=ChatAdapter()):  # code reads better as plain text than inside a JSON string
            reply = call_with_one_retry(dspy.Predict(PickExcerpt), {"rule": rule, "attempt": attempt},
                                        caller="PickExcerpt")
        return checked_excerpt(str(reply.excerpt or ""), attempt, specific_to, max_lines=self.max_excerpt_lines,
                               allowed=allowed)

    def _call(self, signature: type[dspy.Signature], **inputs) -> dspy.Prediction:
        with dspy.context(adapter=self.adapter or single_call_adapter()):
            return call_with_one_retry(dspy.Predict(signature), inputs, caller=type(self).__name__)
