"""One optimization step of `TrainingFreeGRPO`. `step(run, state, epoch, batch)` reads in the order it runs, over the
run (`Run`: fixed while it lasts) and its `State` (what a step changes), both defined in runner.py:

    with Scope(run, "step N") as scope:           # the step's failure counts, by stage
        1. each query of the batch a group of its own, beside the others (`_group`): its G attempts, their rewards,
           and the path's learning calls for the group
        2. each stage's failure check over every group, in the stages' order
        3. the plan of library operations from every group's lessons (`run.path.finish`)
        4. the judge: without a probe every operation and the demos by group advantage, with one only what it keeps
    5. the plan validated and applied in code to a copy of the library (`state.apply`), and the step's record, saved:
       the step is finished

This file holds the step and the paper's learning path (`PaperPath`); the judge, with the demos and the probe, is
judge.py (without `probe_size` and `max_demos`, as in the paper, it keeps the plan as it is); the path for small
reflection models is contrast_path.py.

A group goes through its stages at its own pace: its learning calls start as soon as its own attempts are scored,
while other groups still roll out. An attempt whose LM call failed is left out of its group; more than
`max_failure_rate` of the step's attempts failing stops the step as soon as it is certain. With `probe_min_power` the
step looks first (`_first_look`): half of each group's attempts, then the rest only where their solve rate leaves the
probe power; the learning calls wait for the whole groups (where the probe is skipped, no lesson could be kept, and
none is asked for). Each stage makes new values and never writes into what an earlier one made.

Nothing of an unfinished step is saved but what its LM calls returned (the run's record): a resume runs the step again,
and each call that asks what it asked before is answered from the record, at no cost.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import dspy

from tfgrpo.base.util import clip
from tfgrpo.optimizers.checkpoint import Keys
from tfgrpo.optimizers.judge import judge, unresolvable
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.spend import totals
from tfgrpo.optimizers.records import Failed, Group, Lessons, Scored, StepResult, Verdict
from tfgrpo.optimizers.rewards import reference_example
from tfgrpo.optimizers.runner import CONTEXT_REFUSALS, LearningPath, Run, Scope, State, TooManyFailuresError
from tfgrpo.optimizers.workers import rollout_id, with_own_lms
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.programs.render import format_fields, outcome, query_key
from tfgrpo.signatures.operations import EVERY, Operation

logger = logging.getLogger(__name__)

__all__ = ["LearningPath", "PaperPath", "Run", "State", "learn_from_groups", "step"]


def step(run: Run, state: State, epoch: int, batch: list[int]) -> tuple[State, StepResult]:
    """Step `state.step` of the run on `batch`: the new state and the step's record. A step finished in log_dir is
    reused whole."""
    index, knobs, name = state.step, run.knobs, f"step {state.step}"
    if (done := run.store.get(Keys.step(index))) is not None:
        logger.info("Step %d: finished in log_dir, reused", index)
        return State.from_record(done, index + 1), StepResult.from_dict(done["stats"])
    t0 = time.time()
    logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", index, len(batch),
                knobs.num_generations, knobs.num_threads, run.path_name)
    with Scope(run, name) as scope:
        programs = _rollout_programs(run, state)
        waits = bool(knobs.probe_size and knobs.probe_min_power)  # the learning calls wait for the step's solve rate
        first = _first_look(run, scope, state, programs, batch) if waits and knobs.num_generations >= 4 else {}
        if first and unresolvable(knobs, list(first.values())):  # (without the rest of its attempts, nor lessons)
            logger.info("Step %d: the first %d attempts of each group leave the probe no power: the step ends there",
                        index, knobs.num_generations // 2)
            results = [(group, None) for group in first.values()]
        else:  # 1. each query's group, straight through its stages
            for stage in ("rollout", "reward"):  # (past max_failure_rate of either, the step stops at once)
                scope.expect(stage, len(batch) * (knobs.num_generations - knobs.num_generations // 2 * bool(first)))
            results = scope.each(lambda qi: _group(run, scope, state, programs, qi, knobs.num_generations,
                                                   first.get(qi), learn=not waits), batch)
        scope.check("rollout")  # 2. every unit of each stage has run: its failure check
        groups = [group for group, _ in results]
        _check_attempts(run, scope, index, groups)
        if not (waits and unresolvable(knobs, groups)):  # the groups that waited for the check learn now
            results = scope.each(lambda result: (result[0], result[1] if result[1] is not None else
                                                 _learned(run, scope, state.library, result[0])), results)
        for stage in run.path.stages:
            scope.check(stage)
        # 3. the plan
        lessons = run.path.finish(run, scope, state.library, [(g, r) for g, r in results if r is not None])
        seconds = {**{s: t - t0 for s, t in scope.finished.items()}, "learning": time.time() - t0}
        verdict = judge(run, scope, state, index, groups, lessons)  # 4. what the step keeps
    sources = sorted({q for q, _ in lessons.proposals})
    new, report = state.apply(verdict, sources, quiet=bool(knobs.probe_size),  # 5. applied, and recorded
                              fold_at=knobs.duplicate_overlap)
    retired = new.library.fit(run.library_tokens, run.count_tokens, run.targets, step=index) \
        if run.library_tokens else []  # (what passes max_library_tokens, on the new state's own copy)
    for r in retired:
        logger.info("Step %d: %s retired from %s", index, r["id"], r["reason"])
    stages = ("rollout", *run.path.stages, *(("probe",) if verdict.record else ()))
    usage = {**{s: totals([]) for s in stages}, **run.record.usage(scope=name)}
    stats = _record(run, new, epoch, groups=groups, lessons=lessons, verdict=verdict, report=report, usage=usage,
                    before=run.record.usage(scope=name, new=False), seconds=seconds, t0=t0, retired=retired)
    logger.info("Step %d: %d operations proposed, applied %s, %d refused by the library; library has %d experiences",
                index, stats.operations_proposed, report.applied, len(report.rejected), len(new.library))
    run.record.sync()  # (the step's calls on disk before its record says it is finished)
    run.store.put_rows(Keys.attempts(index), [_row("rollout", g.index, a.g, a) for g in groups for a in g.attempts]
                       + [_row("probe", qi, p, a) for (p, qi), a in verdict.tried.items()])
    run.store.put(Keys.step(index), {**new.to_record(), "stats": stats.to_dict()})
    return new, stats


def _row(stage: str, query: int, program: int, attempt: Scored) -> dict:
    """An attempt as the step's attempts file holds it, for people (`program`: its G index in a rollout, the probe's
    program else: 0 the current one, 1 + c candidate c)."""
    return {"stage": stage, "query": query, "program": program, "reward": attempt.reward, "feedback": attempt.feedback,
            "error": attempt.error, "outputs": attempt.outputs, "trace": attempt.trace, "tool_calls": attempt.tool_calls,
            "text": attempt.text}


def _group(run: Run, scope: Scope, state: State, programs: list, qi: int, size: int, first: Group | None = None, *,
           learn: bool) -> tuple[Group, Any]:
    """One query straight through: its attempts up to `size` (after those of `first`, its group of the first look), the
    rewards of those that answered, and with `learn` what the path learns from the group (None without contrast). A
    group that met a failed attempt waits for the step's rollout check before it learns (None here): where the check
    stops the step, a resume makes that attempt again, and lessons drawn without it would be spent for nothing."""
    knobs, example = run.knobs, run.trainset[qi]
    gens = list(range(first.size if first else 0, size))
    attempts = dict(zip(gens, scope.attempts("rollout", [(programs[g], example) for g in gens])))
    answered = [g for g, a in attempts.items() if not a.failed]  # a failed LM call is no answer
    # (a group made in halves has a probe, so the ground truth: the first half's rewards stand)
    reference = reference_example(example, [attempts[g] for g in answered], knobs.use_ground_truth)
    scores = scope.map("reward", lambda g: scope.score(attempts[g], reference, g), answered)
    group = Group(index=qi, key=query_key(example, qi), example=example, size=size,
                  attempts=(*(first.attempts if first else ()), *scores))
    failed = any(a.failed or (a.error and not a.unparsed) for a in attempts.values())
    return group, _learned(run, scope, state.library, group) if learn and not failed else None


def _learned(run: Run, scope: Scope, library: ExperienceLibrary, group: Group) -> Any:
    """What the path learns from `group`: None without reward contrast."""
    return run.path.learn(run, scope, library, group) if group.informative else None


def _first_look(run: Run, scope: Scope, state: State, programs: list, batch: list[int]) -> dict[int, Group]:
    """The first look (`probe_min_power`): the first half of each query's attempts, checked as the rollout is; the
    groups by query."""
    half = run.knobs.num_generations // 2
    for stage in ("rollout", "reward"):
        scope.expect(stage, len(batch) * half)
    results = scope.each(lambda qi: _group(run, scope, state, programs, qi, half, learn=False), batch)
    scope.check("rollout")
    return {group.index: group for group, _ in results}


def _rollout_programs(run: Run, state: State) -> list[dspy.Module]:
    """G copies of the program with the library and demos, each with private, distinct LM copies."""
    knobs, programs = run.knobs, []
    learned = with_learned(run.program, run.targets, state.library, state.demos)
    for g in range(knobs.num_generations):
        programs.append(with_own_lms(learned, rollout_id=rollout_id(knobs.seed, state.step, g),
                                     temperature=knobs.temperature))
    return programs


def _check_attempts(run: Run, scope: Scope, index: int, groups: list[Group]) -> None:
    """Say what the step's attempts met: metric calls that timed out or raised (each scored 0; more than
    `max_failure_rate` of them stop the step, as an outage does), attempts that raised (scored 0), LM calls that
    failed (left out) and prompts refused for their length."""
    scored = sum(len(g.attempts) for g in groups)
    failed = [a.metric_failed for g in groups for a in g.attempts if a.metric_failed]
    if failed and len(failed) > run.knobs.max_failure_rate * scored:
        raise TooManyFailuresError(f"step {index}: the metric failed (timed out or raised) on {len(failed)} of {scored} "
                                   f"attempts (first: {failed[0]}); every reply so far is kept in "
                                   f"log_dir={run.knobs.log_dir!r}")
    if failed:
        logger.warning("Step %d: the metric failed (timed out or raised) on %d of %d attempts, each scored 0 (first: "
                       "%s)", index, len(failed), scored, failed[0])
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


def _record(run: Run, new: State, epoch: int, *, groups: list[Group], lessons: Lessons, verdict: Verdict,
            report: ApplyReport, usage: dict, before: dict, seconds: dict, t0: float, retired: list[dict]
            ) -> StepResult:
    """The record of the step that made `new`: what it made (its groups, lessons, verdict, the library's report of
    the edits and what `max_library_tokens` retired) and spent (`usage` by stage, `before`: of it, what a run stopped in
    the step had spent; when each stage ended, `t0`: when the step began)."""
    # where the plan's experiences go: some predictors, every one ("all"), or every one as it named none of them
    placed = ["all" if EVERY in op.predictors else "some" if op.predictors else "none named"
              for op in verdict.plan if hasattr(op, "predictors")]
    library = {**({"folded": [{"text": op.text, "into": into} for op, into in report.folded]} if report.folded else {}),
               **({"retired": retired} if retired else {}),
               **({"placed": {k: placed.count(k) for k in ("some", "all", "none named")}} if placed else {})}
    attempts, informative = [a for g in groups for a in g.attempts], [g for g in groups if g.informative]
    timeouts, raised = [a for a in attempts if a.timeout], [a for a in attempts if a.metric_error]
    made_attempts = sum(g.size for g in groups)
    return StepResult(
        step=new.step - 1, epoch=epoch, batch_size=len(groups), learning_path=run.path_name,
        mean_reward=statistics.fmean(a.reward for a in attempts) if attempts else 0.0, groups=len(groups),
        groups_kept=len(informative), frac_skipped_zero_std=1 - len(informative) / len(groups),
        rollout_failures=sum(bool(a.error) for a in attempts) + made_attempts - len(attempts),
        failed_calls=made_attempts - len(attempts), solved=sum(a.reward >= 1 for a in attempts),
        tool_calls_mean=statistics.fmean(a.tool_calls for a in attempts) if attempts else 0.0,
        learning_failures=lessons.learning_failures,
        operations_proposed=lessons.operations_proposed,
        operations_applied=report.applied, operations_rejected=len(report.rejected),
        library_size=len(new.library), consolidation=lessons.consolidation,
        usage=usage,
        seconds=seconds, wall_s=time.time() - t0,
        metric_calls=len(attempts) + (verdict.record or {}).get("attempts_run", 0),
        demos=[d.query for d in verdict.demos], probe=verdict.record, queries=[g.index for g in groups],
        usage_before_resume=before,
        details={**lessons.details, **({"metric_timeouts": len(timeouts)} if timeouts else {}),
                 **({"metric_errors": len(raised)} if raised else {}), **library})


def learn_from_groups(path: LearningPath, groups: list[Group], *, settings: Knobs, reflection_lm: dspy.BaseLM,
                      library: ExperienceLibrary, instructions: str = "") -> tuple[Lessons, dict[str, dict]]:
    """Run `path` on groups scored elsewhere (saved rollouts, say), as a step would, with nothing saved: its lessons and
    the usage of each of its stages. The library is not changed (apply the plan to a copy); `instructions`, the
    program's (what a rule may repeat)."""
    with Run(knobs=settings, metric=lambda *_: 0.0, path=path, path_name=type(path).__name__,
             reflection_lm=reflection_lm, instructions=instructions) as run, Scope(run, "learning") as scope:
        results = scope.each(lambda group: (group, _learned(run, scope, library, group)), groups)
        for stage in path.stages:
            scope.check(stage)
        lessons = path.finish(run, scope, library, [(g, r) for g, r in results if r is not None])
        return lessons, {**{stage: totals([]) for stage in path.stages}, **run.record.usage()}


