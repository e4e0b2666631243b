"""Training-Free GRPO (arXiv 2510.08191) as a DSPy teleprompter.

GRPO's outer loop is kept: each query of a batch is attempted `num_generations` times, the attempts are scored, and a
group is only informative when its rewards differ. The gradient step is replaced by edits of an experience library that
lives in the program's instructions. `compile` reads as four stages:

    plan    = self.plan(student, trainset, valset)   # every check, the preset and path, the estimate (plan.py)
    run     = Run(...); state = State(library)        # fixed for the run / what a step changes (step.py)
    state   = step(run, state, epoch, batch)          # per batch of every epoch; validated after each epoch
    program = the student's copy with the kept state  # the best validated epoch's, else the last

Every unit of work goes through the run's `Executor` (execution.py), which checkpoints it in `log_dir`, charges the
budget before it starts and meters it, so a crashed or stopped run resumes without resending anything it finished.
"""

from __future__ import annotations

import inspect
import logging
import random
from dataclasses import dataclass
from typing import Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.optimizers.checkpoint import Checkpoint, Keys
from tfgrpo.optimizers.execution import BudgetExhausted, Executor, with_own_lms
from tfgrpo.optimizers.knobs import KNOBS, Knobs, args_doc
from tfgrpo.optimizers.learning_paths import ContrastPath, PaperPath
from tfgrpo.optimizers.parallel import ROLE, StageBars, add_usage
from tfgrpo.optimizers.plan import Plan, make_plan
from tfgrpo.optimizers.result import EpochResult, StepResult, TrainingFreeGRPOResult
from tfgrpo.optimizers.rewards import metric_takes_trace
from tfgrpo.optimizers.step import Run, State, step
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
    with stock DSPy, only its rendering in the instructions) goes on learning from it. Every finished unit of work is
    saved in `log_dir`; the same call resumes an interrupted run.

    Every knob is a keyword argument, declared once (type, default, check, doc) in `optimizers/knobs.py`, from which
    the Args after `metric` are filled in and the knob table of docs/usage.md is written.

    Args:
        metric: `metric(example, prediction, trace=None)` (or `metric(example, prediction)`, as dspy.Evaluate
            calls it) returns a reward in [0, 1] (a bool counts as 0 or 1), or a
            `dspy.Prediction(score=..., feedback=...)` whose feedback the learning calls read. A metric that
            raises, leaves [0, 1] or returns anything else (such as the string "1") stops the run with a
            `MetricError`.
