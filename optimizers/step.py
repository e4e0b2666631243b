"""One optimization step of `TrainingFreeGRPO`, read top to bottom in the order the data flows:

    rollouts (Attempt) -> rewards (Scored) -> groups (Group) -> learning path (Learned) -> [probe] -> library, demos

Each group goes through the step at its own pace (`parallel.run_flows`): its learning calls start as soon as its own
attempts are scored, while other groups still roll out. A stage makes new values from the ones before it and never
writes into them. Every finished unit is checkpointed under `steps/NNNN/`, so a crashed step resumes without
resending it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

from tfgrpo.base.util import digest
from tfgrpo.optimizers.attempts import Attempt, Group, Scored
from tfgrpo.optimizers.checkpoint import TALLY
from tfgrpo.optimizers.demos import demo_candidates, keep_best, select_demos, with_learned
from tfgrpo.optimizers.learning_paths import StepContext
from tfgrpo.optimizers.parallel import StageBars, TooManyFailuresError, WaitFor, run_flows, run_parallel
from tfgrpo.optimizers.probe import Candidate, probe_queries, run_probe
from tfgrpo.optimizers.render import format_attempt, query_key
from tfgrpo.optimizers.result import StepResult
from tfgrpo.optimizers.rewards import check_metric_timeouts, reference_example, score_attempt
from tfgrpo.optimizers.rollout import run_program, warn_context_refusals, with_own_lms
from tfgrpo.optimizers.usage import add_usage, meter_totals, metered, metered_stages, stage_usage
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


def candidates_for(opt, program, targets, library, demos, step):
    """G copies of the program with the library (and demos), each with private, distinct LM copies."""
    programs, lms = [], []
    for g in range(opt.num_generations):
        rollout_id = int(digest([opt.seed, step, g]), 16) % 2**31
        cand, copies = with_own_lms(with_learned(program, targets, library, demos), rollout_id=rollout_id,
                                    temperature=opt.temperature)
        programs.append(cand)
        lms += copies
    return programs, lms


def run_step(opt, path, path_name, program, targets, library, demos, trainset, batch, step, epoch, reflection_lm, ckpt):
    """One step over the queries `batch`: returns the new library, the demos and the step's `StepResult`. `opt` is
    read for its knobs and metric only; `path` is the learning path (`learning_paths.LearningPath`)."""
    key = f"steps/{step:04d}"
    if (done := ckpt.get(f"{key}/done")) is not None:
        logger.info("Step %d: complete in the checkpoint, reused", step)
        return ExperienceLibrary.from_state(done["library"]), done.get("demos", []), StepResult(**done["stats"])
    G, t0, finished_at = opt.num_generations, time.time(), {}
    programs, rollout_lms = candidates_for(opt, program, targets, library, demos, step)
    instructions = " ".join(p.signature.instructions for _, p in program.named_predictors())
    groups: dict[int, Group] = {}
    results: dict[int, object] = {}  # what the learning path made of each informative group
    failed_rollouts: list[str] = []  # checkpoint units of attempts that raised
    timed_out: list[str] = []  # metric calls that did not return within metric_timeout_s

    spent_key = f"{key}/{TALLY}"  # calls and tokens of the step's finished units, saved as each one is
    before = ckpt.get(spent_key, unit=False) or {}  # what a run stopped in this step had spent: a resume reuses its units
    spent_lock = threading.Lock()  # units save from their threads: the latest totals win

    def save_spent(more: dict | None = None):  # cost is left out: it is read from the LMs' history at the end
        with spent_lock:
            totals = {**{s: meter_totals(m) for s, m in meters.items()}, **(more or {})}
            ckpt.put(spent_key, {**before, **{s: add_usage(dict(before.get(s, {})), u) for s, u in totals.items()}})

    def rollout(job) -> Attempt:  # G distinct samples per query, each candidate with its own LM copies (rollout_id)
        qi, g = job
        unit = f"{key}/rollouts/{qi}_{g}"
        if (rec := ckpt.get(unit)) is not None:
            return Attempt.from_record(rec)
        _, rec = run_program(programs[g], trainset[qi])  # a failed attempt is recorded and scored 0
        attempt = Attempt(outputs=rec["outputs"], error=rec["error"], trace=rec["trace"], tool_calls=rec["tool_calls"],
                          text=format_attempt(dict(trainset[qi].inputs().items()), rec["outputs"], rec["trace"],
                                              rec["error"]))
        ckpt.put(unit, attempt.to_record())
        save_spent()
        return attempt

    def reward(job) -> Scored:  # against the ground truth, or against the group's majority answer
        qi, g, attempt, reference = job
        unit = f"{key}/rewards/{qi}_{g}"
        if (rec := ckpt.get(unit)) is None:
            rec = score_attempt(opt.metric, reference, attempt.to_record(), opt.metric_timeout_s)
            if "timeout" in rec:  # scored 0 and counted; not saved, so a resume asks the metric again
                timed_out.append(rec["timeout"])
            else:
                ckpt.put(unit, rec)
            save_spent()
        return Scored(attempt=attempt, reward=rec["reward"], feedback=rec["feedback"])

    def flow(qi):
        """One query's way through the step: it learns as soon as its own attempts are scored."""
        attempts = yield [("rollout", rollout, (qi, g)) for g in range(G)]
        ctx.count_failures("rollout", [a.error for a in attempts if a.error], G)
        failed_rollouts.extend(f"{key}/rollouts/{qi}_{g}" for g, a in enumerate(attempts) if a.error)
        if any(a.error for a in attempts):
            yield WaitFor("rollout")  # nothing more is spent on it before the attempts' failure check
        reference = reference_example(trainset[qi], [a.to_record() for a in attempts], opt.use_ground_truth)
        scored = yield [("reward", reward, (qi, g, a, reference)) for g, a in enumerate(attempts)]
        groups[qi] = group = Group(index=qi, key=query_key(trainset[qi], qi), example=trainset[qi],
                                   attempts=tuple(scored))
        if group.informative:
            results[qi] = yield from path.learn(ctx, group)

    def check(stage):  # the stage's failure check; a flow waits at it (WaitFor)
        try:
            ctx.check(stage)
        except TooManyFailuresError:
            for unit in failed_rollouts if stage == "rollout" else []:
                ckpt.discard(unit)  # a resume retries them (the outage may be over) instead of replaying them
            raise

    def progress(stage, n, total):
        finished_at[stage] = time.time() - t0  # stages overlap: when each one's latest unit finished
        (opt.progress or bars)(stage, n, total)

    bars, stages = StageBars(), ("rollout", *path.stages)
    logger.info("Step %d: %d queries x %d attempts on %d thread(s), %s path", step, len(batch), G, opt.num_threads,
                path_name)
    with metered_stages(stages) as meters:
        ctx = StepContext(step=step, settings=opt, reflection_lm=reflection_lm, library=library,
                          trainset=trainset, instructions=instructions, ckpt=ckpt, key=key, meters=meters,
                          progress=opt.progress, saved=save_spent)
        try:
            run_flows([flow(qi) for qi in batch], num_threads=opt.num_threads, progress=progress, meters=meters,
                      on_stage_done=check)
        finally:
            bars.close()
        check("rollout")
        kept = [groups[qi] for qi in batch if groups[qi].informative]
        attempts = [a for qi in batch for a in groups[qi].attempts]
        mean_reward = statistics.fmean(a.reward for a in attempts)
        check_metric_timeouts(opt, step, timed_out, len(attempts), ckpt)
        warn_context_refusals(step, [a.error for a in attempts if a.error])
        logger.info("Step %d: mean reward %.3f, %d/%d groups with contrast", step, mean_reward, len(kept), len(batch))
        for stage in path.stages:  # every unit of every stage has run: the stage-wide failure checks
            check(stage)
        learned = path.finish(ctx, [(g, results[g.index]) for g in kept])
        finished_at["learning"] = time.time() - t0
    usage = {"rollout": stage_usage(meters["rollout"], rollout_lms)}
    usage.update({stage: stage_usage(meters[stage], ctx.stage_lms(stage)) for stage in path.stages})

    plan, probe = learned.plan, None
    if opt.probe_size:  # each edit tried on other training queries first (optimizers/probe.py)
        plan, demos, probe, usage["probe"] = probe_edits(opt, program, targets, library, demos, plan, kept, trainset,
                                                         batch, step, key, ckpt, save_spent)
    elif opt.max_demos:  # winning attempts as demos (optimizers/demos.py)
        demos = select_demos(demos, demo_candidates(kept, step), opt.max_demos)
    usage = {stage: add_usage(dict(before.get(stage, {})), u) for stage, u in usage.items()}
    # the plan is validated and applied in code, all or nothing, to a new library
    library = library.copy()
    report = library.apply(plan, step=step, sources=sorted({q for q, _ in learned.proposals}))
    stats = StepResult(
        step=step, epoch=epoch, batch_size=len(batch), learning_path=path_name, mean_reward=mean_reward,
        groups=len(batch), groups_kept=len(kept), frac_skipped_zero_std=1 - len(kept) / len(batch),
        rollout_failures=sum(bool(a.error) for a in attempts),
        tool_calls_mean=statistics.fmean(a.attempt.tool_calls for a in attempts),
        learning_failures=learned.counts.get("learning_failures", 0),
        operations_proposed=learned.counts.get("operations_proposed", len(learned.proposals)),
        operations_applied=report.applied, operations_rejected=len(report.rejected), library_size=len(library),
        consolidation=learned.consolidation, usage=usage, seconds=finished_at, wall_s=time.time() - t0,
        demos=[d["query"] for d in demos], probe=probe, usage_before_resume=before,
        details={**{k: v for k, v in learned.counts.items() if k not in ("learning_failures", "operations_proposed")},
                 **({"metric_timeouts": len(timed_out)} if timed_out else {})})
    specific = stats.details.get("refused_specific", 0)  # refused by the contrast path before any plan
    logger.info("Step %d: %d operations proposed%s, applied %s, %d refused by the library; library has %d experiences",
                step, stats.operations_proposed, f" ({specific} refused as task-specific)" if specific else "",
                report.applied, len(report.rejected), len(library))
    ckpt.put(f"{key}/done", {"library": library.dump_state(), "demos": demos, "stats": stats.to_dict()})
    return library, demos, stats


