"""One optimization step of `TrainingFreeGRPO`, in the order the data flows:

    1. groups   per query: G rollouts (Attempt) -> rewards (Scored) -> a Group -> the learning path's calls
    2. lessons  the path folds every group's result into a plan of library operations (Lessons)
    3. probe    the plan's operations and the demo candidates, tried on other training queries (probe.py)
    4. apply    the kept plan, validated and applied in code to a copy of the library

What a step starts from (`StepStart`) is fixed when it is made, and each stage returns new values without writing into
what an earlier stage made. The queries' groups run side by side, each straight through its stages on its own thread,
their units on one bounded pool (`parallel.Workers`): a group's learning calls start as soon as its own attempts are
scored, while other groups still roll out. Every finished unit is checkpointed (`checkpoint.Keys`), so a crashed
step resumes without resending it.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import dspy

from tfgrpo.base.util import digest
from tfgrpo.optimizers.attempts import Attempt, Group, Scored, solved_by
from tfgrpo.optimizers.checkpoint import Checkpoint, Keys
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.learning_paths import LearningPath, Lessons, StepContext
from tfgrpo.optimizers.parallel import Gates, StageBars, TooManyFailuresError, Workers
from tfgrpo.optimizers.probe import ProbeOutcome, probe_edits
from tfgrpo.optimizers.render import format_attempt, query_key
from tfgrpo.optimizers.result import StepResult
from tfgrpo.optimizers.rewards import reference_example, score_attempt
from tfgrpo.optimizers.rollout import run_program, warn_context_refusals, with_own_lms
from tfgrpo.optimizers.usage import add_usage, meter_totals, metered, metered_stages, stage_usage
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.optimizers.demos import demo_candidates, select_demos
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


def mean_reward(attempts: list[Scored]) -> float:
    return statistics.fmean(a.reward for a in attempts) if attempts else 0.0


@dataclass(frozen=True)
class RunSetup:
    """What every step of a run shares: the knobs (a plain `Knobs`), the metric, the learning path and its name, the
    reflection LM and the checkpoint."""

    knobs: Knobs
    metric: Callable
    path: LearningPath
    path_name: str
    reflection_lm: dspy.BaseLM
    ckpt: Checkpoint


@dataclass(frozen=True)
class StepStart:
    """What one step starts from: the program, its target predictors, the library and demos it carries, the trainset,
    the queries of the batch (`reserve`: those dynamic sampling may add, in order) and what is known of the queries
    the program solves (`evidence`: query -> solved)."""

    index: int
    epoch: int
    program: dspy.Module
    targets: list[str]
    library: ExperienceLibrary
    demos: list[dict]
    trainset: list
    batch: list[int]
    reserve: list[int] = field(default_factory=list)
    evidence: dict[int, bool] = field(default_factory=dict)
    pending: list[dict] = field(default_factory=list)


class StepEnd(NamedTuple):
    """What a step hands on: the new library and demos, the step's record, and the demo candidates it found."""

    library: ExperienceLibrary
    demos: list[dict]
    stats: StepResult
    found: list[dict]


@dataclass(frozen=True)
class Learning:
    """What the step's groups made: each query's group (in the order rolled out), the path's lessons, the usage of
    each stage, the metric calls that timed out, and when each stage's latest unit finished (seconds into the step)."""

    groups: list[Group]
    lessons: Lessons
    usage: dict[str, dict]
    timeouts: list[str]
    seconds: dict[str, float]

    @property
    def informative(self) -> list[Group]:
        """The groups with reward contrast: the ones the path learned from."""
        return [g for g in self.groups if g.informative]

    @property
    def attempts(self) -> list[Scored]:
        return [a for g in self.groups for a in g.attempts]


