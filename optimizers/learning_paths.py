"""Learning paths: how one step's informative groups become a plan of library operations; and the paper's path.

A path is a plug-in with a small contract, so that a new way of learning needs nothing of the optimizer's insides:

    class MyPath(LearningPath):
        stages = ("lesson",)                          # the stages its LM calls are metered and checked under

        def learn(self, run, library, group):         # one group's calls (groups run side by side)
            def lesson():                             # one learning call, under run.reflection_lm
                with dspy.context(lm=run.reflection_lm):
                    return dspy.Predict("attempts -> lesson")(attempts=...).lesson
            return run.runner.call("lesson", f"lessons/{group.index}", lesson)

        def finish(self, run, library, results):      # once every group is done: [(group, its result)] -> the plan
            return Lessons(plan=[...], proposals=[(group.key, op), ...])

`run` is the run (`step.Run`): its knobs (`run.knobs`), the reflection LM (`run.reflection_lm`), the program's
instructions and the runner (`run.runner`). `library` is the library as the step started: read it, never
edit it. `run.runner.call(stage, name, fn)` (or `calls` for several at once) makes a learning call on the step's
bounded pool: checkpointed under the step as `name`, charged to the budget, metered under `stage`; one that raises
comes back as a `Failed` and is counted, and when more than `max_failure_rate` of a stage's calls failed the step
stops. `run.runner.settle(stage, group.index, failed)` holds a group that saw failures until every group has reached
the stage and its failure check has passed. The paper's path is `PaperPath` (below); `ContrastPath` (below too) is
the path for small reflection models. Pass an instance as `learning_path=` to plug in your own; `step.learn_from_groups` runs a
path on groups scored elsewhere (saved rollouts, say).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import dspy

from tfgrpo.base.util import clip
from tfgrpo.optimizers.records import Failed, Group, LearningPath, Lessons, Scored
from tfgrpo.programs.contrast_learner import ContrastLearner
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.programs.render import format_fields, outcome, tool_actions, tool_observations
from tfgrpo.signatures.operations import Operation

if TYPE_CHECKING:
    from tfgrpo.optimizers.step import Run

logger = logging.getLogger(__name__)

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


class PaperPath(LearningPath):
    """The paper's path, for a capable reflection LM: summarize every attempt of a group, extract the group's advantage
    as operations, and consolidate the batch's operations in one call."""

    stages = ("summary", "advantage", "consolidation")

    def learn(self, run: Run, library: ExperienceLibrary, group: Group) -> dict:
        knobs, ex = run.knobs, run.runner
        labels, produced = dict(group.example.labels()), {k for a in group.attempts for k in (a.outputs or {})}
        # the ground truth shown to the learning calls: the labels the program also outputs (else all of them)
        answer_key = clip(format_fields({k: v for k, v in labels.items() if k in produced} or labels), 2000) \
            if knobs.use_ground_truth else ""
        rendered = library.render() or EMPTY_LIBRARY
        task = format_fields(group.example.inputs())
        summarizer, extractor = Summarizer(knobs.use_ground_truth), AdvantageExtractor(knobs.use_ground_truth)
        summarizer.set_lm(run.reflection_lm)
        extractor.set_lm(run.reflection_lm)

        def summarize(a):  # 1. one summary per attempt
            return lambda: summarizer(task_input=task, attempt=a.text, outcome=outcome(a), reference_answer=answer_key,
                                      experiences=rendered)

        summaries = ex.calls("summary", {f"summaries/{group.index}_{a.g}": summarize(a) for a in group.attempts})
        failed = [s.error for s in summaries if isinstance(s, Failed)]
        ex.settle("summary", group.index, bool(failed))  # an outage stops the step before it costs advantage calls
        shown = []
        for a, summary in zip(group.attempts, summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", group.index, a.g,
                               summary.error)
                summary = clip(a.text, 1500)
            shown.append(f"Attempt {a.g + 1} (reward {a.reward:.2f}):\n{summary}")

        def extract():  # 2. the group's advantage, as operations
            return [o.model_dump() for o in extractor(
                task_input=task, reference_answer=answer_key, attempts="\n\n".join(shown), experiences=rendered,
                max_operations=knobs.max_operations_per_group, max_words=knobs.max_words_per_experience)]

        return {"ops": ex.call("advantage", f"advantages/{group.index}", extract), "failed_summaries": len(failed)}

    def finish(self, run: Run, library: ExperienceLibrary, results: list[tuple[Group, dict]]) -> Lessons:
        proposals, failures = [], 0
        for group, res in results:
            failures += res["failed_summaries"]
            if isinstance(res["ops"], Failed):
                failures += 1
                logger.warning("Group advantage of query %s failed (%s); the group proposes nothing", group.index,
                               res["ops"].error)
                continue
            proposals += [(group.key, Operation.model_validate(o)) for o in res["ops"]]
        plan, status = self._consolidate(run, library, proposals)  # 3. one call for the batch
        return Lessons(plan=plan, proposals=proposals, consolidation=status,
                       counts={"learning_failures": failures, "operations_proposed": len(proposals)})

    @staticmethod
    def _consolidate(run: Run, library: ExperienceLibrary, proposals: list[tuple[str, Operation]]
                     ) -> tuple[list[Operation], str]:
        """One call turns the batch's proposals into the plan; if it fails, the (validated) proposals are the plan."""
        if not proposals:
            return [], "nothing proposed"
        consolidator = Consolidator()
        consolidator.set_lm(run.reflection_lm)

        def consolidate():
            plan = consolidator(experiences=library.render() or EMPTY_LIBRARY, proposals=proposals,
                                max_words=run.knobs.max_words_per_experience)
            return {"plan": [o.model_dump() for o in plan], "status": "ok"}

        saved = run.runner.call("consolidation", "plan", consolidate)
        if isinstance(saved, Failed):  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", saved.error, len(proposals))
            saved = {"plan": [op.model_dump() for _, op in proposals], "status": "fallback: proposals applied directly"}
            run.runner.keep(f"{run.runner.prefix}/plan", saved)
        return [Operation.model_validate(o) for o in saved["plan"]], saved["status"]


