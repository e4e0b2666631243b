"""The small-reflector learning call as a DSPy module: a better and a worse attempt in, at most one
validated `Operation` out.

Every reply is typed by a signature built from the live library (`contrast_signature`), optionally decoded
under its JSON schema (`ConstrainedJSONAdapter`), and checked in code for generality: a rule that repeats
the query's names, numbers or phrases (or the learning prompt's own words: "the better attempt", "a new
rule") is sent back once to be rewritten, and refused if it still does.
In a program of several predictors (`roles`) the reply also names the predictor its rule is for, typed by their names.
The result is a plain dict that says what happened, so every refusal can be counted; its `operation` the edit.
"""

from __future__ import annotations

import dspy
from tfgrpo.programs.constrained import ConstrainedJSONAdapter, Mode
from tfgrpo.programs.generality import parroted_phrases, restated_words, specific_terms
from tfgrpo.programs.learning import call_with_one_retry, single_call_adapter
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.contrast import GeneralizeRule, contrast_signature
from tfgrpo.signatures.operations import Operation, placed

EMPTY = "(empty: no rules yet)"


class ContrastLearner(dspy.Module):
    def __init__(self, *, max_words: int = 32, constrained: Mode | None = None):
        super().__init__()
        self.max_words = max_words  # the longest rule the library accepts
        self.adapter = ConstrainedJSONAdapter(constrained) if constrained else None  # None: DSPy's default adapter

    def forward(self, *, task: str, better_attempt: str, worse_attempt: str, library: ExperienceLibrary,
                allowed: str = "", seen: str = "", roles: dict[str, str] | None = None) -> dict:
        """`allowed`: text whose words and numbers belong to the task itself (the program's instructions);
        `seen`: what the attempts' tools returned (search results, pages), whose names and facts are as specific
        to this task as the task's own; `roles`: the program's predictors, by name, with what each does (None: one
        predictor)."""
        sig = contrast_signature(list(library.active), self.max_words, list(roles or []))
        inputs = {"predictors": "\n".join(f"{name}: {role}" for name, role in roles.items())} if roles else {}
        reply = self._call(sig, task=task, better_attempt=better_attempt, worse_attempt=worse_attempt,
                           library=library.render(tagged=bool(roles)) or EMPTY, **inputs)
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
        rec["operation"] = placed(list(roles)).model_validate(
            {"action": rec["action"], "ids": ids, "text": rec["rule"], "predictors": [reply.predictor]}) if roles \
            else Operation(action=rec["action"], ids=ids, text=rec["rule"])
        return rec

    @staticmethod
    def _specific(rule: str, task: str, specific_to: str, allowed: str) -> list[str]:
        """What makes `rule` a restatement of its query, or of `specific_to` (the query and what the tools returned:
        names and numbers only, as a page's common words are anyone's), or of the learning prompt; empty when it
        reads as general."""
        terms = specific_terms(rule, specific_to, allowed=allowed) or restated_words(rule, task, allowed=allowed)
        return terms + parroted_phrases(rule)

    def _call(self, signature: type[dspy.Signature], **inputs) -> dspy.Prediction:
        with dspy.context(adapter=self.adapter or single_call_adapter()):
            return call_with_one_retry(dspy.Predict(signature), inputs, caller=type(self).__name__)
