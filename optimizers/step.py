"""One optimization step of `TrainingFreeGRPO`: a `Step` whose stages run in the order the data flows,

    learn   rollouts (Attempt) -> rewards (Scored) -> groups (Group) -> learning path (Learned)   -> a `Learning`
    probe   the plan's operations and the demo candidates, tried on other training queries    -> kept plan, demos
    apply   the kept plan, validated and applied in code to a copy of the library            -> the new library

What a step starts from (program, library, demos, batch) is fixed when it is made, and each stage returns new values
without writing into what an earlier stage made. Each group goes through `learn` at its own pace
(`parallel.run_flows`): its learning calls start as soon as its own attempts are scored, while other groups still roll
out. Every finished unit is checkpointed under `steps/NNNN/`, so a crashed step resumes without resending it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass
from functools import partial

from tfgrpo.base.util import digest
from tfgrpo.optimizers.attempts import Attempt, Group, Scored
from tfgrpo.optimizers.checkpoint import TALLY, Checkpoint
from tfgrpo.optimizers.demos import demo_candidates, keep_best, select_demos, with_learned
from tfgrpo.optimizers.learning_paths import Learned, LearningPath, StepContext
from tfgrpo.optimizers.parallel import StageBars, WaitFor, run_flows, run_parallel
from tfgrpo.optimizers.probe import Candidate, probe_queries, run_probe
from tfgrpo.optimizers.render import format_attempt, query_key
from tfgrpo.optimizers.result import StepResult
from tfgrpo.optimizers.rewards import check_metric_timeouts, reference_example, score_attempt
from tfgrpo.optimizers.rollout import run_program, warn_context_refusals, with_own_lms
from tfgrpo.optimizers.usage import add_usage, meter_totals, metered, metered_stages, stage_usage
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


def mean_reward(attempts: list[Scored]) -> float:
    return statistics.fmean(a.reward for a in attempts) if attempts else 0.0


@dataclass(frozen=True)
class Learning:
    """What `Step.learn` made: each query's group (in batch order), the learning path's plan, the usage of each of
    its stages, the metric calls that timed out, and when each stage's latest unit finished (seconds into the step)."""

    groups: list[Group]
    learned: Learned
    usage: dict[str, dict]
    timeouts: list[str]
    seconds: dict[str, float]

    @property
    def kept(self) -> list[Group]:
        """The groups with reward contrast: the ones the path learned from."""
        return [g for g in self.groups if g.informative]

    @property
    def attempts(self) -> list[Scored]:
        return [a for g in self.groups for a in g.attempts]


