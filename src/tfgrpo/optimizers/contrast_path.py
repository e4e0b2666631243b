"""The small reflectors' learning path ("contrast").

Per group with reward contrast, the best attempts are paired with the worst ones (at most
`max_operations_per_group` pairs); each pair is one `ContrastLearner` call that proposes at most one
operation. The batch's proposals are folded in code instead of by a consolidation call: a proposal that
says what an existing experience (or an earlier proposal) already says is dropped as redundant. Attempts that
used tools are shown as their actions, without what the tools returned, and a rule may not repeat the names in
those returns either: a 1.5B reflector otherwise writes the facts it was shown as "rules".
"""

from __future__ import annotations

import logging

import dspy

from tfgrpo.base.util import clip
from tfgrpo.optimizers.records import Failed, Group, Lessons, Scored
from tfgrpo.optimizers.runner import LearningPath, Run, Scope
from tfgrpo.programs.contrast_learner import ContrastLearner
from tfgrpo.programs.library import ExperienceLibrary, overlap
from tfgrpo.programs.render import format_fields, outcome, tool_actions, tool_observations
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


REDUNDANT_OVERLAP = 0.5  # Jaccard overlap of content words above which two experiences say the same thing


def contrast_pairs(rewards: list[float], max_pairs: int) -> list[tuple[int, int]]:
    """(better, worse) attempt indices: the k-th best against the k-th worst while the first scored higher."""
    best = sorted(range(len(rewards)), key=lambda g: (-rewards[g], g))
    worst = sorted(range(len(rewards)), key=lambda g: (rewards[g], g))
    pairs = []
    for b, w in zip(best, worst):
        if len(pairs) >= max_pairs or rewards[b] <= rewards[w]:
            break
        pairs.append((b, w))
    return pairs


def fold(existing: list[str], proposals: list[Operation]) -> tuple[list[Operation], int]:
    """The plan from one batch's proposals, and how many were dropped as redundant.

    An "add" close to an existing experience or to an earlier add of the plan is dropped; only the first
    "modify" of each experience is kept (the others came from the same batch and could not see it)."""
    plan, seen_texts, modified, redundant = [], list(existing), set(), 0
    for op in proposals:
        if op.action == "add" and any(overlap(op.text, t) >= REDUNDANT_OVERLAP for t in seen_texts):
            redundant += 1
            continue
        if op.action == "modify" and op.ids and op.ids[0] in modified:
            redundant += 1
            continue
        modified.update(op.ids if op.action == "modify" else [])
        seen_texts.append(op.text)
        plan.append(op)
    return plan, redundant


def constrained_mode(setting: str, reflection_lm) -> str | None:
    """The response format of the contrast calls for the `constrained_decoding` knob ("auto": json_schema
    where LiteLLM says the model supports it, else none)."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    try:
        return "json_schema" if reflection_lm.supports_response_schema else None
    except Exception:  # an LM whose capabilities cannot be looked up: parse and validate only
        return None


class ContrastPath(LearningPath):
    """Per group, up to `max_operations_per_group` (better, worse) pairs, one `ContrastLearner` call each; the batch's
    proposals folded in code (no consolidation call)."""

    stages = ("contrast",)

    @staticmethod
    def _shown(attempt: Scored) -> str:
        """A tool-using attempt is shown as its actions (a small model copies the facts its tools returned into
        its "rules"); any other attempt as recorded."""
        actions = tool_actions(attempt.outputs)
        return f"{clip(chr(10).join(actions) if actions else attempt.text, 2000)}\nresult: {outcome(attempt)}"

    def learn(self, run: Run, scope: Scope, library: ExperienceLibrary, group: Group) -> list:
        knobs = run.knobs
        learner = ContrastLearner(max_words=knobs.max_words_per_experience,
                                  constrained=constrained_mode(knobs.constrained_decoding, run.reflection_lm))
        task, attempts = format_fields(group.example.inputs()), group.attempts

        def contrast(better: Scored, worse: Scored):
            seen = "\n".join(o for a in (better, worse) for o in tool_observations(a.outputs))

            def call():
                with dspy.context(lm=run.reflection_lm):
                    return learner(task=task, better_attempt=self._shown(better), worse_attempt=self._shown(worse),
                                   library=library, allowed=run.instructions, seen=seen, roles=run.roles or None)
            return call

        pairs = contrast_pairs(group.rewards, knobs.max_operations_per_group)
        return scope.calls("contrast", [contrast(attempts[b], attempts[w]) for b, w in pairs])

    def finish(self, run: Run, scope: Scope, library: ExperienceLibrary, results: list[tuple[Group, list]]
               ) -> Lessons:
        proposals, failures, proposed = [], 0, 0
        counts = {"refused_specific": 0, "rewritten_specific": 0, "redundant": 0, "said_none": 0}
        for group, replies in results:
            for rec in replies:
                if isinstance(rec, Failed):
                    failures += 1
                    logger.warning("Contrast call on query %s failed (%s); it proposes nothing", group.index, rec.error)
                    continue
                counts["said_none"] += rec["action"] == "none"
                proposed += rec["action"] != "none"
                counts["rewritten_specific"] += rec["rewritten"] and rec["refused"] is None
                counts["refused_specific"] += bool(rec["refused"])
                if rec["refused"]:
                    logger.warning("Refused a rule from query %s: %s (%r)", group.index, rec["refused"], rec["rule"][:80])
                if rec["operation"]:
                    proposals.append((group.key, rec["operation"]))
        plan, counts["redundant"] = fold(library.texts(), [op for _, op in proposals])
        return Lessons(plan=plan, proposals=proposals, learning_failures=failures, operations_proposed=proposed,
                       details=counts, consolidation=f"folded in code: {len(plan)} of {len(proposals)} kept")
