"""The learning calls of one optimization step, as per-group flows (see `parallel.run_flows`).

A learning path turns the groups with reward contrast into a plan of library operations in two parts: `learn(qi)`,
a generator that yields one group's LM calls as they become possible (so a group starts learning as soon as its own
rollouts are scored, while other groups still roll out), and `finish(kept, stats)`, which runs once every group is
done: the stage-wide failure checks, then the batch's plan. `PaperPath` is the paper's path (summaries -> group
advantage -> one consolidation call); `contrast.ContrastPath` is the path for small reflection models.
"""

from __future__ import annotations

import logging

import dspy

from tfgrpo.optimizers.parallel import Failed, StageBar, WaitFor, run_flows
from tfgrpo.optimizers.render import clip, format_fields, outcome, query_key
from tfgrpo.optimizers.usage import metered, metered_stages, stage_usage
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


class LearningPath:
    """One step's learning for `opt` (a TrainingFreeGRPO). `records[(qi, g)]` are the scored attempts; every LM
    call is a checkpointed unit under `key` in `ckpt`; `lms[stage]` is the LM copy that prices a stage; `stats` is
    the step's record (its "step" and "usage" at least), which `finish` completes."""

    stages: tuple[str, ...] = ()

    def __init__(self, opt, program, reflection_lm, library, trainset, records, key, ckpt, stats):
        self.opt, self.program, self.reflection_lm, self.library = opt, program, reflection_lm, library
        self.trainset = trainset
        self.records, self.key, self.ckpt, self.stats, self.G = records, key, ckpt, stats, opt.num_generations
        self.results: dict = {}  # qi -> what its flow produced
        self.lms: dict[str, dspy.BaseLM] = {}

    def learn(self, qi):
        raise NotImplementedError

    def stage_done(self, stage: str) -> None:
        """The check of a learning stage at which some flow waits (`WaitFor`): every unit of it has run."""

    def finish(self, kept: list) -> tuple[list[Operation], list[tuple[str, Operation]], dict]:
        raise NotImplementedError

    def run(self, kept: list):
        """The learning of `kept` groups whose attempts are all scored (benchmarks): their flows, then `finish`."""
        with metered_stages(self.stages) as meters:
            run_flows([self.learn(qi) for qi in kept], num_threads=self.opt.num_threads, progress=self.opt.progress,
                      meters=meters, on_stage_done=self.stage_done)
        for stage in self.stages:
            self.stats["usage"][stage] = stage_usage(meters[stage], [self.lms[stage]])
        return self.finish(kept)

    def _call(self, unit: str, fn):
        """A checkpointed learning call: the saved result, or `fn()` saved; a call that raises is a `Failed`."""
        if (rec := self.ckpt.get(unit)) is not None:
            return rec
        try:
            rec = fn()
        except Exception as exc:  # a failed learning call is counted, not fatal
            return Failed(exc)
        self.ckpt.put(unit, rec)
        return rec