class Step:
    """One step over the training queries `batch`. `opt` is read for its knobs (and its metric, to score attempts);
    `path` is the learning path (`learning_paths.LearningPath`). `run()` runs the stages and saves the step's record;
    a benchmark may call `learn(groups)` and `apply(...)` on groups it has scored itself."""

    def __init__(self, opt, *, path: LearningPath, program, targets: list[str], library: ExperienceLibrary,
                 demos: list[dict], trainset: list, batch: list[int], index: int, reflection_lm, ckpt: Checkpoint,
                 epoch: int = 0, path_name: str = ""):
        self.opt, self.path, self.path_name = opt, path, path_name or type(path).__name__
        self.program, self.targets, self.library, self.demos = program, targets, library, demos
        self.trainset, self.batch, self.index, self.epoch = trainset, list(batch), index, epoch
        self.reflection_lm, self.ckpt = reflection_lm, ckpt
        self.key = f"steps/{index:04d}"
        self.instructions = " ".join(p.signature.instructions for _, p in program.named_predictors())
        self.spent_before = ckpt.get(f"{self.key}/{TALLY}", unit=False) or {}  # a resume reuses a stopped run's units
        self._meters: dict = {}  # stage -> its usage meter, as each stage starts: what `_save_spent` reads
        self._spent_lock = threading.Lock()  # units save from their threads: the latest totals win
        self._t0 = time.time()

    # -- the whole step ------------------------------------------------------------------------------------------
    def run(self) -> tuple[ExperienceLibrary, list[dict], StepResult]:
        """The step's new library, its demos and its `StepResult`; a step finished in the checkpoint is reused."""
        if (done := self.ckpt.get(f"{self.key}/done")) is not None:
            logger.info("Step %d: complete in the checkpoint, reused", self.index)
            return ExperienceLibrary.from_state(done["library"]), done.get("demos", []), StepResult(**done["stats"])
        learning = self.learn()
        plan, demos, probe, usage = learning.learned.plan, self.demos, None, dict(learning.usage)
        if self.opt.probe_size:  # each edit tried on other training queries first (optimizers/probe.py)
            plan, demos, probe, usage["probe"] = self.probe(learning)
        elif self.opt.max_demos:  # winning attempts as demos (optimizers/demos.py)
            demos = select_demos(self.demos, demo_candidates(learning.kept, self.index), self.opt.max_demos)
        library, report = self.apply(plan, learning)
        stats = self._record(learning, library, report, demos, probe, usage)
        logger.info("Step %d: %d operations proposed, applied %s, %d refused by the library; library has %d "
                    "experiences", self.index, stats.operations_proposed, report.applied, len(report.rejected),
                    len(library))
        self.ckpt.put(f"{self.key}/done", {"library": library.dump_state(), "demos": demos, "stats": stats.to_dict()})
        return library, demos, stats

    # -- stage 1: rollouts, rewards, groups, the learning path ----------------------------------------------------
    def learn(self, groups: list[Group] | None = None) -> Learning:
        """Roll out G attempts per query of the batch, score them, and learn from each group with contrast. With
        `groups` (scored already, by a benchmark), only the learning path runs, on them."""
        opt = self.opt
        given = {g.index: g for g in groups} if groups is not None else None
        programs, rollout_lms = self._rollout_programs() if given is None else ([], [])
        batch = self.batch if given is None else list(given)
        bars, seconds = StageBars(), {}

        def progress(stage, n, total):
            seconds[stage] = time.time() - self._t0  # stages overlap: when each one's latest unit finished
            (opt.progress or bars)(stage, n, total)

        logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", self.index, len(batch),
                    opt.num_generations, opt.num_threads, self.path_name)
        with metered_stages(("rollout", *self.path.stages)) as meters:
            self._meters.update(meters)
            ctx = StepContext(step=self.index, settings=opt, reflection_lm=self.reflection_lm, library=self.library,
                              trainset=self.trainset, instructions=self.instructions, ckpt=self.ckpt, key=self.key,
                              meters=meters, progress=opt.progress, saved=self._save_spent)
            flows = [self._flow(ctx, programs, qi, None if given is None else given[qi]) for qi in batch]
            try:
                done = run_flows(flows, num_threads=opt.num_threads, progress=progress, meters=meters,
                                 on_stage_done=ctx.check)
            finally:
                bars.close()
            ctx.check("rollout")
            found = [g for g, _, _ in done]
            attempts = [a for g in found for a in g.attempts]
            timeouts = [t for _, _, ts in done for t in ts]
            check_metric_timeouts(opt, self.index, timeouts, len(attempts))
            warn_context_refusals(self.index, [a.error for a in attempts if a.error])
            logger.info("Step %d: mean reward %.3f, %d/%d groups with contrast", self.index, mean_reward(attempts),
                        sum(g.informative for g in found), len(found))
            for stage in self.path.stages:  # every unit of every stage has run: the stage-wide failure checks
                ctx.check(stage)
            learned = self.path.finish(ctx, [(g, result) for g, result, _ in done if g.informative])
            seconds["learning"] = time.time() - self._t0
        usage = {"rollout": stage_usage(meters["rollout"], rollout_lms)}
        usage.update({stage: stage_usage(meters[stage], ctx.stage_lms(stage)) for stage in self.path.stages})
        return Learning(groups=found, learned=learned, usage=usage, timeouts=timeouts, seconds=seconds)

    def _flow(self, ctx: StepContext, programs: list, qi: int, group: Group | None):
        """One query's way through `learn`: its group (rolled out and scored unless given), what the path made of it
        (None without contrast), and its metric timeouts."""
        timeouts = []
        if group is None:
            G, example = self.opt.num_generations, self.trainset[qi]
            attempts = yield [("rollout", partial(self._rollout, programs), (qi, g)) for g in range(G)]
            failed = [g for g, a in enumerate(attempts) if a.error]
            ctx.count_failures("rollout", [attempts[g].error for g in failed], G)
            if failed:
                yield WaitFor("rollout")  # the stage's failure check: nothing more is spent on the query before it
                for g in failed:  # it passed, so these count (scored 0) and a resume replays them; had it failed,
                    unit = f"{self.key}/rollouts/{qi}_{g}"  # a resume would retry them: the outage may be over
                    if not self.ckpt.has(unit):  # one a resume loaded is not written again (a finished unit)
                        self.ckpt.put(unit, attempts[g].to_record())
            reference = reference_example(example, [a.to_record() for a in attempts], self.opt.use_ground_truth)
            scored = yield [("reward", self._reward, (qi, g, a, reference)) for g, a in enumerate(attempts)]
            timeouts = [timeout for _, timeout in scored if timeout]
            group = Group(index=qi, key=query_key(example, qi), example=example,
                          attempts=tuple(s for s, _ in scored))
        result = (yield from self.path.learn(ctx, group)) if group.informative else None
        return group, result, timeouts

    def _rollout_programs(self) -> tuple[list, list]:
        """G copies of the program with the library (and demos), each with private, distinct LM copies."""
        programs, lms = [], []
        for g in range(self.opt.num_generations):
            rollout_id = int(digest([self.opt.seed, self.index, g]), 16) % 2**31
            cand, copies = with_own_lms(with_learned(self.program, self.targets, self.library, self.demos),
                                        rollout_id=rollout_id, temperature=self.opt.temperature)
            programs.append(cand)
            lms += copies
        return programs, lms

    def _rollout(self, programs: list, job: tuple[int, int]) -> Attempt:
        """Attempt g on query qi (G distinct samples per query: each candidate has its own LM copies)."""
        qi, g = job
        unit = f"{self.key}/rollouts/{qi}_{g}"
        if (rec := self.ckpt.get(unit)) is not None:
            return Attempt.from_record(rec)
        _, rec = run_program(programs[g], self.trainset[qi])  # a failed attempt is recorded and scored 0
        attempt = Attempt(outputs=rec["outputs"], error=rec["error"], trace=rec["trace"], tool_calls=rec["tool_calls"],
                          text=format_attempt(dict(self.trainset[qi].inputs().items()), rec["outputs"], rec["trace"],
                                              rec["error"]))
        if not attempt.error:  # a failed one is saved by its flow once the stage's failure check has passed
            self.ckpt.put(unit, attempt.to_record())
        self._save_spent()
        return attempt

    def _reward(self, job) -> tuple[Scored, str | None]:
        """An attempt scored against the ground truth or the group's majority answer, and the metric's timeout if
        it had one (scored 0, counted, and not saved: a resume asks the metric again)."""
        qi, g, attempt, reference = job
        unit, timeout = f"{self.key}/rewards/{qi}_{g}", None
        if (rec := self.ckpt.get(unit)) is None:
            rec = score_attempt(self.opt.metric, reference, attempt.to_record(), self.opt.metric_timeout_s)
            if "timeout" in rec:
                timeout = rec["timeout"]
            else:
                self.ckpt.put(unit, rec)
            self._save_spent()
        return Scored(attempt=attempt, reward=rec["reward"], feedback=rec["feedback"]), timeout

    def _save_spent(self) -> None:
        """Save the calls and tokens of the step's finished units so far (plus what a stopped run had spent in this
        step); cost is left out: it is read from the LMs' history at the end."""
        before = self.spent_before
        with self._spent_lock:
            totals = {stage: meter_totals(meter) for stage, meter in self._meters.items()}
            self.ckpt.put(f"{self.key}/{TALLY}", {**before, **{s: add_usage(dict(before.get(s, {})), u)
                                                              for s, u in totals.items()}})

    # -- stage 2: the probe ---------------------------------------------------------------------------------------
    def probe(self, learning: Learning) -> tuple[list[Operation], list[dict], dict, dict]:
        """The plan's operations and the step's demo candidates, each tried against the current program on the same
        training queries outside the batch. Returns the kept plan, the demos, the probe's record and its usage."""
        opt, library, demos, plan = self.opt, self.library, self.demos, learning.learned.plan
        found = demo_candidates(learning.kept, self.index, min_reward=0.0) if opt.max_demos else []
        found = sorted(found, key=lambda d: (-d["reward"], -d["advantage"], d["query"]))[: (opt.max_probed_edits + 1) // 2]
        candidates = [Candidate(label=f"demo from {d['query']} (reward {d['reward']:.2f})", demo=d) for d in found]
        for op in plan:
            if len(candidates) >= opt.max_probed_edits:
                break
            if library.copy().apply([op], step=self.index).num_applied:  # one the library refuses is not worth a probe
                candidates.append(Candidate(label=f"{op.action} {op.ids or ''} {op.text[:60]!r}", operations=(op,)))
        if library.active and len(candidates) < opt.max_probed_edits:  # a spare slot: must a current experience stay?
            target = list(library.active)[self.index % len(library.active)]  # each in turn
            candidates.append(Candidate(label=f"retire {target}", operations=(Operation(action="delete", ids=[target]),)))
        record = {"candidates": [], "unprobed": max(0, len(plan) + len(found) - len(candidates))}
        if not candidates:
            return [], demos, record, {}
        programs = [with_learned(self.program, self.targets, library, demos)]
        for c in candidates:
            if c.demo is not None:
                programs.append(with_learned(self.program, self.targets, library,
                                             keep_best(demos, opt.max_demos - 1) + [c.demo]))
            else:
                trial = library.copy()
                trial.apply(list(c.operations), step=self.index)
                programs.append(with_learned(self.program, self.targets, trial, demos))
        rollout_id = int(digest([opt.seed, self.index, "probe"]), 16) % 2**31
        lms, runnable = [], []
        for p in programs:
            cand, copies = with_own_lms(p, rollout_id=rollout_id, temperature=opt.temperature)
            runnable.append(cand)
            lms += copies

        # the current program's attempts are kept by what the program is, not by step: a later step whose program
        # has not changed reuses them on the probe queries it shares with this one
        current = digest([[e.model_dump() for e in library.active.values()], demos])

        def unit_of(p, qi):
            return f"probe-base/{current}/{qi}" if p == 0 else f"{self.key}/probes/{p}_{qi}"

        def run_units(fn, jobs):
            def unit(job):
                rec = fn(job)
                self.ckpt.put(unit_of(*job), rec)
                self._save_spent()
                return rec
            return run_parallel(unit, jobs, num_threads=opt.num_threads, stage="probe", progress=opt.progress)

        queries = probe_queries(len(self.trainset), self.batch, opt.probe_size, seed=opt.seed, step=self.index)
        with metered() as used:
            self._meters["probe"] = used
            result = run_probe(runnable, candidates, queries=queries, trainset=self.trainset, metric=opt.metric,
                               unit_of=unit_of, cached=self.ckpt.get, run_units=run_units, keep_ties=opt.keep_tied_demos)
        record.update(result.to_dict(candidates))
        kept_ops = [op for c, k in zip(candidates, result.kept) if k for op in c.operations]
        best = next((i for i, (c, k) in enumerate(zip(candidates, result.kept)) if k and c.demo is not None), None)
        if best is not None:  # the demo set the winning candidate demo was probed with
            solved, mean = result.scores[best]
            gain = solved - result.base[0] + mean - result.base[1]
            demos = keep_best(demos, opt.max_demos - 1) + [dict(candidates[best].demo, gain=gain)]
        return kept_ops, demos, record, stage_usage(used, lms)

    # -- stage 3: the new library ---------------------------------------------------------------------------------
    def apply(self, plan: list[Operation], learning: Learning) -> tuple[ExperienceLibrary, ApplyReport]:
        """The plan validated and applied in code, all or nothing per operation, to a copy of the step's library."""
        library = self.library.copy()
        report = library.apply(plan, step=self.index, sources=sorted({q for q, _ in learning.learned.proposals}))
        return library, report

    def _record(self, learning: Learning, library: ExperienceLibrary, report: ApplyReport, demos: list[dict],
                probe: dict | None, usage: dict) -> StepResult:
        before, learned, attempts = self.spent_before, learning.learned, learning.attempts
        counts = learned.counts
        return StepResult(
            step=self.index, epoch=self.epoch, batch_size=len(self.batch), learning_path=self.path_name,
            mean_reward=mean_reward(attempts), groups=len(self.batch),
            groups_kept=len(learning.kept), frac_skipped_zero_std=1 - len(learning.kept) / len(self.batch),
            rollout_failures=sum(bool(a.error) for a in attempts),
            tool_calls_mean=statistics.fmean(a.attempt.tool_calls for a in attempts),
            learning_failures=counts.get("learning_failures", 0),
            operations_proposed=counts.get("operations_proposed", len(learned.proposals)),
            operations_applied=report.applied, operations_rejected=len(report.rejected), library_size=len(library),
            consolidation=learned.consolidation,
            usage={stage: add_usage(dict(before.get(stage, {})), u) for stage, u in usage.items()},
            seconds=learning.seconds, wall_s=time.time() - self._t0,
            metric_calls=len(attempts) + (probe or {}).get("attempts_run", 0), demos=[d["query"] for d in demos],
            probe=probe,
            usage_before_resume=before,
            details={**{k: v for k, v in counts.items() if k not in ("learning_failures", "operations_proposed")},
                     **({"metric_timeouts": len(learning.timeouts)} if learning.timeouts else {})})
