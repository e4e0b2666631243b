"""One optimization step of `TrainingFreeGRPO`, over two types: the `Run` (fixed while it lasts) and the `State` (what a
step changes). `step(run, state, epoch, batch)` reads top to bottom:

    groups, results = each query of the batch on its own thread: G attempts -> rewards -> a Group -> the path's calls
    lessons = run.path.finish(run, state.library, results)      # the plan of library operations (learning_paths.py)
    verdict = judge(run, state, index, groups, lessons)         # no probe, or the probe: kept edits, demos (judge.py)
    new, report = state.apply(verdict, sources)                 # validated and applied in code, to a copy

A group goes through its stages at its own pace: its learning calls start as soon as its own attempts are scored,
while other groups still roll out. With `probe_min_power` the step looks first: half of each group's attempts, then the
rest only where their solve rate leaves the probe power; the learning calls wait for the whole groups (where the probe
is skipped, no lesson could be kept, and none is asked for). Every unit runs through the run's `Runner`
(runner.py), which checkpoints, meters, charges the budget and counts failures. An attempt whose LM call failed is
left out of its group. Each stage makes new values and never writes into what an earlier one made.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import dspy

from tfgrpo.optimizers.checkpoint import Keys
from tfgrpo.optimizers.runner import (CONTEXT_REFUSALS, Runner, TooManyFailuresError, add_usage, rollout_id,
                                     with_own_lms)
from tfgrpo.optimizers.judge import judge, unresolvable
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import Attempt, Demo, Group, LearningPath, Lessons, Scored, StepResult, Verdict
from tfgrpo.optimizers.rewards import reference_example
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.programs.render import query_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """What every step of a run shares: the knobs (as the run uses them), the metric, the learning path and its name,
    the reflection LM, the program and its target predictors, the trainset and the runner."""

    knobs: Knobs
    metric: Callable
    path: LearningPath
    path_name: str
    reflection_lm: dspy.BaseLM
    runner: Runner
    program: dspy.Module | None = None
    targets: list[str] = field(default_factory=list)
    trainset: list = field(default_factory=list)
    instructions: str = ""  # the program's own instructions (what a rule may repeat)


@dataclass(frozen=True)
class State:
    """What a step changes: the library and demos the program carries, the demo candidates found for the next step
    (`pending`) and the steps done."""

    library: ExperienceLibrary
    demos: list[Demo] = field(default_factory=list)
    pending: list[Demo] = field(default_factory=list)
    step: int = 0

    def apply(self, verdict: Verdict, sources: list[str], *, quiet: bool = False) -> tuple[State, ApplyReport]:
        """The state after a step: the verdict's operations validated and applied in code, all or nothing per operation,
        to a copy of the library (`sources`: the queries they came from; `quiet`: a probe said its refusals already)."""
        library = self.library.copy()
        report = library.apply(verdict.plan, step=self.step, sources=sources, quiet=quiet)
        return State(library=library, demos=verdict.demos, pending=verdict.found, step=self.step + 1), report

    def to_record(self) -> dict:
        return {"library": self.library.dump_state(), "demos": [d.to_record() for d in self.demos],
                "found": [d.to_record() for d in self.pending]}

    @classmethod
    def from_record(cls, rec: dict, step: int) -> State:
        return cls(library=ExperienceLibrary.from_state(rec["library"]),
                   demos=[Demo.from_record(d) for d in rec.get("demos", [])],
                   pending=[Demo.from_record(d) for d in rec.get("found", [])], step=step)


def step(run: Run, state: State, epoch: int, batch: list[int]) -> tuple[State, StepResult]:
    """Step `state.step` of the run on `batch`: the new state and the step's record. A step finished in the checkpoint
    is reused."""
    index, ex = state.step, run.runner
    if (done := ex.record(Keys.done(index))) is not None:
        logger.info("Step %d: complete in the checkpoint, reused", index)
        stats = StepResult.from_dict(done["stats"])
        ex.budget.add(_summed(stats.usage), stats.metric_calls)
        return State.from_record(done, index + 1), stats
    t0, before = time.time(), ex.record(Keys.usage(index), reused=False) or {}  # what a stopped run had spent in it
    ex.budget.add(_summed(before))
    logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", index, len(batch),
                run.knobs.num_generations, run.knobs.num_threads, run.path_name)
    def tally(usage: dict[str, dict]) -> None:  # the step's usage so far, saved: a resume knows what it had spent
        ex.keep(Keys.usage(index), {**before, **{s: add_usage(dict(before.get(s, {})), u) for s, u in usage.items()}})

    with ex.scope(f"step {index}", batch, prefix=Keys.step(index), tally=tally):
        groups, results, timeouts = _groups(run, state, batch)
        lessons = run.path.finish(run, state.library, [(g, r) for g, r in zip(groups, results) if r is not None])
        seconds = {**{s: t - t0 for s, t in ex.finished.items()}, "learning": time.time() - t0}
        verdict = judge(run, state, index, groups, lessons)
        stages = ("rollout", *run.path.stages, *(("probe",) if verdict.record else ()))
        usage = {s: ex.meter(s).totals() for s in stages}
        ex.recorded = True  # the step's record holds its usage from here
    sources = sorted({q for q, _ in lessons.proposals})
    new, report = state.apply(verdict, sources, quiet=bool(run.knobs.probe_size))
    stats = _record(run, new, epoch, groups=groups, lessons=lessons, verdict=verdict, report=report, usage=usage,
                    before=before, timeouts=timeouts, seconds=seconds, t0=t0)
    logger.info("Step %d: %d operations proposed, applied %s, %d refused by the library; library has %d experiences",
                index, stats.operations_proposed, report.applied, len(report.rejected), len(new.library))
    ex.keep(Keys.done(index), {**new.to_record(), "stats": stats.to_dict()})
    return new, stats


def _groups(run: Run, state: State, batch: list[int]) -> tuple[list[Group], list, list[str]]:
    """Every query's group, each straight through its stages on its own thread; then the checks over all of them.

    With the probe gate (`probe_min_power`, num_generations of 4 or more) the batch's groups are made in two halves:
    where the first half's solve rate already leaves the probe no power, the step ends with those half groups (the
    probe would be skipped on the whole groups too, bar a draw's luck), at half the attempts."""
    ex, programs, G = run.runner, _rollout_programs(run, state), run.knobs.num_generations
    waits = bool(run.knobs.probe_size and run.knobs.probe_min_power)  # the learning calls wait for the solve rate
    done, queries = [], batch
    if waits and G >= 4:  # the first look
        ex.expect(batch)
        done = ex.work.each(lambda qi: _group(run, state, programs, qi, G // 2), batch)
        if unresolvable(run.knobs, [g for g, _, _ in done]):
            queries = []
            logger.info("Step %d: the first %d attempts of each group leave the probe no power: the step ends there",
                        state.step, G // 2)
    if queries:
        ex.expect(queries)
        halves = {g.index: (g, ts) for g, _, ts in done}  # (the first look's)
        done = ex.work.each(lambda qi: _group(run, state, programs, qi, G, halves.get(qi)), queries)
    groups, results, timeouts = [g for g, _, _ in done], [r for _, r, _ in done], [t for _, _, ts in done for t in ts]
    ex.check("rollout")
    _check_attempts(run, state.step, groups, timeouts)
    if waits and not unresolvable(run.knobs, groups):  # (where the probe is skipped, no lesson could be kept)
        results = ex.work.each(lambda g: run.path.learn(run, state.library, g) if g.informative else None, groups)
    for stage in run.path.stages:  # every unit of every stage has run
        ex.check(stage)
    return groups, results, timeouts


def _group(run: Run, state: State, programs: list, qi: int, size: int,
           before: tuple[Group, list[str]] | None = None) -> tuple[Group, Any, list[str]]:
    """One query, straight through: its attempts up to `size` (after those of `before`, its group so far, and the metric
    calls of it that timed out), the rewards of those that answered, and what the path learns from the group (None
    without contrast, or not yet: with `probe_min_power` the learning waits for the step's solve rate); and the metric
    calls that timed out."""
    ex, knobs, index, example = run.runner, run.knobs, state.step, run.trainset[qi]
    first, timeouts = before or (None, [])
    try:
        gens = list(range(first.size if first else 0, size))
        attempts = dict(zip(gens, ex.map("rollout", lambda g: Attempt.from_record(
            ex.attempt("rollout", Keys.rollout(index, qi, g), programs[g], example)), gens)))
        failed = [g for g, a in attempts.items() if a.error]
        ex.settle("rollout", qi, bool(failed))
        for g in failed:  # the stage's failure check passed: they stand, and a resume replays the same group (had it
            ex.keep(Keys.rollout(index, qi, g), attempts[g].to_record(), once=True)  # failed, a resume would retry them)
        answered = [g for g, a in attempts.items() if not a.failed]  # a failed LM call is no answer
        # (a group made in halves has a probe, so the ground truth: the first half's rewards stand)
        reference = reference_example(example, [attempts[g].to_record() for g in answered], knobs.use_ground_truth)
        scores = ex.map("reward", lambda g: ex.score(Keys.reward(index, qi, g), attempts[g], reference), answered)
        group = Group(index=qi, key=query_key(example, qi), example=example, size=size, attempts=(
            *(first.attempts if first else ()),
            *(Scored(attempts[g], s["reward"], s["feedback"], g) for g, s in zip(answered, scores))))
        waits = knobs.probe_size and knobs.probe_min_power
        result = run.path.learn(run, state.library, group) if group.informative and not waits else None
        return group, result, [*timeouts, *(s["timeout"] for s in scores if "timeout" in s)]
    finally:
        ex.leave(qi)


def _rollout_programs(run: Run, state: State) -> list[dspy.Module]:
    """G copies of the program with the library and demos, each with private, distinct LM copies."""
    knobs, programs = run.knobs, []
    learned = with_learned(run.program, run.targets, state.library, state.demos)
    for g in range(knobs.num_generations):
        programs.append(with_own_lms(learned, rollout_id=rollout_id(knobs.seed, state.step, g),
                                     temperature=knobs.temperature))
    return programs


def _check_attempts(run: Run, index: int, groups: list[Group], timeouts: list[str]) -> None:
    """Say what the step's attempts met: metric calls that timed out (each scored 0; more than `max_failure_rate` of
    them stop the step, as an outage does), LM calls that failed (left out) and prompts refused for their length."""
    scored = sum(len(g.attempts) for g in groups)
    if timeouts and len(timeouts) > run.knobs.max_failure_rate * scored:
        raise TooManyFailuresError(f"step {index}: the metric timed out on {len(timeouts)} of {scored} attempts (first: "
                                   f"{timeouts[0]}); finished work is kept in log_dir={run.knobs.log_dir!r}")
    if timeouts:
        logger.warning("Step %d: the metric timed out on %d of %d attempts, each scored 0 (first: %s)", index,
                       len(timeouts), scored, timeouts[0])
    made = sum(g.size for g in groups)
    if left := made - scored:
        logger.warning("Step %d: %d of %d attempts got no answer (an LM call failed after its retries, or the provider "
                       "replied with nothing: no choices, a filtered or cut empty content): left out of their groups, "
                       "not scored, counted in failed_calls", index, left, made)
    errors = [e for e in run.runner.failures.get("rollout", ([], 0))[0] if e]
    refused = [e for e in errors if any(s in e.lower() for s in CONTEXT_REFUSALS)]
    if refused:
        logger.warning("Step %d: %d attempt(s) refused by the LM for context length: the prompt did not fit the model's "
                       "context window (give the model a larger context, or a shorter prompt or library). First: %s",
                       index, len(refused), refused[0][:300])


def _summed(usage: dict[str, dict]) -> dict[str, float]:
    return {k: sum(u.get(k, 0) for u in usage.values()) for k in ("prompt_tokens", "completion_tokens", "cost")}


def _record(run: Run, new: State, epoch: int, *, groups: list[Group], lessons: Lessons, verdict: Verdict,
            report: ApplyReport, usage: dict, before: dict, timeouts: list[str], seconds: dict, t0: float) -> StepResult:
    """The record of the step that made `new`: what it made (its groups, lessons, verdict and the library's report of
    the edits) and spent (`usage` by stage, `before`: what a stopped run had spent in it, the metric calls that timed
    out, when each stage ended, `t0`: when the step began)."""
    attempts, informative, counts = [a for g in groups for a in g.attempts], [g for g in groups if g.informative], \
        lessons.counts
    made_attempts = sum(g.size for g in groups)
    return StepResult(
        step=new.step - 1, epoch=epoch, batch_size=len(groups), learning_path=run.path_name,
        mean_reward=statistics.fmean(a.reward for a in attempts) if attempts else 0.0, groups=len(groups),
        groups_kept=len(informative), frac_skipped_zero_std=1 - len(informative) / len(groups),
        rollout_failures=sum(bool(a.error) for a in attempts) + made_attempts - len(attempts),
        failed_calls=made_attempts - len(attempts), solved=sum(a.reward >= 1 for a in attempts),
        tool_calls_mean=statistics.fmean(a.attempt.tool_calls for a in attempts) if attempts else 0.0,
        learning_failures=counts.get("learning_failures", 0),
        operations_proposed=counts.get("operations_proposed", len(lessons.proposals)),
        operations_applied=report.applied, operations_rejected=len(report.rejected),
        library_size=len(new.library), consolidation=lessons.consolidation,
        usage={stage: add_usage(dict(before.get(stage, {})), u) for stage, u in usage.items()},
        seconds=seconds, wall_s=time.time() - t0,
        metric_calls=len(attempts) + (verdict.record or {}).get("attempts_run", 0),
        demos=[d.query for d in verdict.demos], probe=verdict.record, queries=[g.index for g in groups],
        usage_before_resume=before,
        details={**{k: v for k, v in counts.items() if k not in ("learning_failures", "operations_proposed")},
                 **({"metric_timeouts": len(timeouts)} if timeouts else {})})


def learn_from_groups(path: LearningPath, groups: list[Group], *, settings: Knobs, reflection_lm: dspy.BaseLM,
                      library: ExperienceLibrary, instructions: str = "") -> tuple[Lessons, dict[str, dict]]:
    """Run `path` on groups scored elsewhere (saved rollouts, say), as a step would, with nothing saved: its lessons and
    the usage of each of its stages. The library is not changed (apply the plan to a copy); `instructions`, the
    program's (what a rule may repeat)."""
    run = Run(knobs=settings, metric=lambda *_: 0.0, path=path, path_name=type(path).__name__,
              reflection_lm=reflection_lm, runner=Runner(settings, lambda *_: 0.0), instructions=instructions)
    informative = [g for g in groups if g.informative]
    with run.runner.scope("learning", [g.index for g in informative]) as ex:
        def one(group):
            try:
                return path.learn(run, library, group)
            finally:
                ex.leave(group.index)

        results = ex.work.each(one, informative)
        for stage in path.stages:
            ex.check(stage)
        lessons = path.finish(run, library, list(zip(informative, results)))
        return lessons, {stage: ex.meter(stage).totals() for stage in path.stages}
