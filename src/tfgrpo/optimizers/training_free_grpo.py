"""Training-Free GRPO (arXiv 2510.08191) as a DSPy teleprompter.

GRPO's outer loop is kept: each query of a batch is attempted `num_generations` times, the attempts are scored, and a
group is only informative when its rewards differ. The gradient step is replaced by edits of an experience library that
lives in the program's instructions. `compile` reads as four stages:

    plan    = self.plan(student, trainset, valset)   # every check, the preset and path, the estimate (plan.py)
    run     = Run(...); state = State(library)        # fixed for the run / what a step changes (step.py)
    state   = step(run, state, epoch, batch)          # per batch of every epoch; validated after each epoch
    program = the student's copy with the kept state  # the best validated epoch's, else the last

Every LM call of the run (the program's, the metric's, the learning calls) leaves through the run's record (record.py),
kept in `log_dir` as it returns and charged to the budget before it is sent; a finished step is saved whole. So a
crashed or stopped run resumes by running the same code again: a finished step is reused, and in an unfinished one
every call that asks what it asked before is answered from the record, at no cost.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import random
from typing import Any, Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.optimizers.checkpoint import Checkpoint, Keys
from tfgrpo.optimizers.record import LIMITS, BudgetExhausted, Record, RecordError
from tfgrpo.optimizers.runner import Run, Scope, State
from tfgrpo.optimizers.workers import StageBars, guard_cache, with_own_lms
from tfgrpo.optimizers.knobs import KNOBS, Knobs, args_doc, check_knob
from tfgrpo.optimizers.contrast_path import ContrastPath
from tfgrpo.optimizers.step import PaperPath
from tfgrpo.optimizers.plan import Plan, make_plan
from tfgrpo.optimizers.records import EpochResult, StepResult, TrainingFreeGRPOResult, WorthResult
from tfgrpo.optimizers.rewards import metric_takes_trace
from tfgrpo.optimizers.step import step
from tfgrpo.optimizers.worth import Attribution, Learned, log_worth
from tfgrpo.programs.inject import with_learned

logger = logging.getLogger(__name__)

DOC = """Learns a library of natural-language experiences for a DSPy program, and writes it into the instructions of
    its predictors; the weights and the program's own instructions are left alone.

    `compile(student, trainset=..., valset=None)` returns a copy of the student with the library in place
    (`compiled.experience_library`) and the run's record in `compiled.detailed_results`: per step the mean reward,
    groups kept, failures, operations, library size and LM usage by stage; per epoch the validation score and failures;
    with a valset, `best_epoch`, the epoch whose library the compiled program carries; `usage`, the calls this call
    made, and `run_usage`, those of the whole run (steps reused from `log_dir` included). `plan(student, trainset)`
    says what a compile will do and spend, without a call. A student that carries an `experience_library` (or, loaded
    with stock DSPy, only its rendering in the instructions) goes on learning from it. Every LM call's reply is kept
    in `log_dir` as it returns, and every finished step; the same call resumes an interrupted run, running the
    program again with the answered calls answered from the record.

    Every knob is a keyword argument, declared once (type, default, check, doc) in `src/tfgrpo/optimizers/knobs.py`, from which
    the Args after `metric` are filled in and the knob table of docs/usage.md is written; `optimizer.knobs` holds them
    as passed, `optimizer.plan(...).knobs` as the run uses them (the `auto` preset applied).

    Args:
        metric: `metric(example, prediction, trace=None)` (or `metric(example, prediction)`, as dspy.Evaluate
            calls it) returns a reward in [0, 1] (a bool counts as 0 or 1), or a
            `dspy.Prediction(score=..., feedback=...)` whose feedback the learning calls read. A metric that
            raises, leaves [0, 1] or returns anything else (such as the string "1") stops the run with a
            `MetricError`.
