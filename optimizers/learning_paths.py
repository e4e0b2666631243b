"""Learning paths: how one step's informative groups become a plan of library operations.

A path is a plug-in with a small contract, so that a new way of learning needs nothing of the optimizer's insides:

    class MyPath(LearningPath):
        stages = ("lesson",)                       # the stages its LM calls are metered and checked under

        def learn(self, ctx, group):               # a generator: one group's calls, as they become possible
            (reply,) = yield [("lesson", lambda _: ctx.call(f"lessons/{group.index}", ask), None)]
            return reply                           # the group's result, handed to finish()

        def finish(self, ctx, results):            # once every group is done: [(group, its result)] -> the plan
            return Learned(plan=[...], proposals=[(group.key, op), ...])

`learn` yields lists of units `(stage, fn, item)` and is sent back their results (see `parallel.run_flows`), so a
group starts learning as soon as its own attempts are scored while other groups still roll out; `ctx.call` makes a
checkpointed LM call that returns a `Failed` instead of raising; `ctx.count_failures` reports a stage's failures,
and the optimizer stops the step at that stage's check when more than `max_failure_rate` of its units failed.
`PaperPath` is the paper's path (summaries -> group advantage -> one consolidation call); `contrast.ContrastPath` is
the path for small reflection models. Pass an instance as `learning_path=` to plug in your own.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import dspy

from tfgrpo.base.util import clip
from tfgrpo.optimizers.attempts import Group
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.optimizers.parallel import Failed, StageBar, TooManyFailuresError, WaitFor
from tfgrpo.optimizers.render import format_fields, outcome
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation

if TYPE_CHECKING:
    from tfgrpo.optimizers.knobs import Knobs  # the knobs import this module (a learning_path may be a LearningPath)

logger = logging.getLogger(__name__)

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


@dataclass
class Learned:
    """What a path makes of a step: the plan, every proposal with the key of the query it came from, and counts
    (learning_failures and operations_proposed at least; path-specific ones besides)."""

    plan: list[Operation]
    proposals: list[tuple[str, Operation]] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    consolidation: str = ""


class StepContext:
    """What a learning path may use during one step: the library as the step started (read it, never edit it), the
    trainset, the program's instructions, the reflection LM and one private copy of it per stage (`lm(stage)`, so
    each stage's usage is priced apart), checkpointed calls and the failure guard."""

    def __init__(self, *, step: int, settings: Knobs, reflection_lm: dspy.BaseLM, library: ExperienceLibrary,
                 trainset: list, instructions: str, ckpt: Checkpoint, key: str, meters: dict,
                 progress: Callable[[str, int, int], None] | None = None, saved: Callable[[], None] | None = None):
        self.step, self.settings, self.reflection_lm, self.library = step, settings, reflection_lm, library
        self.trainset, self.instructions, self.progress = trainset, instructions, progress
        self._ckpt, self._key, self._meters = ckpt, key, meters
        self._saved = saved or (lambda: None)  # told after each saved call (the step keeps what it has spent)
        self._lms: dict[str, dspy.BaseLM] = {}
        self._failures: dict[str, tuple[list[str], int]] = {}

    def lm(self, stage: str) -> dspy.BaseLM:
        """The stage's own copy of the reflection LM (the same one for every call of the stage)."""
        if stage not in self._lms:
            self._lms[stage] = self.reflection_lm.copy()
        return self._lms[stage]

    def stage_lms(self, stage: str) -> list[dspy.BaseLM]:
        return [self._lms[stage]] if stage in self._lms else []

    def call(self, unit: str, fn: Callable[[], Any]) -> Any:
        """A checkpointed learning call: the saved result, or `fn()` saved; a call that raises is a `Failed`."""
        name = f"{self._key}/{unit}"
        if (rec := self._ckpt.get(name)) is not None:
            return rec
        try:
            rec = fn()
        except Exception as exc:  # a failed learning call is counted, not fatal
            return Failed(exc)
        self._ckpt.put(name, rec)
        self._saved()
        return rec

    def count_failures(self, stage: str, errors: list[str], total: int) -> None:
        """Report `total` more units of `stage`, of which `errors` failed."""
        seen, n = self._failures.get(stage, ([], 0))
        self._failures[stage] = (seen + list(errors), n + total)

    def check(self, stage: str) -> None:
        """Stop the step, unfinished, when more than `max_failure_rate` of the stage's units failed: an outage must
        not pass for "nothing to learn". A resume redoes the failed units."""
        errors, total = self._failures.get(stage, ([], 0))
        if total and len(errors) > self.settings.max_failure_rate * total:
            units = "attempts" if stage == "rollout" else f"{stage} calls"
            log_dir = str(self._ckpt.root) if self._ckpt.root is not None else None
            raise TooManyFailuresError(f"step {self.step}: {len(errors)} of {total} {units} failed "
                                       f"(first: {errors[0]}); finished work is kept in log_dir={log_dir!r}")

    @contextmanager
    def metered(self, stage: str):
        """Run calls outside the flows (a batch-wide call such as a consolidation) under their stage's meter."""
        with dspy.context(usage_tracker=self._meters[stage]):
            yield