# == the learning paths ===============================================================================================
# The learning paths: how one step's informative groups become a plan of library operations.
#
# A path is a plug-in with a small contract, so that a new way of learning needs nothing of the optimizer's insides:
#
#     class MyPath(LearningPath):
#         stages = ("lesson",)                          # the stages its LM calls are charged and checked under
#
#         def learn(self, run, scope, library, group):  # one group's calls (groups run side by side)
#             def lesson():                             # one learning call, under run.reflection_lm
#                 with dspy.context(lm=run.reflection_lm):
#                     return dspy.Predict("attempts -> lesson")(attempts=...).lesson
#             return scope.call("lesson", lesson)
#
#         def finish(self, run, scope, library, results):  # every group done: [(group, its result)] -> the plan
#             return Lessons(plan=[...], proposals=[(group.key, op), ...])
#
# `run` is the run (`Run`, above): its knobs (`run.knobs`), the reflection LM (`run.reflection_lm`) and the program's
# instructions; `scope` is the step's (`runner.Scope`). `library` is the library as the step started: read it, never
# edit it. `scope.call(stage, fn)` (or `calls(stage, fns)` for several at once) makes a learning call on the run's
# workers: its LM calls charged to the budget and recorded under `stage` (a resume gets the same replies back with no
# new call); one that raises comes back as a `Failed` and is counted, and once every group is done the step checks
# the stage (more than `max_failure_rate` failed: the step stops). A path never waits on other groups itself; any
# value may come back from a call (a list of operations, a model of yours). The paper's path is `PaperPath`;
# `ContrastPath` (contrast_path.py) is the path for small reflection models. Pass an instance as `learning_path=` to
# plug in your own; `learn_from_groups` (above) runs a path on groups scored elsewhere (saved rollouts, say).

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


