"""One optimization step of `TrainingFreeGRPO`, in this one file, stage after stage, over two types: the `Run` (fixed
while it lasts) and the `State` (what a step changes). `step(run, state, epoch, batch)` reads top to bottom:

    with run.runner.scope(...) as scope:                        # the step's workers, meters, failure counts, gate
        groups, results = each query of the batch a group of its own: G attempts -> rewards -> a Group -> path calls
        lessons = run.path.finish(run, scope, state.library, results)   # the plan of library operations
        verdict = judge(run, scope, state, index, groups, lessons)      # no probe, or the probe: kept edits, demos
    new, report = state.apply(verdict, sources)                         # validated and applied in code, to a copy

The file's sections follow those stages: the step and its rollout; the judge and the probe; the learning paths (the
paper's and the contrast path).

A group goes through its stages at its own pace: its learning calls start as soon as its own attempts are scored,
while other groups still roll out. With `probe_min_power` the step looks first: half of each group's attempts, then the
rest only where their solve rate leaves the probe power; the learning calls wait for the whole groups (where the probe
is skipped, no lesson could be kept, and none is asked for). Every unit runs through the step's `Scope` (runner.py),
which checkpoints, meters, charges the budget and counts failures; a group that saw failures at a stage waits at the
scope's gate for the stage's failure check, the one place where groups wait on each other. An attempt whose LM call
failed is left out of its group. Each stage makes new values and never writes into what an earlier one made.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import dspy

from tfgrpo.base.util import clip, digest
from tfgrpo.optimizers.checkpoint import Keys
from tfgrpo.optimizers.runner import CONTEXT_REFUSALS, Runner, Scope, TooManyFailuresError
from tfgrpo.optimizers.spend import add_usage
from tfgrpo.optimizers.workers import rollout_id, with_own_lms
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import (Demo, Failed, Group, LearningPath, Lessons, Scored, StepResult,
                                       Verdict)
from tfgrpo.optimizers.rewards import reference_example
from tfgrpo.programs.contrast_learner import ContrastLearner
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.programs.render import format_fields, outcome, query_key, tool_actions, tool_observations
from tfgrpo.signatures.operations import Operation

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
    index, runner = state.step, run.runner
    if (done := runner.record(Keys.done(index))) is not None:
        logger.info("Step %d: complete in the checkpoint, reused", index)
        stats = StepResult.from_dict(done["stats"])
        runner.budget.add(_summed(stats.usage), stats.metric_calls)
        return State.from_record(done, index + 1), stats
    t0, before = time.time(), runner.record(Keys.usage(index), reused=False) or {}  # what a stopped run had spent in it
    runner.budget.add(_summed(before))
    logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", index, len(batch),
                run.knobs.num_generations, run.knobs.num_threads, run.path_name)
    with runner.scope(f"step {index}", prefix=Keys.step(index), usage_key=Keys.usage(index), before=before) as scope:
        groups, results, timeouts = _groups(run, scope, state, batch)
        lessons = run.path.finish(run, scope, state.library,
                                  [(g, r) for g, r in zip(groups, results) if r is not None])
        seconds = {**{s: t - t0 for s, t in scope.finished.items()}, "learning": time.time() - t0}
        verdict = judge(run, scope, state, index, groups, lessons)
        stages = ("rollout", *run.path.stages, *(("probe",) if verdict.record else ()))
        usage = {s: scope.meter(s).totals() for s in stages}
    sources = sorted({q for q, _ in lessons.proposals})
    new, report = state.apply(verdict, sources, quiet=bool(run.knobs.probe_size))
    stats = _record(run, new, epoch, groups=groups, lessons=lessons, verdict=verdict, report=report, usage=usage,
                    before=before, timeouts=timeouts, seconds=seconds, t0=t0)
    logger.info("Step %d: %d operations proposed, applied %s, %d refused by the library; library has %d experiences",
                index, stats.operations_proposed, report.applied, len(report.rejected), len(new.library))
    runner.keep(Keys.done(index), {**new.to_record(), "stats": stats.to_dict()})
    return new, stats


def _groups(run: Run, scope: Scope, state: State, batch: list[int]) -> tuple[list[Group], list, list[str]]:
    """Every query's group, each straight through its stages beside the others; then the checks over all of them.

    With the probe gate (`probe_min_power`, num_generations of 4 or more) the batch's groups are made in two halves:
    where the first half's solve rate already leaves the probe no power, the step ends with those half groups (the
    probe would be skipped on the whole groups too, bar a draw's luck), at half the attempts; and the learning calls
    wait for the whole step's solve rate (where the probe is skipped, no lesson could be kept)."""
    programs, G = _rollout_programs(run, state), run.knobs.num_generations
    waits = bool(run.knobs.probe_size and run.knobs.probe_min_power)
    done, queries = [], batch
    if waits and G >= 4:  # the first look
        done = scope.each(lambda qi: _group(run, scope, state, programs, qi, G // 2, learn=False), batch)
        if unresolvable(run.knobs, [g for g, _, _ in done]):
            queries = []
            logger.info("Step %d: the first %d attempts of each group leave the probe no power: the step ends there",
                        state.step, G // 2)
    if queries:
        halves = {g.index: (g, ts) for g, _, ts in done}  # (the first look's)
        done = scope.each(lambda qi: _group(run, scope, state, programs, qi, G, halves.get(qi), learn=not waits),
                          queries)
    groups, results, timeouts = [g for g, _, _ in done], [r for _, r, _ in done], [t for _, _, ts in done for t in ts]
    scope.check("rollout")
    _check_attempts(run, scope, state.step, groups, timeouts)
    if waits and not unresolvable(run.knobs, groups):
        results = scope.each(lambda g: run.path.learn(run, scope, state.library, g) if g.informative else None, groups)
    for stage in run.path.stages:  # every unit of every stage has run
        scope.check(stage)
    return groups, results, timeouts


def _group(run: Run, scope: Scope, state: State, programs: list, qi: int, size: int,
           before: tuple[Group, list[str]] | None = None, *, learn: bool) -> tuple[Group, Any, list[str]]:
    """One query, straight through: its attempts up to `size` (after those of `before`, its group so far, and the metric
    calls of it that timed out), the rewards of those that answered, and, with `learn`, what the path learns from the
    group (None without contrast); and the metric calls that timed out."""
    knobs, index, example = run.knobs, state.step, run.trainset[qi]
    first, timeouts = before or (None, [])
    gens = list(range(first.size if first else 0, size))
    attempts = dict(zip(gens, scope.attempts("rollout", [(Keys.rollout(index, qi, g), programs[g], example)
                                                         for g in gens])))
    failed = [g for g, a in attempts.items() if a.error]
    scope.settle("rollout", bool(failed))
    for g in failed:  # the stage's failure check passed: they stand, and a resume replays the same group (had it
        run.runner.keep(Keys.rollout(index, qi, g), attempts[g].to_record(), once=True)  # failed, a resume retries)
    answered = [g for g, a in attempts.items() if not a.failed]  # a failed LM call is no answer
    # (a group made in halves has a probe, so the ground truth: the first half's rewards stand)
    reference = reference_example(example, [attempts[g] for g in answered], knobs.use_ground_truth)
    scores = scope.map("reward", lambda g: scope.score(Keys.reward(index, qi, g), attempts[g], reference, g), answered)
    group = Group(index=qi, key=query_key(example, qi), example=example, size=size,
                  attempts=(*(first.attempts if first else ()), *scores))
    result = run.path.learn(run, scope, state.library, group) if group.informative and learn else None
    return group, result, [*timeouts, *(s.timeout for s in scores if s.timeout)]


def _rollout_programs(run: Run, state: State) -> list[dspy.Module]:
    """G copies of the program with the library and demos, each with private, distinct LM copies."""
    knobs, programs = run.knobs, []
    learned = with_learned(run.program, run.targets, state.library, state.demos)
    for g in range(knobs.num_generations):
        programs.append(with_own_lms(learned, rollout_id=rollout_id(knobs.seed, state.step, g),
                                     temperature=knobs.temperature))
    return programs


def _check_attempts(run: Run, scope: Scope, index: int, groups: list[Group], timeouts: list[str]) -> None:
    """Say what the step's attempts met: metric calls that timed out (each scored 0; more than `max_failure_rate` of
    them stop the step, as an outage does), attempts that raised (scored 0), LM calls that failed (left out) and
    prompts refused for their length."""
    scored = sum(len(g.attempts) for g in groups)
    if timeouts and len(timeouts) > run.knobs.max_failure_rate * scored:
        raise TooManyFailuresError(f"step {index}: the metric timed out on {len(timeouts)} of {scored} attempts (first: "
                                   f"{timeouts[0]}); finished work is kept in log_dir={run.knobs.log_dir!r}")
    if timeouts:
        logger.warning("Step %d: the metric timed out on %d of %d attempts, each scored 0 (first: %s)", index,
                       len(timeouts), scored, timeouts[0])
    raised = [a.error for g in groups for a in g.attempts if a.error]
    if raised:
        logger.warning("Step %d: %d of %d attempts raised, each scored 0 as the program's own answer (for instance "
                       "a reply that did not parse, as from a model that ran out of max_tokens before its last output "
                       "field). First: %s", index, len(raised), scored, raised[0][:300])
    made = sum(g.size for g in groups)
    if left := made - scored:
        logger.warning("Step %d: %d of %d attempts got no answer (an LM call failed after its retries, or the provider "
                       "replied with nothing: no choices, a filtered or cut empty content): left out of their groups, "
                       "not scored, counted in failed_calls", index, left, made)
    errors = scope.failures["rollout"].errors if "rollout" in scope.failures else []
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
        tool_calls_mean=statistics.fmean(a.tool_calls for a in attempts) if attempts else 0.0,
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
    with run.runner.scope("learning") as scope:
        results = scope.each(lambda group: path.learn(run, scope, library, group), informative)
        for stage in path.stages:
            scope.check(stage)
        lessons = path.finish(run, scope, library, list(zip(informative, results)))
        return lessons, {stage: scope.meter(stage).totals() for stage in path.stages}


# == the judge ========================================================================================================
# The judge: which of a step's lessons and winning attempts the program keeps.
#
# Without a probe, every valid operation of the plan is applied, as in the paper, and with `max_demos` the winning
# attempts with the highest group advantage become demos: a group's best attempt that fully succeeded while its groupmates
# did worse (a small policy model copies a working example far better than it follows advice; only full successes
# qualify, since a half-right example teaches its mistakes too).
#
# With `probe_size > 0`, each candidate edit is tried first, as GEPA keeps a candidate only when it scores better on the
# minibatch: the program as it is and the program with one candidate edit each (every operation of the plan, each
# candidate demo) make one attempt on the same `probe_size` training queries outside the step's batch (never a held-out
# one). A winning attempt is not yet a good lesson: on the Game of 24 a program that only sums wins on 3 7 7 7, and a
# small policy model copies it faithfully everywhere.
#
# A probe ranks programs by full successes (reward 1) first and mean reward second; partial credit alone misleads it (on
# the Game of 24, demos chosen by mean partial reward taught the 1.5B to print any expression of the four numbers and it
# then solved 0 of 48 held-out puzzles). A library operation is kept when it ranks no lower than the current program; a
# demo, or an experience carrying an excerpt (code the policy will copy), only when it wins more probe queries than it
# loses against the current program, and only the best such candidate of each kind is kept; of two edits of one
# experience (a rewrite, a retirement) only the better. A probe slot left over retires one current experience in turn,
# when the program ranks no lower without it. The candidates run query by query, and one whose verdict is known runs no
# more queries. A probe query on which an attempt's LM call failed leaves the probe, for every program alike, so the
# comparison stays paired.



def judge(run: Run, scope: Scope, state: State, step: int, groups: list[Group], lessons: Lessons) -> Verdict:
    """The verdict on a step's lessons and winning attempts: the probe's with `probe_size`, else every operation of the
    plan and (with `max_demos`) the demos by group advantage. With `probe_min_power`, a probe that could not tell a
    better candidate from a useless one at the step's solve rate is skipped: no edit is kept unprobed, the free demo
    slots are filled as BootstrapFewShot fills them, with full successes (by group advantage: those of groups with
    contrast first, then those of groups that all succeeded), and the record says why (the run stops)."""
    knobs = run.knobs
    skipped = unresolvable(knobs, groups)
    if knobs.probe_size and not skipped:
        return probe_edits(run, scope, state, step, groups, lessons.plan)
    skipped = {**skipped, "unprobed": len(lessons.plan)} if skipped else None
    if knobs.max_demos:
        # (where the probe is skipped, as BootstrapFewShot: any group's full success, those with contrast first)
        new = demo_candidates([g for g in groups if g.informative or skipped], step)
        if skipped:  # the demos the program has were kept for a reason: only free slots are filled
            held = {d.query for d in state.demos}
            new = best_demos([d for d in new if d.query not in held], knobs.max_demos - len(state.demos))
        demos = best_demos(state.demos + new, knobs.max_demos)
        return Verdict(plan=[] if skipped else lessons.plan, demos=demos, record=skipped)
    return Verdict(plan=[] if skipped else lessons.plan, demos=state.demos, record=skipped)


def unresolvable(knobs: Knobs, groups: list[Group]) -> dict | None:
    """Why a probe of the step's edits would be skipped (`probe_min_power`): its power at the step's solve rate (the
    share of its attempts with reward 1) is below the knob; None when it would run, or none is asked for."""
    if not knobs.probe_size:
        return None
    attempts = [a.reward >= 1 for g in groups for a in g.attempts]
    rate = statistics.fmean(attempts) if attempts else 0.0
    power = probe_power(rate, knobs.probe_size)
    if power >= knobs.probe_min_power:
        return None
    return {"skipped": f"a probe of {knobs.probe_size} queries has power {power:.2f} < probe_min_power="
                       f"{knobs.probe_min_power} at the step's solve rate {rate:.0%}", "solve_rate": rate, "power": power}


def probe_power(solve_rate: float, size: int) -> float:
    """How well a probe of `size` queries tells a candidate that halves the program's failures from a useless one, at
    the program's `solve_rate`: the chance the first solves more probe queries than the program, less the chance the
    second does (independent binomial counts; near 1 where the program solves nothing, 0 where it solves everything)."""
    better = solve_rate + (1 - solve_rate) / 2
    base, good = ([math.comb(size, k) * r ** k * (1 - r) ** (size - k) for k in range(size + 1)]
                  for r in (solve_rate, better))
    return sum((good[j] - base[j]) * sum(base[:j]) for j in range(size + 1))  # P(good > base) - P(useless > base)


# -- demos ------------------------------------------------------------------------------------------------------------
def demo_candidates(groups: list[Group], step: int, *, min_reward: float = 1.0) -> list[Demo]:
    """Per group given: its best attempt, if its reward reaches `min_reward` (1: it fully succeeded; a probe judges
    candidates by what they do elsewhere, so it takes any that scored), with its group advantage."""
    found = []
    for group in groups:
        best = max(group.attempts, key=lambda a: (a.reward, -a.g))
        if best.reward >= min_reward and best.reward > 0 and not best.error and best.trace:
            found.append(Demo(query=group.key, trace=best.trace, step=step, reward=best.reward,
                              advantage=best.reward - statistics.fmean(group.rewards)))
    return found


def carried_demos(program: dspy.Module, targets: list[str]) -> list[Demo]:
    """The demos the target predictors of a student already carry (learned before, by this model or another), as
    demos the run keeps, probes against and may replace: each one call of its predictor, known by its place."""
    demos = []
    for name, predictor in program.named_predictors():
        fields = predictor.signature.input_fields, predictor.signature.output_fields
        for j, example in enumerate(predictor.demos if name in targets else []):
            values = dict(example)
            demos.append(Demo(query=f"{name}[{j}]", trace=[{
                "predictor": name, "inputs": {k: values[k] for k in fields[0] if k in values},
                "outputs": {k: values[k] for k in fields[1] if k in values}}]))
    return demos


def best_demos(demos: list[Demo], n: int, score: str = "advantage") -> list[Demo]:
    """The `n` demos with the highest `score` (their group "advantage", or a probe's "gain", 0 where none was
    measured; the earlier step first on ties, a carried demo first of all), one per query."""
    best_per_query: dict[str, Demo] = {}
    for demo in sorted(demos, key=lambda d: (-(getattr(d, score) or 0.0), -1 if d.step is None else d.step, d.query)):
        best_per_query.setdefault(demo.query, demo)
    return list(best_per_query.values())[: max(n, 0)]


# -- the probe --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One edit to probe: library operations, or a demo (a winning attempt's trace)."""

    label: str  # how logs and the step record name it
    operations: tuple[Operation, ...] = ()
    demo: Demo | None = None

    @property
    def shows_code(self) -> bool:
        """A demo, or an operation that adds or rewrites an experience with an excerpt: something the policy will
        copy, so it is held to a demo's standard."""
        return self.demo is not None or any(getattr(op, "excerpt", "") and op.action in ("add", "modify")
                                            for op in self.operations)

    @property
    def targets(self) -> set[str]:
        """The current experiences this edit rewrites, merges or retires."""
        return {i for op in self.operations if op.action != "add" for i in op.ids}


def keeps(candidate: Candidate, score: tuple[int, float], base: tuple[int, float], wins: int = 0, losses: int = 0
          ) -> bool:
    """A demo, or an experience that carries code (an excerpt), must win more probe queries than it loses (`wins`:
    those solved by it and not by the current program; `losses`: the reverse); any other operation must rank no lower
    (successes, then mean reward)."""
    if candidate.shows_code:
        return wins > losses
    return score >= base


def probe_queries(trainset_size: int, batch: list[int], size: int, *, seed: int, step: int) -> list[int]:
    """`size` training queries outside the step's batch (all of the trainset when the batch covers it), drawn
    the same way on a resume."""
    pool = [i for i in range(trainset_size) if i not in set(batch)] or list(range(trainset_size))
    rng = random.Random(int(digest([seed, step, "probe"]), 16))
    return sorted(rng.sample(pool, min(size, len(pool))))


@dataclass
class Probe:
    """The statistics of a probe: program 0 is the current one, program 1 + c carries candidate c. `run` asks the
    step's scope for the attempts, query by query, and leaves the verdicts in `kept`, with each program's (successes, mean)
    in `base` and `scores`, the queries each ran (`tried`) and solved (`solved`), their solving traces (`traces`) and
    how many queries each candidate ran (`ran`). A query whose attempt got no answer leaves `queries`."""

    candidates: list[Candidate]
    queries: list[int]
    found: dict[tuple[int, int], Scored] = field(default_factory=dict)  # (program, query) -> its scored attempt
    base: tuple[int, float] = (0, 0.0)

    def run(self, scope: Scope, programs: list[dspy.Module], trainset: list,
            keys: tuple[str, int] | None = None) -> Probe:
        """Run the probe: `keys` (the current program's digest, the step) name its checkpoint units; None keeps none."""
        def ask(jobs):  # the current program's attempts are kept by what it is, not by step: a later step whose program
            # has not changed reuses them on the probe queries it shares with this one
            units = [(None if keys is None else Keys.probe_base(keys[0], qi) if p == 0 else Keys.probe(keys[1], p, qi),
                      programs[p], trainset[qi]) for p, qi in jobs]
            for (p, qi), attempt in zip(jobs, scope.scored("probe", units)):
                if attempt.failed and qi in self.queries:  # no answer: the query leaves the probe, for all
                    logger.warning("Probe: an LM call failed on training query %d (%s); it leaves the probe", qi,
                                   attempt.error)
                    self.queries.remove(qi)
                elif not attempt.failed:
                    self.found[(p, qi)] = attempt

        ask([(0, qi) for qi in self.queries])  # the bar every candidate must clear
        self.base = self.score(0)
        alive = list(range(len(self.candidates)))
        for qi in list(self.queries):
            if qi in self.queries:
                ask([(1 + c, qi) for c in alive])
                self.base = self.score(0)
            alive = [c for c in alive if self._possible(c, alive)]
        self._verdicts(alive)
        return self

    # -- what the attempts show ------------------------------------------------------------------------------------
    def _hit(self, p: int, qi: int) -> bool:
        return self.found[(p, qi)].reward >= 1

    def rewards(self, p: int) -> list[float]:
        """Program p's rewards on the probe queries it has run."""
        return [self.found[(p, qi)].reward for qi in self.queries if (p, qi) in self.found]

    def score(self, p: int) -> tuple[int, float]:
        """Full successes and mean reward over the queries program p has run."""
        rs = self.rewards(p)
        return sum(r >= 1 for r in rs), statistics.fmean(rs or [0.0])

    def paired(self, c: int) -> tuple[int, int, int, int]:
        """Candidate c's wins and losses against the current program so far, and the wins and losses still possible."""
        ran = [qi for qi in self.queries if (1 + c, qi) in self.found]
        left = [qi for qi in self.queries if (1 + c, qi) not in self.found]
        wins = sum(self._hit(1 + c, qi) and not self._hit(0, qi) for qi in ran)
        losses = sum(self._hit(0, qi) and not self._hit(1 + c, qi) for qi in ran)
        return wins, losses, sum(not self._hit(0, qi) for qi in left), sum(self._hit(0, qi) for qi in left)

    def _bound(self, c: int, case: str) -> tuple[bool, tuple[int, float]]:
        """Whether c is kept, and its (successes, mean), if every query left goes its way ("best") or against it
        ("worst"); widened by a rounding error's width, so a tie is never cut short."""
        wins, losses, can_win, can_lose = self.paired(c)
        rs, n, left = self.rewards(1 + c), max(len(self.queries), 1), can_win + can_lose
        if case == "best":
            point, wins = (sum(r >= 1 for r in rs) + left, (sum(rs) + left) / n + 1e-9), wins + can_win
        else:
            point, losses = (sum(r >= 1 for r in rs), sum(rs) / n - 1e-9), losses + can_lose
        return keeps(self.candidates[c], point, self.base, wins, losses), point

    def _possible(self, c: int, alive: list[int]) -> bool:
        """Can candidate c still be kept? (One demo is kept, the best: can c still be it?)"""
        ok, best_case = self._bound(c, "best")
        if not ok:
            return False
        return self.candidates[c].demo is None or not any(
            d != c and self.candidates[d].demo is not None and self._bound(d, "worst")[0]
            and (self._bound(d, "worst")[1], d) > (best_case, c) for d in alive)

    def _verdicts(self, alive: list[int]) -> None:
        candidates = self.candidates
        self.scores = [self.score(1 + c) for c in range(len(candidates))]
        kept = [c in alive and keeps(candidates[c], self.scores[c], self.base, *self.paired(c)[:2])
                for c in range(len(candidates))]
        # code competes: one demo (the step keeps the set it was probed with) and one experience with an excerpt; and
        # one edit per current experience (a rewrite and a retirement of it cannot both be kept)
        kinds = [lambda c: c.demo is not None, lambda c: c.demo is None and c.shows_code]
        kinds += [lambda c, t=t: t in c.targets for t in sorted({t for c in candidates for t in c.targets})]
        for kind in kinds:
            wins = [(score, i) for i, (c, score, k) in enumerate(zip(candidates, self.scores, kept)) if k and kind(c)]
            best = max(wins)[1] if wins else None
            kept = [k and (not kind(c) or i == best) for i, (c, k) in enumerate(zip(candidates, kept))]
        self.kept, programs = kept, range(len(candidates) + 1)
        self.ran = [len(self.rewards(1 + c)) for c in range(len(candidates))]
        self.tried = [[qi for qi in self.queries if (p, qi) in self.found] for p in programs]
        self.solved = [[qi for qi in ran if self._hit(p, qi)] for p, ran in enumerate(self.tried)]
        self.traces = [{qi: self.found[(p, qi)].trace for qi in self.solved[p] if self.found[(p, qi)].trace}
                       for p in programs]
        for c, (s, m), k, r in zip(candidates, self.scores, self.kept, self.ran):
            logger.info("Probe: %s: %d solved of %d run, mean %.3f vs %d, %.3f now -> %s", c.label, s, r, m,
                        *self.base, "kept" if k else "dropped")

    def record(self) -> dict:
        """The probe as the step's record holds it."""
        return {"queries": self.queries, "base_successes": self.base[0], "base_mean": self.base[1],
                "base_solved": self.solved[0],
                "attempts_run": len(self.queries) + sum(self.ran),  # the current program's, then the candidates'
                "attempts_saved": sum(len(self.queries) - n for n in self.ran),
                "candidates": [{"edit": c.label, "successes": s, "mean": m, "queries_run": n, "kept": k,
                                "solved": solved} for c, (s, m), k, n, solved in zip(
                    self.candidates, self.scores, self.kept, self.ran, self.solved[1:])]}


def probe_edits(run: Run, scope: Scope, state: State, step: int, groups: list[Group], plan: list[Operation]
                ) -> Verdict:
    """The step's probe: the plan's operations and the demo candidates, each tried against the current program on the
    same training queries outside the step's queries; kept as `Probe` says."""
    knobs, library, demos = run.knobs, state.library, state.demos
    candidates, unprobed = _candidates(knobs, state, step, groups, plan)
    if not candidates:
        return Verdict(plan=[], demos=demos, record={"candidates": [], "unprobed": unprobed})
    programs = [with_learned(run.program, run.targets, library, demos)]
    for c in candidates:
        if c.demo is not None:  # the demo replaces the weakest of the kept ones, last: what a small model copies
            programs.append(with_learned(run.program, run.targets, library,
                                         best_demos(demos, knobs.max_demos - 1, "gain") + [c.demo]))
        else:
            trial = library.copy()
            trial.apply(list(c.operations), step=step, quiet=True)  # said once, as it was proposed
            programs.append(with_learned(run.program, run.targets, trial, demos))
    seed = rollout_id(knobs.seed, step, "probe")
    runnable = [with_own_lms(p, rollout_id=seed, temperature=knobs.temperature) for p in programs]
    queries = probe_queries(len(run.trainset), [g.index for g in groups], knobs.probe_size, seed=knobs.seed, step=step)
    current = digest([[e.model_dump() for e in library.active.values()], [d.to_record() for d in demos]])
    probe = Probe(candidates, list(queries)).run(scope, runnable, run.trainset, keys=(current, step))
    kept_ops = [op for c, k in zip(candidates, probe.kept) if k for op in c.operations]
    best = next((i for i, (c, k) in enumerate(zip(candidates, probe.kept))  # a demo is shown solving its query
                 if k and c.demo is not None and (c.demo.reward >= 1 or probe.traces[1 + i])), None)
    if best is not None:  # the demo set the winning candidate demo was probed with
        demos = best_demos(demos, knobs.max_demos - 1, "gain") + [_shown_demo(candidates[best].demo, best, probe,
                                                                                      run.trainset)]
    # demo candidates for the next step, found on the way: attempts that solved their probe query made by a program
    # without demos (a fresh sample of what the model writes; with a demo in the prompt it is mostly that demo again)
    free = [not state.demos] + [not state.demos and c.demo is None for c in candidates]
    found = [Demo(query=query_key(run.trainset[qi], qi), trace=trace, step=step, reward=1.0, advantage=0.0)
             for p, ok in enumerate(free) if ok and knobs.max_demos for qi, trace in probe.traces[p].items()]
    return Verdict(plan=kept_ops, demos=demos, record={"unprobed": unprobed, **probe.record()},
                   found=found)


def _candidates(knobs: Knobs, state: State, step: int, groups: list[Group], plan: list[Operation]
                ) -> tuple[list[Candidate], int]:
    """The edits to probe (demos first, half the slots at most; then the plan's operations the library accepts; a
    spare slot retires a current experience in turn), and how many were left out."""
    found = demo_candidates([g for g in groups if g.informative], step, min_reward=0.0) + \
        list(state.pending) if knobs.max_demos else []
    found = sorted(found, key=lambda d: (-d.reward, -d.advantage, d.query))[: (knobs.max_probed_edits + 1) // 2]
    candidates = [Candidate(label=f"demo from {d.query} (reward {d.reward:.2f})", demo=d) for d in found]
    library = state.library
    for op in plan:
        if len(candidates) >= knobs.max_probed_edits:
            break
        if library.copy().apply([op], step=step).num_applied:  # one the library refuses is not worth a probe
            candidates.append(Candidate(label=f"{op.action} {op.ids or ''} {op.text[:60]!r}", operations=(op,)))
    if library.active and len(candidates) < knobs.max_probed_edits:  # a spare slot: must a current experience stay?
        target = list(library.active)[step % len(library.active)]  # each in turn
        candidates.append(Candidate(label=f"retire {target}", operations=(Operation(action="delete", ids=[target]),)))
    return candidates, max(0, len(plan) + len(found) - len(candidates))


def _shown_demo(demo: Demo, c: int, probe: Probe, trainset: list) -> Demo:
    """The winning demo as it is kept: with its probe gain; shown as an attempt that solved its own query (a candidate
    judged by what it did on other queries may have failed its own: then its attempt on a probe query it solved)."""
    solved, mean = probe.scores[c]
    demo = dataclasses.replace(demo, gain=solved - probe.base[0] + mean - probe.base[1])
    if demo.reward < 1:
        qi = next(iter(probe.traces[1 + c]))
        demo = dataclasses.replace(demo, query=query_key(trainset[qi], qi), reward=1.0, trace=probe.traces[1 + c][qi])
    return demo


# == the learning paths ===============================================================================================
# The learning paths: how one step's informative groups become a plan of library operations.
#
# A path is a plug-in with a small contract, so that a new way of learning needs nothing of the optimizer's insides:
#
#     class MyPath(LearningPath):
#         stages = ("lesson",)                          # the stages its LM calls are metered and checked under
#
#         def learn(self, run, scope, library, group):  # one group's calls (groups run side by side)
#             def lesson():                             # one learning call, under run.reflection_lm
#                 with dspy.context(lm=run.reflection_lm):
#                     return dspy.Predict("attempts -> lesson")(attempts=...).lesson
#             return scope.call("lesson", f"lessons/{group.index}", lesson)
#
#         def finish(self, run, scope, library, results):  # every group done: [(group, its result)] -> the plan
#             return Lessons(plan=[...], proposals=[(group.key, op), ...])
#
# `run` is the run (`Run`, above): its knobs (`run.knobs`), the reflection LM (`run.reflection_lm`) and the program's
# instructions; `scope` is the step's (`runner.Scope`). `library` is the library as the step started: read it, never
# edit it. `scope.call(stage, name, fn)` (or `calls` for several at once) makes a learning call on the step's
# workers: checkpointed under the step as `name`, charged to the budget, metered under `stage`; one that raises
# comes back as a `Failed` and is counted, and when more than `max_failure_rate` of a stage's calls failed the step
# stops (a group whose calls failed is held in `calls` until the stage's check has seen every group's: a path never
# waits on other groups itself). The paper's path is `PaperPath`; `ContrastPath` is the path for small reflection
# models. Pass an instance as `learning_path=` to plug in your own; `learn_from_groups` (above) runs a path
# on groups scored elsewhere (saved rollouts, say).

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


@dataclass(frozen=True)
class Advantage:
    """What `PaperPath.learn` makes of one group: the group advantage's operations (as saved: one dict each), or the
    `Failed` call, and how many of its summaries failed (the raw attempt stood in for each)."""

    ops: list[dict] | Failed
    failed_summaries: int


class PaperPath(LearningPath):
    """The paper's path, for a capable reflection LM: summarize every attempt of a group, extract the group's advantage
    as operations, and consolidate the batch's operations in one call."""

    stages = ("summary", "advantage", "consolidation")

    def learn(self, run: Run, scope: Scope, library: ExperienceLibrary, group: Group) -> Advantage:
        knobs = run.knobs
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

        # (an outage stops the step in `calls`, before it costs advantage calls)
        summaries = scope.calls("summary", {f"summaries/{group.index}_{a.g}": summarize(a) for a in group.attempts})
        failed = [s.error for s in summaries if isinstance(s, Failed)]
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

        return Advantage(ops=scope.call("advantage", f"advantages/{group.index}", extract),
                         failed_summaries=len(failed))

    def finish(self, run: Run, scope: Scope, library: ExperienceLibrary, results: list[tuple[Group, Advantage]]
               ) -> Lessons:
        proposals, failures = [], 0
        for group, res in results:
            failures += res.failed_summaries
            if isinstance(res.ops, Failed):
                failures += 1
                logger.warning("Group advantage of query %s failed (%s); the group proposes nothing", group.index,
                               res.ops.error)
                continue
            proposals += [(group.key, Operation.model_validate(o)) for o in res.ops]
        plan, status = self._consolidate(run, scope, library, proposals)  # 3. one call for the batch
        return Lessons(plan=plan, proposals=proposals, consolidation=status,
                       counts={"learning_failures": failures, "operations_proposed": len(proposals)})

    @staticmethod
    def _consolidate(run: Run, scope: Scope, library: ExperienceLibrary, proposals: list[tuple[str, Operation]]
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

        saved = scope.call("consolidation", "plan", consolidate)
        if isinstance(saved, Failed):  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", saved.error, len(proposals))
            saved = {"plan": [op.model_dump() for _, op in proposals], "status": "fallback: proposals applied directly"}
            run.runner.keep(f"{scope.prefix}/plan", saved)
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
                                   library=library, allowed=run.instructions, seen=seen)
            return f"contrasts/{group.index}_{better.g}_{worse.g}", call

        pairs = contrast_pairs(group.rewards, knobs.max_operations_per_group)
        return scope.calls("contrast", dict(contrast(attempts[b], attempts[w]) for b, w in pairs))

    def finish(self, run: Run, scope: Scope, library: ExperienceLibrary, results: list[tuple[Group, list]]
               ) -> Lessons:
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