class Step:
    """One step of a run (`RunSetup`) from a start (`StepStart`): `run()` runs the stages and saves the step's
    record."""

    def __init__(self, setup: RunSetup, start: StepStart):
        self.setup, self.start, self.knobs, self.ckpt = setup, start, setup.knobs, setup.ckpt
        self.key = Keys.step(start.index)
        self.instructions = " ".join(p.signature.instructions for _, p in start.program.named_predictors())
        self.usage_before_resume = self.ckpt.get(Keys.usage(start.index), unit=False) or {}  # a stopped run's
        self._meters: dict = {}  # stage -> its usage meter, as each stage starts: what `_save_usage` reads
        self._usage_lock = threading.Lock()  # units save from their threads: the latest totals win
        self._t0 = time.time()

    @property
    def explore_from(self) -> int:
        """The first attempt index that runs without the demos (`num_explore_generations`)."""
        return self.knobs.num_generations - self.knobs.num_explore_generations

    # -- the whole step ------------------------------------------------------------------------------------------
    def run(self) -> StepEnd:
        """The step's new library, its demos, its `StepResult` and the demo candidates it found for the next step; a
        step finished in the checkpoint is reused."""
        start, knobs = self.start, self.knobs
        if (done := self.ckpt.get(Keys.done(start.index))) is not None:
            logger.info("Step %d: complete in the checkpoint, reused", start.index)
            return StepEnd(ExperienceLibrary.from_state(done["library"]), done.get("demos", []),
                           StepResult(**done["stats"]), done.get("found", []))
        learning = self.learn()  # 1-2. the groups and the path's lessons
        probe = ProbeOutcome(plan=learning.lessons.plan, demos=start.demos,
                             evidence=solved_by(learning.groups, self.explore_from, start.evidence))
        if knobs.probe_size:  # 3. each edit tried on other training queries first
            with metered() as meter:
                self._meters["probe"] = meter
                probe = probe_edits(self.setup, start, learning, saved=self._save_usage)
            probe = dataclasses.replace(probe, usage=stage_usage(meter, probe.lms))
        elif knobs.max_demos:  # winning attempts as demos, by group advantage
            demos = select_demos(start.demos, demo_candidates(learning.informative, start.index), knobs.max_demos)
            probe = ProbeOutcome(plan=probe.plan, demos=demos, evidence={} if demos != start.demos else probe.evidence)
        library, report = self.apply(probe.plan, learning)  # 4. the new library
        stats = self._record(learning, library, report, probe)
        logger.info("Step %d: %d operations proposed, applied %s, %d refused by the library; library has %d "
                    "experiences", start.index, stats.operations_proposed, report.applied, len(report.rejected),
                    len(library))
        self.ckpt.put(Keys.done(start.index), {"library": library.dump_state(), "demos": probe.demos,
                                               "stats": stats.to_dict(), "found": probe.found})
        return StepEnd(library, probe.demos, stats, probe.found)

    # -- 1-2: the groups, each straight through its stages; then the path's lessons ------------------------------
    def learn(self) -> Learning:
        """Roll out G attempts per query of the batch, score them, and learn from each group with contrast; while
        fewer groups than the batch have contrast, the reserve's queries next (dynamic sampling)."""
        knobs, start, path = self.knobs, self.start, self.setup.path
        seconds, bars = {}, StageBars()

        def progress(stage, n, total):
            seconds[stage] = time.time() - self._t0  # stages overlap: when each one's latest unit finished
            (knobs.progress or bars)(stage, n, total)

        logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", start.index, len(start.batch),
                    knobs.num_generations, knobs.num_threads, self.setup.path_name)
        with metered_stages(("rollout", *path.stages)) as meters, \
                Workers(knobs.num_threads, progress=progress, meters=meters) as work:
            self._meters.update(meters)
            programs, rollout_lms = self._rollout_programs()
            gates = Gates(start.batch, check=lambda stage: ctx.check(stage))
            ctx = StepContext(step=start.index, settings=knobs, reflection_lm=self.setup.reflection_lm,
                              library=start.library, trainset=start.trainset, instructions=self.instructions,
                              ckpt=self.ckpt, key=self.key, work=work, gates=gates, saved=self._save_usage)
            done, queries, reserve = [], start.batch, list(start.reserve)
            try:
                while queries:
                    gates.expect(queries)
                    done += work.each(lambda qi: self._group(ctx, gates, programs, qi), queries)
                    missing = max(len(start.batch) - sum(g.informative for g, _, _ in done), 0)
                    queries, reserve = reserve[:missing], reserve[missing:]
                lessons, timeouts = self._lessons(ctx, done, seconds)
            finally:
                bars.close()
        usage = {"rollout": stage_usage(meters["rollout"], rollout_lms)}
        usage.update({stage: stage_usage(meters[stage], ctx.stage_lms(stage)) for stage in path.stages})
        return Learning(groups=[g for g, _, _ in done], lessons=lessons, usage=usage, timeouts=timeouts,
                        seconds=seconds)

    def _lessons(self, ctx: StepContext, done: list, seconds: dict) -> tuple[Lessons, list[str]]:
        """The stage-wide checks once every group is done, then the path's lessons from the informative groups."""
        ctx.check("rollout")
        attempts = [a for g, _, _ in done for a in g.attempts]
        timeouts = [t for _, _, ts in done for t in ts]
        self._check_metric_timeouts(timeouts, len(attempts))
        warn_context_refusals(self.start.index, [a.error for a in attempts if a.error])
        logger.info("Step %d: mean reward %.3f, %d/%d groups with contrast", self.start.index, mean_reward(attempts),
                    sum(g.informative for g, _, _ in done), len(done))
        for stage in self.setup.path.stages:  # every unit of every stage has run
            ctx.check(stage)
        lessons = self.setup.path.finish(ctx, [(g, result) for g, result, _ in done if g.informative])
        seconds["learning"] = time.time() - self._t0
        return lessons, timeouts

    def _group(self, ctx: StepContext, gates: Gates, programs: list, qi: int) -> tuple[Group, object, list[str]]:
        """One query, straight through: its G attempts, their rewards, and what the path learns from the group (None
        without contrast); and the metric calls that timed out."""
        try:
            G, example = self.knobs.num_generations, self.start.trainset[qi]
            attempts = ctx.map("rollout", lambda g: self._rollout(programs, qi, g), list(range(G)))
            failed = [g for g, a in enumerate(attempts) if a.error]
            ctx.count_failures("rollout", [attempts[g].error for g in failed], G)
            gates.arrive("rollout", qi)
            if failed:
                gates.wait("rollout")  # the stage's failure check passed: these count (scored 0) and a resume replays
                for g in failed:  # them; had it failed, a resume would retry them: the outage may be over
                    if not self.ckpt.has(Keys.rollout(self.start.index, qi, g)):
                        self.ckpt.put(Keys.rollout(self.start.index, qi, g), attempts[g].to_record())
            reference = reference_example(example, [a.to_record() for a in attempts], self.knobs.use_ground_truth)
            scored = ctx.map("reward", lambda g: self._reward(qi, g, attempts[g], reference), list(range(G)))
            group = Group(index=qi, key=query_key(example, qi), example=example, attempts=tuple(s for s, _ in scored))
            result = self.setup.path.learn(ctx, group) if group.informative else None
            return group, result, [timeout for _, timeout in scored if timeout]
        finally:
            gates.finish(qi)

    def _rollout_programs(self) -> tuple[list, list]:
        """G copies of the program with the library (and demos), each with private, distinct LM copies; the last
        `num_explore_generations` of them without the demos."""
        start, programs, lms = self.start, [], []
        for g in range(self.knobs.num_generations):
            rollout_id = int(digest([self.knobs.seed, start.index, g]), 16) % 2**31
            demos = [] if g >= self.explore_from else start.demos
            cand, copies = with_own_lms(with_learned(start.program, start.targets, start.library, demos),
                                        rollout_id=rollout_id, temperature=self.knobs.temperature)
            programs.append(cand)
            lms += copies
        return programs, lms

    def _rollout(self, programs: list, qi: int, g: int) -> Attempt:
        """Attempt g on query qi (G distinct samples per query: each has its own LM copies); a failed one is saved
        by its group once the stage's failure check has passed."""
        example = self.start.trainset[qi]

        def attempt() -> dict:
            _, rec = run_program(programs[g], example)  # a failed attempt is recorded and scored 0
            text = format_attempt(dict(example.inputs().items()), rec["outputs"], rec["trace"], rec["error"])
            return Attempt(outputs=rec["outputs"], error=rec["error"], trace=rec["trace"], tool_calls=rec["tool_calls"],
                           text=text).to_record()

        rec = self.ckpt.unit(Keys.rollout(self.start.index, qi, g), attempt, keep=lambda r: not r["error"],
                             then=self._save_usage)
        return Attempt.from_record(rec)

    def _reward(self, qi: int, g: int, attempt: Attempt, reference: dspy.Example) -> tuple[Scored, str | None]:
        """An attempt scored against the ground truth or the group's majority answer, and the metric's timeout if
        it had one (scored 0, counted, and not saved: a resume asks the metric again)."""
        rec = self.ckpt.unit(Keys.reward(self.start.index, qi, g),
                             lambda: score_attempt(self.setup.metric, reference, attempt.to_record(),
                                                   self.knobs.metric_timeout_s),
                             keep=lambda r: "timeout" not in r, then=self._save_usage)
        return Scored(attempt=attempt, reward=rec["reward"], feedback=rec["feedback"]), rec.get("timeout")

    def _check_metric_timeouts(self, timed_out: list[str], total: int) -> None:
        """Say how many of the step's metric calls timed out (each scored 0); more than `max_failure_rate` of them stop
        the step, unfinished, as an outage of the LM does (a resume asks the metric again)."""
        if not timed_out:
            return
        if len(timed_out) > self.knobs.max_failure_rate * total:
            raise TooManyFailuresError(
                f"step {self.start.index}: the metric timed out on {len(timed_out)} of {total} attempts (first: "
                f"{timed_out[0]}); finished work is kept in log_dir={self.knobs.log_dir!r}")
        logger.warning("Step %d: the metric timed out on %d of %d attempts, each scored 0 (first: %s)",
                       self.start.index, len(timed_out), total, timed_out[0])

    def _save_usage(self) -> None:
        """Save the calls and tokens of the step's finished units so far (plus what a stopped run had spent in this
        step); cost is left out: it is read from the LMs' history at the end."""
        before = self.usage_before_resume
        with self._usage_lock:
            totals = {stage: meter_totals(meter) for stage, meter in self._meters.items()}
            self.ckpt.put(Keys.usage(self.start.index), {**before, **{s: add_usage(dict(before.get(s, {})), u)
                                                                     for s, u in totals.items()}})

    # -- 4: the new library -----------------------------------------------------------------------------------
    def apply(self, plan: list[Operation], learning: Learning) -> tuple[ExperienceLibrary, ApplyReport]:
        """The plan validated and applied in code, all or nothing per operation, to a copy of the step's library (a
        probe said its refusals and warnings as it tried each operation)."""
        library = self.start.library.copy()
        report = library.apply(plan, step=self.start.index, sources=sorted({q for q, _ in learning.lessons.proposals}),
                               quiet=bool(self.knobs.probe_size))
        return library, report

    def _record(self, learning: Learning, library: ExperienceLibrary, report: ApplyReport,
                probe: ProbeOutcome) -> StepResult:
        before, lessons, attempts, start = self.usage_before_resume, learning.lessons, learning.attempts, self.start
        counts, usage = lessons.counts, {**learning.usage, **({"probe": probe.usage} if probe.record else {})}
        return StepResult(
            step=start.index, epoch=start.epoch, batch_size=len(start.batch), learning_path=self.setup.path_name,
            mean_reward=mean_reward(attempts), groups=len(learning.groups),
            groups_kept=len(learning.informative), frac_skipped_zero_std=1 - len(learning.informative) / len(
                learning.groups), rollout_failures=sum(bool(a.error) for a in attempts),
            tool_calls_mean=statistics.fmean(a.attempt.tool_calls for a in attempts),
            learning_failures=counts.get("learning_failures", 0),
            operations_proposed=counts.get("operations_proposed", len(lessons.proposals)),
            operations_applied=report.applied, operations_rejected=len(report.rejected), library_size=len(library),
            consolidation=lessons.consolidation,
            usage={stage: add_usage(dict(before.get(stage, {})), u) for stage, u in usage.items()},
            seconds=learning.seconds, wall_s=time.time() - self._t0,
            metric_calls=len(attempts) + (probe.record or {}).get("attempts_run", 0),
            demos=[d["query"] for d in probe.demos], probe=probe.record, queries=[g.index for g in learning.groups],
            evidence={str(q): ok for q, ok in sorted(probe.evidence.items())}, usage_before_resume=before,
            details={**{k: v for k, v in counts.items() if k not in ("learning_failures", "operations_proposed")},
                     **({"metric_timeouts": len(learning.timeouts)} if learning.timeouts else {})})