"""


_SIGNATURE = inspect.Signature([inspect.Parameter("metric", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  annotation="Callable")] + [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
    for name, f in KNOBS.items()])


class TrainingFreeGRPO(Teleprompter):
    __doc__ = DOC + args_doc()  # the knobs' Args, from knobs.py
    __signature__ = _SIGNATURE  # (metric, *, <every knob>): what inspect and editors show for the keywords below

    def __init__(self, metric: Callable, **knobs: Any):
        if not callable(metric):
            raise TypeError("metric must be callable: metric(example, prediction, trace=None) -> float | dspy.Prediction")
        metric_takes_trace(metric)  # a TypeError now for a metric that takes neither (example, pred) nor a trace
        if unknown := sorted(set(knobs) - set(KNOBS)):
            close = {name: difflib.get_close_matches(name, KNOBS, n=1) for name in unknown}
            raise TypeError("TrainingFreeGRPO got unknown keyword argument(s): " + ", ".join(
                name + (f" (did you mean {close[name][0]!r}?)" if close[name] else "") for name in unknown))
        object.__setattr__(self, "metric", metric)
        object.__setattr__(self, "knobs", Knobs(**knobs))  # every knob checked (knobs.py)
        object.__setattr__(self, "explicit", frozenset(knobs))  # the knobs passed: they win over the `auto` preset
        if self.probe_size and not self.use_ground_truth:
            raise ValueError("probe_size needs use_ground_truth=True: a probe scores single attempts, which have no "
                             "group to take a majority answer from")
        if self.use_mlflow and "mlflow" not in hooks.installed():
            raise RuntimeError("use_mlflow=True, but no MLflow tracker is registered: tfgrpo's entry point "
                               f"{hooks.GROUP}:mlflow comes with its install (pip install -e . in a clone)")
        hooks.built(self)  # trackers learn of it (tfgrpo.base.hooks)

    __init__.__signature__ = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
                                                *_SIGNATURE.parameters.values()])

    def __getattr__(self, name: str) -> Any:  # a knob reads as an attribute: optimizer.num_generations
        if name in KNOBS and "knobs" in self.__dict__:
            return getattr(self.__dict__["knobs"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:  # and is set as one, checked as the constructor checks it
        if name in KNOBS:
            setattr(self.knobs, name, check_knob(name, value))
        else:
            object.__setattr__(self, name, value)

    def explicit_knobs(self) -> set[str]:
        """The knobs passed to the constructor (they win over the `auto` preset)."""
        return set(self.explicit)

    def plan(self, student: dspy.Module, trainset: list, valset: list | None = None, *,
             attribution_set: list | None = None, reply_tokens: int | None = None, pilot: int = 0) -> Plan:
        """What `compile` with these arguments will do, with nothing written and no LM call unless `pilot`: every
        check compile makes (a refusal raises the same error), the preset and learning path chosen, the budget, and
        the expected calls, tokens and dollars (`Plan`). A reply's length is guessed from the output fields, or
        `reply_tokens` (yours), or measured: `pilot=4` runs the student on 4 training queries first (real calls,
        billed) and takes a reply's tokens, and the prompts' as the provider counts them, from those calls.
        `print(plan.summary())`."""
        return make_plan(self, student, trainset, valset, attribution_set, reply_tokens=reply_tokens, pilot=pilot)

    # -- the outer loop -------------------------------------------------------------------------------------------
    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset: list | None = None,
                attribution_set: list | None = None) -> dspy.Module:
        """Learn a library (and, with `max_demos`, demos) for a copy of `student`; `student` itself is left as it is.

        Args:
            student: The DSPy program to compile (an instance). One that already carries a library goes on
                learning from it.
            trainset: `dspy.Example`s with their inputs marked (`.with_inputs(...)`); the rollouts, and the probe
                with `probe_size`, draw their queries from it.
            teacher (None): Refused unless None: the program learns from its own attempts. For a stronger model in the
                learning calls, pass `reflection_lm=` to the constructor.
            valset: `dspy.Example`s scored after each epoch; the compiled program carries the library (and demos)
                of the epoch that scored best, the later one on a tie. None: those of the last epoch.
            attribution_set: With `attribution`, the held-out `dspy.Example`s each kept item's worth is measured on;
                None: the valset.

        Returns:
            The compiled copy. Its target predictors' instructions hold the library, so `save()` keeps it;
                `experience_library` is the library itself and `detailed_results` the run's record
                (`TrainingFreeGRPOResult`).

        Raises:
            TypeError: `student` is no `dspy.Module` instance, or an example is no `dspy.Example`.
            ValueError: An empty trainset, an example without marked inputs or without an input the program
                reads, no LM configured, a teacher, or a `max_cost` with no price to count; `RunMismatchError`
                (a ValueError): `log_dir` holds a run made with other settings.
            RunLockedError: Another compile holds `log_dir`.
            OSError: The run's record in `log_dir` could not be written (a full disk, say): every reply before it is
                kept, and the same call resumes once the disk is back.
            MetricError: The metric raised, or returned something other than a score in [0, 1].
            TooManyFailuresError: More than `max_failure_rate` of a step's units (or of a validation) failed.
        """
        if teacher is not None:
            raise ValueError("TrainingFreeGRPO learns from the student's own attempts and takes no teacher; to have "
                             "a stronger model make the learning calls, pass reflection_lm=")
        guard_cache()  # an empty reply is never served back from DSPy's cache to a retry or a resume
        try:
            return self._compile(student, trainset, valset, attribution_set)
        except RecordError as exc:  # (a full disk, say): the error itself, naming the record's file
            raise exc.error from None

    def _compile(self, student: dspy.Module, trainset: list, valset: list | None, attribution_set: list | None
                 ) -> dspy.Module:
        store = Checkpoint(self.log_dir)
        with store.locked():  # one compile per log_dir: a second one is refused at once
            plan = make_plan(self, student, trainset, valset, attribution_set, say=True)
            info = hooks.CompileInfo(knobs={name: getattr(self, name) for name in KNOBS},
                                     params=functools.partial(_params, self, plan, student))
            with hooks.tracked(info) as trackers:  # the trackers (MLflow's) see the run from its start to the program
                saved = store.start(plan.fingerprint, other_versions=plan.knobs.resume_other_versions)
                logger.warning("%s", plan.summary())
                if saved["steps"] or saved["calls"]:
                    logger.info("resuming from %s: %d finished step(s), %d recorded LM call(s)", store.root,
                                saved["steps"], saved["calls"])
                with self._run(plan, student, trainset, store) as run:
                    if nodes := getattr(run.backend, "nodes", None):  # (Ray's: each node's tfgrpo, DSPy, Python)
                        store.note("nodes", nodes)
                    held_out = attribution_set if attribution_set is not None else valset
                    compiled = self._learn(run, plan, valset, held_out, trackers)
                for tracker in trackers:
                    tracker.finish(compiled)
            return compiled

    def _run(self, plan: Plan, student: dspy.Module, trainset: list, store: Checkpoint) -> Run:
        """What every step of the compile of `plan` shares: the resolved knobs, the path, the LMs, the record of its
        calls (log_dir's), its backend and its store."""
        knobs, program = plan.knobs, student.deepcopy()
        for name, predictor in program.named_predictors() if plan.demos else ():
            if name in plan.targets:  # the demos it carries are the run's own from here (State.demos)
                predictor.demos = []
        path = knobs.learning_path if not isinstance(knobs.learning_path, str) else \
            ContrastPath() if plan.learning_path == "contrast" else PaperPath()
        reflection_lm = self.reflection_lm or dspy.settings.lm or next(
            p.lm for _, p in program.named_predictors() if p.lm is not None)
        record = Record(store.root, limits={knob: getattr(knobs, knob) for knob in LIMITS.values()},
                        prices=knobs.prices)
        return Run(knobs=knobs, metric=self.metric, record=record, store=store, path=path,
                   path_name=plan.learning_path, reflection_lm=reflection_lm, program=program, targets=plan.targets,
                   trainset=trainset, instructions=" ".join(p.signature.instructions
                                                            for _, p in program.named_predictors()),
                   roles=plan.roles, library_tokens=plan.library_tokens, count_tokens=plan.count_tokens)

    def _learn(self, run: Run, plan: Plan, valset: list | None, held_out: list | None, trackers: list) -> dspy.Module:
        """With `plan.refit`, the carried items measured and pruned on `held_out`; then the epochs' steps and
        validations, then the attribution on `held_out`; the compiled copy of the student (of `run.program`, the
        student's copy the run learns for)."""
        knobs, state, total = run.knobs, State(library=plan.library, demos=list(plan.demos)), plan.steps
        steps, epochs, best, stopped, refit = [], [], None, None, None
        bar = knobs.progress or StageBars(resumed=True)  # the whole run: steps done of all, with its ETA
        if total:
            bar("step", sum(run.store.get(Keys.step(i)) is not None for i in range(total)), total)
        rng = random.Random(knobs.seed)
        # a new run whose budget cannot pay for the first step's attempts (what it knows before any call: the metric
        # calls) sends nothing: no step, refit or attribution (a resume goes through its steps, the record answering)
        need = min(knobs.batch_size, len(run.trainset)) * knobs.num_generations + \
            2 * min(knobs.probe_size, len(run.trainset))
        short = run.record.reached(need) if total and not (plan.resume.get("steps") or plan.resume.get("calls")) \
            else None
        no_step = short is not None
        if no_step:
            stopped = (f"{short}: nothing was sent (raise the budget, or lower batch_size or num_generations; "
                       "optimizer.plan(...) shows what a step needs)")
        try:
            if plan.refit and not no_step:
                refit, kept = _refit(run, plan, state, held_out)
                state = State(library=kept.library, demos=kept.demos)
            for epoch in range(0 if no_step else knobs.num_train_epochs):
                if state.step == total:  # max_steps reached with the last epoch
                    break
                order = list(range(len(run.trainset)))
                rng.shuffle(order)
                state, stopped = self._epoch(run, plan, state, epoch, order, steps, trackers, bar)
                if stopped:
                    break
                if valset:  # the epoch's program on the valset: the best so far (the later on a tie) is kept
                    epochs.append(validate(run, state, valset, epoch))
                    for tracker in trackers:
                        tracker.validation(epochs[-1].__dict__, step=state.step - 1)
                    best = (epochs[-1], state) if best is None or epochs[-1].val_score >= best[0].val_score else best
                    stopped = run.record.reached() if state.step < total else None
                    if stopped:
                        break
        except BudgetExhausted as exc:  # the next unit would not fit: the run ends at its last finished step
            stopped = str(exc)
        finally:
            if isinstance(bar, StageBars):
                bar.close()  # a run stopped early ends its bar short
        if stopped:
            logger.warning("Stopping early: %s", stopped)
        learned = Learned(best[1].library, best[1].demos) if best else Learned(state.library, state.demos)
        if best:
            logger.info("Keeping the library of epoch %d: validation score %.3f, the best of %d validated epoch(s) (ties "
                        "go to the later epoch); %d experiences", best[0].epoch, best[0].val_score, len(epochs),
                        len(best[1].library))
        learned, worth = (learned, None) if no_step else self._attribution(run, learned, held_out, stopped)
        compiled = with_learned(run.program, run.targets, *learned)
        usage = run.record.by_role(new=True)
        compiled.detailed_results = TrainingFreeGRPOResult(
            steps=steps, epochs=epochs, best_val_score=best[0].val_score if best else None,
            best_epoch=best[0].epoch if best else None, usage=usage, run_usage=run.record.by_role(),
            reused_units=run.record.served, stopped_early=stopped, worth=worth, refit=refit,
            limits=_limits(steps, usage, stopped, run.record.usage(new=True), run.record.served))
        compiled.provenance = {"policy": plan.models["policy"], "reflection": plan.models["reflection"],
                               "knobs": plan.fingerprint["knobs"], "steps": len(steps),
                               "worth": {item.id: item.worth for item in worth.items} if worth else None,
                               "carried_from": plan.carried or None}
        compiled._compiled = True

        return compiled

    @staticmethod
    def _epoch(run: Run, plan: Plan, state: State, epoch: int, order: list[int], steps: list[StepResult],
               trackers: list, bar: Callable) -> tuple[State, str | None]:
        """The epoch's steps, one batch of `order` after another, each from what the one before it kept (each step's
        record appended to `steps` and told to the trackers and the bar, with the plan's projection logged); why the
        run stops, if it does."""
        knobs, total = run.knobs, run.knobs.total_steps(len(run.trainset))
        for at in range(0, len(order), knobs.batch_size):
            if state.step == total:
                return state, None
            batch = order[at: at + knobs.batch_size]
            fresh = f"step {state.step}" not in run.record.scopes()  # (a resumed step pays less)
            need = len(batch) * knobs.num_generations + 2 * min(knobs.probe_size, len(run.trainset))
            if fresh and (short := run.record.reached(need)):  # a step it cannot finish would learn nothing
                return state, short
            try:
                state, stats = step(run, state, epoch, batch)
            except BudgetExhausted as exc:  # the step cannot finish: the run keeps the last finished one's state
                return state, str(exc)
            steps.append(stats)
            logger.info("%s", plan.projection(steps))
            for tracker in trackers:
                tracker.step(stats)
            if total:
                bar("step", state.step, total)
            if stopped := run.record.reached() or _learned_out(knobs, stats):
                return state, stopped
        return state, None

    @staticmethod
    def _attribution(run: Run, learned: Learned, examples: list | None, stopped: str | None):
        """What each kept item is worth (`attribution`), and what the compiled program keeps (pruned with `prune`)."""
        if not run.knobs.attribution:
            return learned, None
        if stopped and run.record.reached():
            logger.warning("Attribution skipped: %s", stopped)
            return learned, None
        try:
            worth, learned = Attribution(run).measure(run.program, run.targets, learned, examples)
        except BudgetExhausted as exc:
            logger.warning("Attribution stopped: %s; the compiled program keeps every item", exc)
            return learned, None
        log_worth(worth)
        run.store.put(Keys.worth, worth.to_dict())
        return learned, worth


def _refit(run: Run, plan: Plan, state: State, examples: list) -> tuple[WorthResult, Learned]:
    """What each item the student carries is worth on this run's model, measured on `examples` as the attribution
    measures (beside its controls), and the items kept: those worth more than nothing, chosen on half the queries and
    checked on the other (`prune`). Each item's `learned_on` says where the saved program learned it, and its worth
    there where the program recorded one."""
    worth, kept = Attribution(run).measure(run.program, run.targets, Learned(state.library, state.demos), examples,
                                           prune=True, name="refit")
    there = plan.carried.get("worth") or {}
    items = [dataclasses.replace(item, learned_on={"policy": plan.carried.get("policy"), "worth": there.get(item.id)})
             for item in worth.items] if plan.carried else worth.items
    worth = dataclasses.replace(worth, items=items)
    logger.warning("Refit on %s: %d of %d carried item(s) kept%s", ", ".join(plan.models["policy"]),
                   len(kept.items()), len(items), f" ({', '.join(worth.pruned)} left out)" if worth.pruned else "")
    log_worth(worth)
    run.store.put(Keys.refit, worth.to_dict())
    return worth, kept


def validate(run: Run, state: State, valset: list, epoch: int) -> EpochResult:
    """The epoch's validation: the program with the state's library and demos on the valset, `val_score` the mean metric
    over the examples it answered (a run that raised scores 0; one whose LM call failed is left out, counted in
    `val_failures` with the rest). Saved as `epochs/<epoch>`."""
    if (saved := run.store.get(Keys.epoch(epoch))) is not None:
        return EpochResult(epoch=epoch, val_score=saved["val_score"], library_size=len(state.library),
                           val_failures=saved.get("val_failures", 0))
    logger.info("validation: %d call(s) on %d thread(s)", len(valset), run.knobs.num_threads)
    program = with_own_lms(with_learned(run.program, run.targets, state.library, state.demos))
    with Scope(run, f"validation after epoch {epoch}") as scope:
        attempts = scope.scored("validation", [(program, x) for x in valset])
        scope.check("validation")
    answered = [a for a in attempts if not a.failed]
    errors = [a.error or a.metric_failed for a in attempts if a.error or a.metric_failed]
    if errors:
        logger.warning("Epoch %d: the program failed on %d of %d validation examples (first: %s); a failed LM call is "
                       "left out, any other failure scores 0", epoch, len(errors), len(attempts), errors[0])
    value = sum(a.reward for a in answered) / len(answered) if answered else 0.0
    logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(state.library))
    run.store.put(Keys.epoch(epoch), {"val_score": value, "val_failures": len(errors),
                                      "library": state.library.dump_state(),
                                      "demos": [d.to_record() for d in state.demos]})
    return EpochResult(epoch=epoch, val_score=value, library_size=len(state.library), val_failures=len(errors))