def probe_edits(opt, program, targets, library, demos, plan, kept, trainset, batch, step, key, ckpt, save_spent):
    """The plan's operations and the step's demo candidates, each tried against the current program on the same
    training queries outside the batch. Returns the kept plan, the demos, the probe's record and its usage
    (`save_spent` keeps what the probe has spent so far with the step's checkpoint)."""
    found = demo_candidates(kept, step, min_reward=0.0) if opt.max_demos else []
    found = sorted(found, key=lambda d: (-d["reward"], -d["advantage"], d["query"]))[: (opt.max_probed_edits + 1) // 2]
    candidates = [Candidate(label=f"demo from {d['query']} (reward {d['reward']:.2f})", demo=d) for d in found]
    for op in plan:
        if len(candidates) >= opt.max_probed_edits:
            break
        trial = library.copy()
        if trial.apply([op], step=step).num_applied:  # an operation the library refuses is not worth a probe
            candidates.append(Candidate(label=f"{op.action} {op.ids or ''} {op.text[:60]!r}", operations=(op,)))
    if library.active and len(candidates) < opt.max_probed_edits:  # a spare slot: must a current experience stay?
        target = list(library.active)[step % len(library.active)]  # each in turn
        candidates.append(Candidate(label=f"retire {target}", operations=(Operation(action="delete", ids=[target]),)))
    record = {"candidates": [], "unprobed": max(0, len(plan) + len(found) - len(candidates))}
    if not candidates:
        return [], demos, record, {}
    programs = [with_learned(program, targets, library, demos)]
    for c in candidates:
        if c.demo is not None:
            programs.append(with_learned(program, targets, library, keep_best(demos, opt.max_demos - 1) + [c.demo]))
        else:
            trial = library.copy()
            trial.apply(list(c.operations), step=step)
            programs.append(with_learned(program, targets, trial, demos))
    rollout_id = int(digest([opt.seed, step, "probe"]), 16) % 2**31
    lms, runnable = [], []
    for p in programs:
        cand, copies = with_own_lms(p, rollout_id=rollout_id, temperature=opt.temperature)
        runnable.append(cand)
        lms += copies

    # the current program's attempts are kept by what the program is, not by step: a later step whose program has
    # not changed reuses them on the probe queries it shares with this one
    current = digest([[e.model_dump() for e in library.active.values()], demos])

    def unit_of(p, qi):
        return f"probe-base/{current}/{qi}" if p == 0 else f"{key}/probes/{p}_{qi}"

    def run_units(fn, jobs):
        def unit(job):
            rec = fn(job)
            ckpt.put(unit_of(*job), rec)
            save_spent({"probe": meter_totals(used)})
            return rec
        return run_parallel(unit, jobs, num_threads=opt.num_threads, stage="probe", progress=opt.progress)

    queries = probe_queries(len(trainset), batch, opt.probe_size, seed=opt.seed, step=step)
    with metered() as used:
        result = run_probe(runnable, candidates, queries=queries, trainset=trainset, metric=opt.metric,
                           unit_of=unit_of, cached=ckpt.get, run_units=run_units, keep_ties=opt.keep_tied_demos)
    record.update(result.to_dict(candidates))
    kept_ops = [op for c, k in zip(candidates, result.kept) if k for op in c.operations]
    best = next((i for i, (c, k) in enumerate(zip(candidates, result.kept)) if k and c.demo is not None), None)
    if best is not None:  # the demo set the winning candidate demo was probed with
        solved, mean = result.scores[best]
        gain = solved - result.base[0] + mean - result.base[1]
        demos = keep_best(demos, opt.max_demos - 1) + [dict(candidates[best].demo, gain=gain)]
    return kept_ops, demos, record, stage_usage(used, lms)