class PaperPath(LearningPath):
    """Summarize every attempt of a group, extract the group's advantage as operations, consolidate the batch's
    operations in one call."""

    stages = ("summary", "advantage")

    def __init__(self, *args):
        super().__init__(*args)
        gt = self.opt.use_ground_truth
        self.summarizer, self.advantage, self.consolidator = Summarizer(gt), AdvantageExtractor(gt), Consolidator()
        self.lms = {name: self.reflection_lm.copy() for name in ("summary", "advantage", "consolidation")}
        for module, name in ((self.summarizer, "summary"), (self.advantage, "advantage"),
                             (self.consolidator, "consolidation")):
            module.set_lm(self.lms[name])
        self.rendered = self.library.render() or EMPTY_LIBRARY  # the library as every call of the step sees it
        self.failed_summaries: list[tuple[int, int, str]] = []
        self.summarized = 0  # summary calls made so far

    def _answer_key(self, qi) -> str:
        """The ground truth shown to learning calls: the labels the program also outputs (else all labels)."""
        if not self.opt.use_ground_truth:
            return ""
        labels = dict(self.trainset[qi].labels())
        produced = {k for g in range(self.G) for k in (self.records[(qi, g)]["outputs"] or {})}
        return clip(format_fields({k: v for k, v in labels.items() if k in produced} or labels), 2000)

    def learn(self, qi):
        answer_key, task = self._answer_key(qi), format_fields(self.trainset[qi].inputs())

        def summarize(g):
            r = self.records[(qi, g)]
            return self._call(f"{self.key}/summaries/{qi}_{g}", lambda: self.summarizer(
                task_input=task, attempt=r["attempt"], outcome=outcome(r), reference_answer=answer_key,
                experiences=self.rendered))

        summaries = yield [("summary", summarize, g) for g in range(self.G)]
        self.summarized += self.G
        if failed := [(qi, g, s.error) for g, s in enumerate(summaries) if isinstance(s, Failed)]:
            self.failed_summaries += failed
            yield WaitFor("summary")  # an outage stops the step before it costs advantage calls too
        for g, summary in enumerate(summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", qi, g, summary.error)
                summary = clip(self.records[(qi, g)]["attempt"], 1500)
            self.records[(qi, g)]["summary"] = summary

        def extract(_):
            attempts = "\n\n".join(f"Attempt {g + 1} (reward {self.records[(qi, g)]['reward']:.2f}):\n"
                                   f"{self.records[(qi, g)]['summary']}" for g in range(self.G))
            return self._call(f"{self.key}/advantages/{qi}", lambda: [o.model_dump() for o in self.advantage(
                task_input=task, reference_answer=answer_key, attempts=attempts, experiences=self.rendered,
                max_operations=self.opt.max_operations_per_group, max_words=self.opt.max_words_per_experience)])

        self.results[qi] = (yield [("advantage", extract, qi)])[0]

    def stage_done(self, stage):
        if stage == "summary":  # more than max_failure_rate of them failed: stop, unfinished (a resume redoes them)
            self.opt._stop_if_failing(self.stats["step"], "summary calls", [e for _, _, e in self.failed_summaries],
                                      self.summarized)

    def finish(self, kept):
        stats, advantages = self.stats, [(qi, self.results[qi]) for qi in kept]
        errors = [o.error for _, o in advantages if isinstance(o, Failed)]
        self.opt._stop_if_failing(stats["step"], "advantage calls", errors, len(kept))
        proposals, failures = [], len(self.failed_summaries)
        for qi, ops in advantages:
            if isinstance(ops, Failed):
                failures += 1
                logger.warning("Group advantage of query %s failed (%s); the group proposes nothing", qi, ops.error)
                continue
            proposals += [(query_key(self.trainset[qi], qi), Operation.model_validate(o)) for o in ops]
        with metered() as used:
            plan, stats["consolidation"] = self._consolidate(proposals)
        stats["usage"]["consolidation"] = stage_usage(used, [self.lms["consolidation"]])
        return plan, proposals, {"learning_failures": failures, "operations_proposed": len(proposals)}

    def _consolidate(self, proposals) -> tuple[list[Operation], str]:
        """One call turns the batch's proposals into the plan; if it fails, the (validated) proposals are the plan."""
        if not proposals:
            return [], "nothing proposed"
        if (saved := self.ckpt.get(f"{self.key}/plan")) is not None:
            return [Operation.model_validate(o) for o in saved["plan"]], saved["status"]
        progress = self.opt.progress or StageBar()
        progress("consolidation", 0, 1)
        try:
            plan, status = self.consolidator(experiences=self.rendered, proposals=proposals,
                                             max_words=self.opt.max_words_per_experience), "ok"
        except Exception as exc:  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", exc, len(proposals))
            plan, status = [op for _, op in proposals], "fallback: proposals applied directly"
        self.ckpt.put(f"{self.key}/plan", {"plan": [o.model_dump() for o in plan], "status": status})
        progress("consolidation", 1, 1)
        return plan, status