"""


@dataclass(eq=False)
class TrainingFreeGRPO(Teleprompter, Knobs):
    __doc__ = DOC + args_doc()  # the knobs' Args, from knobs.py
    __signature__ = inspect.Signature([inspect.Parameter("metric", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for name, f in KNOBS.items()
    ])  # (metric, *, <every knob>), as the dataclass __init__ declares it: what inspect shows, beside __new__

    metric: Callable  # the knobs follow, keyword-only (Knobs)

    def __new__(cls, *args, **knobs):
        self = super().__new__(cls)
        self._explicit = frozenset(knobs) & set(KNOBS)  # the knobs passed explicitly win over the `auto` preset
        return self

    def __post_init__(self):
        if not callable(self.metric):
            raise TypeError("metric must be callable: metric(example, prediction, trace=None) -> float | dspy.Prediction")
        metric_takes_trace(self.metric)  # a TypeError now for a metric that takes neither (example, pred) nor a trace
        super().__post_init__()  # every knob is checked (knobs.py)
        if self.probe_size and not self.use_ground_truth:
            raise ValueError("probe_size needs use_ground_truth=True: a probe scores single attempts, which have no "
                             "group to take a majority answer from")
        if self.use_mlflow and "mlflow" not in hooks.installed():
            raise RuntimeError("use_mlflow=True, but no MLflow tracker is registered: tfgrpo's entry point "
                               f"{hooks.GROUP}:mlflow comes with its install (pip install -e . in a clone)")
        hooks.built(self)  # trackers learn of it (tfgrpo.base.hooks)

    def explicit_knobs(self) -> set[str]:
        """The knobs passed to the constructor (they win over the `auto` preset)."""
        return set(self._explicit)

    def plan(self, student: dspy.Module, trainset: list, valset: list | None = None, *,
             attribution_set: list | None = None, reply_tokens: int | None = None) -> Plan:
        """What `compile` with these arguments will do, with no LM call and nothing written: every check compile makes
        (a refusal raises the same error), the preset and learning path chosen, the budget, and the expected calls,
        tokens and dollars (`Plan`; `reply_tokens`: your guess of a reply's length). `print(plan.summary())`."""
        return make_plan(self, student, (trainset, valset, attribution_set), reply_tokens=reply_tokens)

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
            MetricError: The metric raised, or returned something other than a score in [0, 1].
            TooManyFailuresError: More than `max_failure_rate` of a step's units (or of a validation) failed.
        """
        if teacher is not None:
            raise ValueError("TrainingFreeGRPO learns from the student's own attempts and takes no teacher; to have "
                             "a stronger model make the learning calls, pass reflection_lm=")
        ckpt = Checkpoint(self.log_dir)
        with ckpt.locked():  # one compile per log_dir: a second one is refused at once
            plan = make_plan(self, student, (trainset, valset, attribution_set), say=True)
            return self._tracked(plan, student, (trainset, valset, attribution_set), ckpt)

    def _tracked(self, plan: Plan, student: dspy.Module, data: tuple, ckpt: Checkpoint) -> dspy.Module:
        """The compile of `plan`, told to the trackers (MLflow's), from its log_dir's start to the compiled program."""
        (trainset, valset, attribution_set), params = data, lambda: _params(self, plan, student)
        info = hooks.CompileInfo(knobs={name: getattr(self, name) for name in KNOBS}, params=params)
        with hooks.tracked(info) as trackers:
            saved = ckpt.start(plan.fingerprint)
            logger.warning("%s", plan.summary())
            knobs, program = plan.knobs, student.deepcopy()
            path = knobs.learning_path if not isinstance(knobs.learning_path, str) else \
                ContrastPath() if plan.learning_path == "contrast" else PaperPath()
            run = Run(knobs=knobs, metric=self.metric, path=path, path_name=plan.learning_path,
                      reflection_lm=self.reflection_lm or dspy.settings.lm or next(
                          p.lm for _, p in program.named_predictors() if p.lm is not None),
                      executor=Executor(knobs, self.metric, ckpt), program=program,
                      targets=plan.targets, trainset=trainset,
                      instructions=" ".join(p.signature.instructions for _, p in program.named_predictors()))
            if saved:  # what the fingerprint cannot see: the saved work is checked against today's metric and program
                logger.info("resuming from %s: %d finished units found", ckpt.root, saved)
                run.executor.recheck(program, trainset)
            compiled = self._learn(run, plan, (valset, attribution_set if attribution_set is not None else valset),
                                   (student, trackers))
            for tracker in trackers:
                tracker.finish(compiled)
        return compiled

    def _learn(self, run: Run, plan: Plan, held_out: tuple, student_and_trackers: tuple) -> dspy.Module:
        """The epochs' steps and validations, then the attribution; the compiled copy of the student."""
        (valset, attribution_set), (student, trackers) = held_out, student_and_trackers
        knobs, state, total = run.knobs, State(library=plan.library), plan.steps
        steps, epochs, best, stopped = [], [], None, None
        bar = knobs.progress or StageBars(resumed=True)  # the whole run: steps done of all, with its ETA
        if total:
            bar("step", sum(run.executor.ckpt.get(Keys.done(i), unit=False) is not None for i in range(total)), total)
        rng = random.Random(knobs.seed)
        try:
            for epoch in range(knobs.num_train_epochs):
                if state.step == total:  # max_steps reached with the last epoch
                    break
                order = list(range(len(run.trainset)))
                rng.shuffle(order)
                state, stopped = self._epoch(run, state, (epoch, order), (steps, trackers, bar))
                if stopped:
                    break
                if valset:  # the epoch's program on the valset: the best so far (the later on a tie) is kept
                    epochs.append(validate(run, state, valset, epoch))
                    for tracker in trackers:
                        tracker.validation(epochs[-1].__dict__, step=state.step - 1)
                    best = (epochs[-1], state) if best is None or epochs[-1].val_score >= best[0].val_score else best
                    stopped = run.executor.budget.reached() if state.step < total else None
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
        learned, worth = self._attribution(run, student, learned, attribution_set, stopped)
        run_usage = {"policy": {}, "reflection": {}}  # the whole run's, the steps reused from log_dir included
        for stage, used in ((stage, used) for stats in steps for stage, used in stats.usage.items()):
            add_usage(run_usage[ROLE.get(stage, "reflection")], used)
        compiled = with_learned(student, run.targets, *learned)
        compiled.detailed_results = TrainingFreeGRPOResult(
            steps=steps, epochs=epochs, best_val_score=best[0].val_score if best else None,
            best_epoch=best[0].epoch if best else None, usage=run.executor.spent, run_usage=run_usage,
            reused_units=run.executor.ckpt.reused, stopped_early=stopped, worth=worth,
            limits=_limits(steps, run.executor.spent, stopped))
        compiled._compiled = True

        return compiled

    @staticmethod
    def _epoch(run: Run, state: State, when: tuple, record: tuple) -> tuple[State, str | None]:
        """The epoch's steps, one batch after another, each from what the one before it kept; why the run stops, if it
        does."""
        (epoch, order), (steps, trackers, bar), knobs = when, record, run.knobs
        used, total = set(), knobs.total_steps(len(run.trainset))  # used: the queries this epoch has rolled out
        for at in range(0, len(order), knobs.batch_size):
            if state.step == total:
                return state, None
            ranked, size = _ranked(knobs, order, at, state.evidence, used), len(order[at: at + knobs.batch_size])
            fresh = not run.executor.ckpt.get(Keys.usage(state.step), unit=False)  # (a resumed step pays less)
            need = size * knobs.num_generations + 2 * min(knobs.probe_size, len(run.trainset))
            if fresh and (short := run.executor.budget.reached(need)):  # a step it cannot finish would learn nothing
                return state, short
            state, stats = step(run, state, epoch, ranked[:size], ranked[size:])
            used.update(stats.queries or ranked[:size])
            steps.append(stats)
            for tracker in trackers:
                tracker.step(stats)
            if total:
                bar("step", state.step, total)
            if stopped := run.executor.budget.reached() or _learned_out(knobs, stats):
                return state, stopped
        return state, None

    @staticmethod
    def _attribution(run: Run, student, learned: Learned, examples: list | None, stopped: str | None):
        """What each kept item is worth (`attribution`), and what the compiled program keeps (pruned with `prune`)."""
        if not run.knobs.attribution:
            return learned, None
        if stopped and run.executor.budget.reached():
            logger.warning("Attribution skipped: %s", stopped)
            return learned, None
        try:
            worth, learned = Attribution(run.executor).run(student, run.targets, learned, examples)
        except BudgetExhausted as exc:
            logger.warning("Attribution stopped: %s; the compiled program keeps every item", exc)
            return learned, None
        log_worth(worth)
        run.executor.ckpt.put("worth", worth.to_dict())
        return learned, worth


def validate(run: Run, state: State, valset: list, epoch: int) -> EpochResult:
    """The epoch's validation: the program with the state's library and demos on the valset, `val_score` the mean metric
    over the examples it answered (a run that raised scores 0; one whose LM call failed is left out, counted in
    `val_failures` with the rest). Saved as `epochs/<epoch>`."""
    if (saved := run.executor.ckpt.get(Keys.epoch(epoch))) is not None:
        return EpochResult(epoch=epoch, val_score=saved["val_score"], library_size=len(state.library),
                           val_failures=saved.get("val_failures", 0))
    logger.info("validation: %d call(s) on %d thread(s)", len(valset), run.knobs.num_threads)
    program = with_own_lms(with_learned(run.program, run.targets, state.library, state.demos))[0]
    with run.executor.scope(f"validation after epoch {epoch}") as ex:
        records = ex.scored("validation", [(None, program, x) for x in valset])
        ex.check("validation")
    answered = [r for r in records if not r.get("failed")]
    errors = [r["error"] or r.get("timeout") for r in records if r["error"] or r.get("timeout")]
    if errors:
        logger.warning("Epoch %d: the program failed on %d of %d validation examples (first: %s); a failed LM call is "
                       "left out, any other failure scores 0", epoch, len(errors), len(records), errors[0])
    value = sum(r["reward"] for r in answered) / len(answered) if answered else 0.0
    logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(state.library))
    run.executor.ckpt.put(Keys.epoch(epoch), {"val_score": value, "val_failures": len(errors),
                                     "library": state.library.dump_state(), "demos": state.demos})
    return EpochResult(epoch=epoch, val_score=value, library_size=len(state.library), val_failures=len(errors))


def _ranked(knobs: Knobs, order: list[int], at: int, evidence: dict[int, bool], used: set[int]) -> list[int]:
    """The training queries in the order a step takes them: its batch first, then (dynamic sampling) the ones it may
    add. In the epoch's shuffled order from `at` on; with `focus_on_failures`, the queries the current program is
    known to fail first, then those never tried, then those it solves, each the ones not yet used this epoch first."""
    ranked = order[at:] + order[:at]
    if knobs.focus_on_failures:
        known = {False: 0, None: 1, True: 2}  # failed, never tried, solved
        ranked.sort(key=lambda qi: (known[evidence.get(qi)], qi in used))  # a stable sort: the order within is kept
    return ranked[: knobs.batch_size + knobs.max_resampled_queries]


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


def _limits(steps: list[StepResult], usage: dict, stopped: str | None) -> dict:
    """What limited the run, logged at WARNING level with what it spent: how many attempts solved their own query,
    the best winning attempt written (the demo candidate that solved most of its probe's queries) against the program
    kept (its solved share on the last probe), the calls per stage, and why it stopped."""
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
              "calls": {stage: sum(s.usage.get(stage, {}).get("calls", 0) for s in steps)
                        for stage in dict.fromkeys(st for s in steps for st in s.usage)},
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
    logger.warning("compile spent: %s; calls by stage %s; %s", "; ".join(parts) or "nothing new (every unit reused)",
                   limits["calls"], limits["stopped"])
    if best or last:
        logger.warning("what limited the run: %s", limits["summary"])
    return limits


def _params(optimizer: TrainingFreeGRPO, plan: Plan, program) -> dict[str, str]:
    """The knobs as text for trackers, LMs by model name only (never a key or URL), plus what they resolve to."""
    params = {name: str(getattr(optimizer, name)) for name in KNOBS if name not in ("reflection_lm", "progress")}
    params.update(reflection_lm=plan.models["reflection"], learning_path_used=plan.learning_path,
                  policy_lm=", ".join(plan.models["policy"]), student=type(program).__name__)
    return params