class LearningPath:
    """The contract of a learning path (see the module docstring). Instances hold settings only; everything of one
    step lives in the `StepContext` and in the values `learn` returns, so one instance serves every step."""

    stages: tuple[str, ...] = ()

    def learn(self, ctx: StepContext, group: Group):
        raise NotImplementedError
        yield  # a generator

    def finish(self, ctx: StepContext, results: list[tuple[Group, Any]]) -> Learned:
        raise NotImplementedError


class PaperPath(LearningPath):
    """Summarize every attempt of a group, extract the group's advantage as operations, consolidate the batch's
    operations in one call."""

    stages = ("summary", "advantage", "consolidation")

    def _answer_key(self, ctx: StepContext, group: Group) -> str:
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

        def summarize(g):
            a = group.attempts[g]
            return ctx.call(f"summaries/{group.index}_{g}", lambda: summarizer(
                task_input=task, attempt=a.text, outcome=outcome(a), reference_answer=answer_key, experiences=rendered))

        summaries = yield [("summary", summarize, g) for g in range(len(group.attempts))]
        failed = [s.error for s in summaries if isinstance(s, Failed)]
        ctx.count_failures("summary", failed, len(summaries))
        if failed:
            yield WaitFor("summary")  # an outage stops the step before it costs advantage calls too
        shown = []
        for g, summary in enumerate(summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", group.index, g,
                               summary.error)
                summary = clip(group.attempts[g].text, 1500)
            shown.append(f"Attempt {g + 1} (reward {group.attempts[g].reward:.2f}):\n{summary}")

        def extract(_):
            return ctx.call(f"advantages/{group.index}", lambda: [o.model_dump() for o in extractor(
                task_input=task, reference_answer=answer_key, attempts="\n\n".join(shown), experiences=rendered,
                max_operations=ctx.settings.max_operations_per_group,
                max_words=ctx.settings.max_words_per_experience)])

        (ops,) = yield [("advantage", extract, None)]
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
        with ctx.metered("consolidation"):
            plan, status = self._consolidate(ctx, proposals)
        return Learned(plan=plan, proposals=proposals, consolidation=status,
                       counts={"learning_failures": failures, "operations_proposed": len(proposals)})

    def _consolidate(self, ctx: StepContext, proposals) -> tuple[list[Operation], str]:
        """One call turns the batch's proposals into the plan; if it fails, the (validated) proposals are the plan."""
        if not proposals:
            return [], "nothing proposed"
        consolidator = Consolidator()
        consolidator.set_lm(ctx.lm("consolidation"))
        progress = ctx.progress or StageBar()
        progress("consolidation", 0, 1)

        def consolidate():
            plan = consolidator(experiences=ctx.library.render() or EMPTY_LIBRARY, proposals=proposals,
                                max_words=ctx.settings.max_words_per_experience)
            return {"plan": [o.model_dump() for o in plan], "status": "ok"}

        saved = ctx.call("plan", consolidate)
        if isinstance(saved, Failed):  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", saved.error, len(proposals))
            saved = ctx.call("plan", lambda: {"plan": [op.model_dump() for _, op in proposals],
                                              "status": "fallback: proposals applied directly"})
        progress("consolidation", 1, 1)
        return [Operation.model_validate(o) for o in saved["plan"]], saved["status"]