@dataclass(frozen=True)
class Advantage:
    """What `PaperPath.learn` makes of one group: the group advantage's operations, or the `Failed` call, and how
    many of its summaries failed (the raw attempt stood in for each)."""

    ops: list[Operation] | Failed
    failed_summaries: int


@dataclass(frozen=True)
class Consolidation:
    """The consolidation call's plan for the batch, and how it was made ("ok", or the fallback that stood in)."""

    plan: list[Operation]
    status: str


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
        rendered = library.render(tagged=bool(run.roles)) or EMPTY_LIBRARY
        task = format_fields(group.example.inputs())
        summarizer = Summarizer(knobs.use_ground_truth)
        extractor = AdvantageExtractor(knobs.use_ground_truth, run.roles or None)
        summarizer.set_lm(run.reflection_lm)
        extractor.set_lm(run.reflection_lm)

        def summarize(a):  # 1. one summary per attempt
            return lambda: summarizer(task_input=task, attempt=a.text, outcome=outcome(a), reference_answer=answer_key,
                                      experiences=rendered)

        summaries = scope.calls("summary", [summarize(a) for a in group.attempts])
        failed = [s.error for s in summaries if isinstance(s, Failed)]
        shown = []
        for a, summary in zip(group.attempts, summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", group.index, a.g,
                               summary.error)
                summary = clip(a.text, 1500)
            shown.append(f"Attempt {a.g + 1} (reward {a.reward:.2f}):\n{summary}")

        def extract():  # 2. the group's advantage, as operations
            return extractor(task_input=task, reference_answer=answer_key, attempts="\n\n".join(shown),
                             experiences=rendered, max_operations=knobs.max_operations_per_group,
                             max_words=knobs.max_words_per_experience)

        return Advantage(ops=scope.call("advantage", extract), failed_summaries=len(failed))

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
            proposals += [(group.key, op) for op in res.ops]
        plan, status = self._consolidate(run, scope, library, proposals)  # 3. one call for the batch
        return Lessons(plan=plan, proposals=proposals, consolidation=status, learning_failures=failures)

    @staticmethod
    def _consolidate(run: Run, scope: Scope, library: ExperienceLibrary, proposals: list[tuple[str, Operation]]
                     ) -> tuple[list[Operation], str]:
        """One call turns the batch's proposals into the plan; if it fails, the (validated) proposals are the plan.
        Where the proposals, applied as they are, would pass `max_library_tokens`, the call is asked to make room."""
        if not proposals:
            return [], "nothing proposed"
        consolidator = Consolidator(run.roles or None, room=_room(run, library, [op for _, op in proposals]))
        consolidator.set_lm(run.reflection_lm)

        def consolidate():
            return Consolidation(plan=consolidator(experiences=library.render(tagged=bool(run.roles)) or EMPTY_LIBRARY,
                                                   proposals=proposals, max_words=run.knobs.max_words_per_experience),
                                 status="ok")

        made = scope.call("consolidation", consolidate)
        if isinstance(made, Failed):  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", made.error, len(proposals))
            made = Consolidation(plan=[op for _, op in proposals], status="fallback: proposals applied directly")
        return made.plan, made.status




def _room(run: Run, library: ExperienceLibrary, operations: list[Operation]) -> str:
    """What the consolidation call is told where `operations`, applied as they are, would pass `max_library_tokens`
    (the predictors it would pass for); "" where they would not, or there is no cap."""
    if not run.library_tokens:
        return ""
    trial = library.copy()
    trial.apply(operations, step=0, quiet=True, fold_at=run.knobs.duplicate_overlap)
    over = [name for name in run.targets if run.count_tokens(trial.for_predictor(name).render()) > run.library_tokens]
    if not over:
        return ""
    whose = f" for {', '.join(over)}" if run.roles else ""
    return (f"A predictor's experiences may hold at most {run.library_tokens} tokens; applied as proposed, these edits "
            f"would pass that{whose}. Make room: merge experiences that say the same thing, delete the ones that help "
            "least, and leave out the weakest proposals.")