def _learned_out(knobs: Knobs, stats: StepResult) -> str | None:
    """Why the run stops with nothing left to learn (`stop_when_nothing_to_learn`) or a probe skipped for its power
    (`probe_min_power`), or None."""
    probe = stats.probe or {}
    if probe.get("skipped"):  # probe_min_power: a probe here could not tell its candidates apart
        return f"more calls cannot pay: {probe['skipped']} in step {stats.step}"
    if not knobs.stop_when_nothing_to_learn:
        return None
    if not stats.groups_kept:
        return f"nothing left to learn: no group had reward contrast in step {stats.step} ({stats.groups} queries)"
    if probe.get("queries") and probe["base_successes"] == len(probe["queries"]):
        return f"nothing left to learn: the program solved all {len(probe['queries'])} probe queries of step " \
               f"{stats.step}"
    return None


def _limits(steps: list[StepResult], usage: dict, stopped: str | None, sent: dict, reused: int) -> dict:
    """What limited the run, logged at WARNING level with what this compile spent (`usage` by role, `sent` by stage;
    `reused`: LM calls answered from log_dir's record): how many attempts solved their own query, the best winning attempt
    written (the demo candidate that solved most of its probe's queries) against the program kept (its solved share on
    the last probe), the calls this compile sent per stage, the learning calls that failed, and why it stopped."""
    attempts = [(s.step, c) for s in steps for c in (s.probe or {}).get("candidates", []) if c["edit"].startswith("demo")]
    best = max(attempts, key=lambda sc: sc[1]["successes"] / max(sc[1]["queries_run"], 1), default=None)
    last = next((s for s in reversed(steps) if s.probe and s.probe.get("queries")), None)
    kept = next((c for c in (last.probe["candidates"] if last else []) if c["kept"] and c["edit"].startswith("demo")),
                None)
    limits = {"attempts_solved": [sum(s.solved for s in steps),
                                  sum(s.metric_calls - (s.probe or {}).get("attempts_run", 0) for s in steps)],
              "best_written": {"step": best[0], "solved": best[1]["successes"], "of": best[1]["queries_run"]}
              if best else None,
              "kept": {"step": last.step, "solved": kept["successes"] if kept else last.probe["base_successes"],
                       "of": len(last.probe["queries"])} if last else None,
              "calls": {stage: used["calls"] for stage, used in sent.items() if used.get("calls")},
              "learning_failures": sum(s.learning_failures for s in steps),
              "retired": [{"step": s.step, **r} for s in steps for r in (s.details or {}).get("retired", [])],
              "stopped": stopped or "ran every step"}
    shares = [x["solved"] / max(x["of"], 1) for x in (limits["best_written"], limits["kept"]) if x]
    limits["verdict"] = ("no winning attempt was probed: the rollouts wrote nothing to keep" if not best else
                         "the run kept the best its rollouts wrote: more or better attempts would be needed to do better"
                         if len(shares) == 2 and shares[1] >= shares[0] else
                         "a better attempt was written than the one kept")
    shown = {k: f"{v['solved']} of {v['of']} probe queries (step {v['step']})" if v else "none"
             for k, v in ((k, limits[k]) for k in ("best_written", "kept"))}
    limits["summary"] = (f"{limits['attempts_solved'][0]} of {limits['attempts_solved'][1]} attempts solved their own "
                         f"query; best winning attempt written {shown['best_written']}, program kept {shown['kept']}: "
                         f"{limits['verdict']}")
    parts = [f"{role} {u['calls']} calls, {u.get('prompt_tokens', 0):,}"
             + (f" ({u['cached_tokens']:,} cached)" if u.get("cached_tokens") else "")
             + f" + {u.get('completion_tokens', 0):,} tokens" + (f", ${u['cost']:.4f}" if "cost" in u else "")
             for role, u in usage.items() if u.get("calls")]
    nothing = "nothing new (every call answered from log_dir's record)" if reused else "nothing (no call was made)"
    failed = f"; {limits['learning_failures']} learning call(s) failed (each step's learning_failures)" \
        if limits["learning_failures"] else ""
    retired = f"; {len(limits['retired'])} experience(s) retired past max_library_tokens (" + ", ".join(
        f"{r['id']} from {r['predictor']} at step {r['step']}" for r in limits["retired"][:5]) + (
        ", ..." if len(limits["retired"]) > 5 else "") + "; each step's details['retired'])" if limits["retired"] else ""
    logger.warning("compile spent: %s; calls by stage %s%s%s; %s", "; ".join(parts) or nothing, limits["calls"], failed,
                   retired, limits["stopped"])
    if best or last:
        logger.warning("what limited the run: %s", limits["summary"])
    return limits


def _params(optimizer: TrainingFreeGRPO, plan: Plan, program) -> dict[str, str]:
    """The knobs as text for trackers, LMs by model name only (never a key or URL), plus what they resolve to."""
    params = {name: str(getattr(optimizer, name)) for name in KNOBS if name not in ("reflection_lm", "progress")}
    params.update(reflection_lm=plan.models["reflection"], learning_path_used=plan.learning_path,
                  policy_lm=", ".join(plan.models["policy"]), student=type(program).__name__)
    return params