# -- the contrast path ------------------------------------------------------------------------------------------------
# The small reflectors' learning path ("contrast").
#
# Per group with reward contrast, the best attempts are paired with the worst ones (at most
# `max_operations_per_group` pairs); each pair is one `ContrastLearner` call that proposes at most one
# operation. The batch's proposals are folded in code instead of by a consolidation call: a proposal that
# says what an existing experience (or an earlier proposal) already says is dropped as redundant. Attempts that
# used tools are shown as their actions, without what the tools returned, and a rule may not repeat the names in
# those returns either: a 1.5B reflector otherwise writes the facts it was shown as "rules".

REDUNDANT_OVERLAP = 0.5  # Jaccard overlap of content words above which two experiences say the same thing
_STOP = {"a", "an", "the", "to", "of", "and", "or", "in", "on", "for", "with", "by", "is", "are", "be", "it", "its",
         "each", "every", "all", "any", "that", "this", "when", "then", "as", "at", "from", "into", "if", "use"}


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


def overlap(a: str, b: str) -> float:
    """Jaccard overlap of the content words of two texts."""
    wa, wb = ({w for w in re.findall(r"[a-z0-9]+", t.lower()) if w not in _STOP} for t in (a, b))
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


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

    def learn(self, run: Run, library: ExperienceLibrary, group: Group) -> list:
        knobs = run.knobs
        learner = ContrastLearner(max_words=knobs.max_words_per_experience,
                                  constrained=constrained_mode(knobs.constrained_decoding, run.reflection_lm))
        task, attempts = format_fields(group.example.inputs()), group.attempts

        def contrast(better: Scored, worse: Scored):
            seen = "\n".join(o for a in (better, worse) for o in tool_observations(a.outputs))

            def call():
                with dspy.context(lm=run.reflection_lm):
                    return learner(task=task, better_attempt=self._shown(better), worse_attempt=self._shown(worse),
                                   library=library, allowed=run.instructions, seen=seen)
            return f"contrasts/{group.index}_{better.g}_{worse.g}", call

        pairs = contrast_pairs(group.rewards, knobs.max_operations_per_group)
        return run.runner.calls("contrast", dict(contrast(attempts[b], attempts[w]) for b, w in pairs))

    def finish(self, run: Run, library: ExperienceLibrary, results: list[tuple[Group, list]]) -> Lessons:
        proposals, counts = [], {"learning_failures": 0, "operations_proposed": 0, "refused_specific": 0,
                                 "rewritten_specific": 0, "redundant": 0, "said_none": 0}
        for group, replies in results:
            for rec in replies:
                if isinstance(rec, Failed):
                    counts["learning_failures"] += 1
                    logger.warning("Contrast call on query %s failed (%s); it proposes nothing", group.index, rec.error)
                    continue
                counts["said_none"] += rec["action"] == "none"
                counts["operations_proposed"] += rec["action"] != "none"
                counts["rewritten_specific"] += rec["rewritten"] and rec["refused"] is None
                counts["refused_specific"] += bool(rec["refused"])
                if rec["refused"]:
                    logger.warning("Refused a rule from query %s: %s (%r)", group.index, rec["refused"], rec["rule"][:80])
                if rec["operation"]:
                    proposals.append((group.key, Operation.model_validate(rec["operation"])))
        plan, counts["redundant"] = fold(library.texts(), [op for _, op in proposals])
        return Lessons(plan=plan, proposals=proposals, counts=counts,
                       consolidation=f"folded in code: {len(plan)} of {len(proposals)} kept")
