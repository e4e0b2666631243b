"""The paper's learning path: summarize every attempt of a group, extract the group's advantage as operations, and
consolidate the batch's operations in one call (a capable reflection LM; `contrast.py` is the small models' path)."""

from __future__ import annotations

import logging

from tfgrpo.base.util import clip
from tfgrpo.optimizers.learning_paths import EMPTY_LIBRARY, LearningPath, Lessons, StepContext
from tfgrpo.optimizers.parallel import Failed
from tfgrpo.optimizers.render import format_fields, outcome
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


class PaperPath(LearningPath):
    """Summarize every attempt of a group, extract the group's advantage as operations, consolidate the batch's
    operations in one call."""

    stages = ("summary", "advantage", "consolidation")

    def _answer_key(self, ctx: StepContext, group) -> str:
        """The ground truth shown to learning calls: the labels the program also outputs (else all labels)."""
        if not ctx.settings.use_ground_truth:
            return ""
        labels = dict(group.example.labels())
        produced = {k for a in group.attempts for k in (a.outputs or {})}
        return clip(format_fields({k: v for k, v in labels.items() if k in produced} or labels), 2000)

    def learn(self, ctx, group):
        gt, rendered = ctx.settings.use_ground_truth, ctx.library.render() or EMPTY_LIBRARY
        answer_key, task = self._answer_key(ctx, group), format_fields(group.example.inputs())
        summarizer, extractor = Summarizer(gt), AdvantageExtractor(gt)
        summarizer.set_lm(ctx.lm("summary"))
        extractor.set_lm(ctx.lm("advantage"))

        # 1. one summary per attempt
        def summarize(g):
            a = group.attempts[g]
            return ctx.call(f"summaries/{group.index}_{g}", lambda: summarizer(
                task_input=task, attempt=a.text, outcome=outcome(a), reference_answer=answer_key, experiences=rendered))

        summaries = ctx.map("summary", summarize, list(range(len(group.attempts))))
        failed = [s.error for s in summaries if isinstance(s, Failed)]
        ctx.count_failures("summary", failed, len(summaries))
        ctx.arrive("summary", group.index)
        if failed:
            ctx.wait("summary")  # an outage stops the step before it costs advantage calls too
        shown = []
        for g, summary in enumerate(summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", group.index, g,
                               summary.error)
                summary = clip(group.attempts[g].text, 1500)
            shown.append(f"Attempt {g + 1} (reward {group.attempts[g].reward:.2f}):\n{summary}")

        # 2. the group's advantage, as operations
        def extract(_):
            return ctx.call(f"advantages/{group.index}", lambda: [o.model_dump() for o in extractor(
                task_input=task, reference_answer=answer_key, attempts="\n\n".join(shown), experiences=rendered,
                max_operations=ctx.settings.max_operations_per_group,
                max_words=ctx.settings.max_words_per_experience)])

        (ops,) = ctx.map("advantage", extract, [None])
        ctx.count_failures("advantage", [ops.error] if isinstance(ops, Failed) else [], 1)
        return {"ops": ops, "failed_summaries": len(failed)}

    def finish(self, ctx, results):
        proposals, failures = [], 0
        for group, res in results:
            failures += res["failed_summaries"]
            if isinstance(res["ops"], Failed):
                failures += 1
                logger.warning("Group advantage of query %s failed (%s); the group proposes nothing", group.index,
                               res["ops"].error)
                continue
            proposals += [(group.key, Operation.model_validate(o)) for o in res["ops"]]
        plan, status = self._consolidate(ctx, proposals)  # 3. one call for the batch
        return Lessons(plan=plan, proposals=proposals, consolidation=status,
                       counts={"learning_failures": failures, "operations_proposed": len(proposals)})

    def _consolidate(self, ctx: StepContext, proposals) -> tuple[list[Operation], str]:
        """One call turns the batch's proposals into the plan; if it fails, the (validated) proposals are the plan."""
        if not proposals:
            return [], "nothing proposed"
        consolidator = Consolidator()
        consolidator.set_lm(ctx.lm("consolidation"))

        def consolidate():
            plan = consolidator(experiences=ctx.library.render() or EMPTY_LIBRARY, proposals=proposals,
                                max_words=ctx.settings.max_words_per_experience)
            return {"plan": [o.model_dump() for o in plan], "status": "ok"}

        (saved,) = ctx.map("consolidation", lambda _: ctx.call("plan", consolidate), [None])
        if isinstance(saved, Failed):  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", saved.error, len(proposals))
            saved = ctx.call("plan", lambda: {"plan": [op.model_dump() for _, op in proposals],
                                              "status": "fallback: proposals applied directly"})
        return [Operation.model_validate(o) for o in saved["plan"]], saved["status"]
