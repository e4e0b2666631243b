"""Training-Free GRPO (arXiv 2510.08191) as a DSPy teleprompter.

GRPO's outer loop is kept: each query of a batch is attempted `num_generations` times, the attempts are
scored, and a group is only informative when its rewards differ. The gradient step is replaced by edits of
an experience library that lives in the program's instructions:

    rollouts -> rewards -> (groups with contrast) -> summaries -> group advantages -> consolidation -> library

or, for small reflection LMs (`learning_path="contrast"`, see `contrast.py`):

    rollouts -> rewards -> (groups with contrast) -> one best-vs-worst call per group -> folded in code -> library

Each group goes through the step at its own pace: its summaries start as soon as its own attempts are scored, while
other groups still roll out (`parallel.run_flows`, `learning_paths.py`); only the consolidation waits for the batch.
Every finished unit of work is checkpointed in `log_dir` (see `checkpoint.py`), so a crashed run resumes without
resending it.
"""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass
from typing import Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.base.util import digest
from tfgrpo.optimizers.checkpoint import Checkpoint, code_fingerprint
from tfgrpo.optimizers.contrast import SMALL_REFLECTOR_B, ContrastPath, model_size_b
from tfgrpo.optimizers.demos import with_learned
from tfgrpo.optimizers.inputs import (check_examples, check_inputs, check_prices, check_program, explain_learning_path,
                                      starting_library)
from tfgrpo.optimizers.knobs import KNOBS, Knobs, args_doc, fingerprinted_knobs
from tfgrpo.optimizers.learning_paths import LearningPath, PaperPath
from tfgrpo.optimizers.parallel import StageBar, TooManyFailuresError, run_parallel
from tfgrpo.optimizers.result import EpochResult, TrainingFreeGRPOResult
from tfgrpo.optimizers.rewards import MetricTimeout, call_metric, metric_takes_trace
from tfgrpo.optimizers.rollout import run_program, with_own_lms
from tfgrpo.optimizers.step import Step
from tfgrpo.optimizers.usage import add_usage, history_kept, over_budget
from tfgrpo.programs.inject import resolve_targets
from tfgrpo.programs.library import ExperienceLibrary

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TrainingFreeGRPO(Teleprompter, Knobs):
    """Learns a library of natural-language experiences for a DSPy program, and writes it into the
    instructions of its predictors; the weights and the program's own instructions are left alone.

    `compile(student, trainset=..., valset=None)` returns a copy of the student with the library in place
    (`compiled.experience_library`) and the run's record in `compiled.detailed_results`: per step the mean
    reward, groups kept, failures, operations, library size and LM usage by stage; per epoch the validation
    score and failures; with a valset, `best_epoch`, the epoch whose library the compiled program carries; `usage`,
    the calls this call made, and `run_usage`, those of the whole run (steps reused from `log_dir` included).
    A student that carries an `experience_library` (or, loaded with stock DSPy, only its rendering in the
    instructions) goes on learning from it. Every finished unit of work is saved in `log_dir`; the same call
    resumes an interrupted run.

    Every knob is a keyword argument, declared once (type, default, check, doc) in `optimizers/knobs.py`, from
    which the Args after `metric` are filled in at import and the knob table of docs/usage.md is written.

    Args:
        metric: `metric(example, prediction, trace=None)` (or `metric(example, prediction)`, as dspy.Evaluate
            calls it) returns a reward in [0, 1] (a bool counts as 0 or 1), or a
            `dspy.Prediction(score=..., feedback=...)` whose feedback the learning calls read. A metric that
            raises, leaves [0, 1] or returns anything else (such as the string "1") stops the run with a
            `MetricError`.
    """

    metric: Callable  # the knobs follow, keyword-only (Knobs)

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

    # -- the outer loop -------------------------------------------------------------------------------------
    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset: list | None = None) -> dspy.Module:
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
        check_program(student)
        ckpt = Checkpoint(self.log_dir)
        knobs = {name: getattr(self, name) for name in KNOBS}
        info = hooks.CompileInfo(knobs=knobs, params=lambda: self._params(student))
        with ckpt.locked(), hooks.tracked(info) as trackers:  # one compile per log_dir; trackers such as MLflow's
            compiled = self._compile(student, trainset=trainset, valset=valset, trackers=trackers, ckpt=ckpt)
            for tracker in trackers:
                tracker.finish(compiled)
        return compiled

    def _compile(self, student, *, trainset, valset, trackers, ckpt) -> dspy.Module:
        check_examples("trainset", trainset)
        if not trainset:
            raise ValueError("trainset is empty")
        if valset is not None:
            check_examples("valset", valset)
        program = student.deepcopy()
        targets = resolve_targets(program, self.target_predictors)
        for name, examples in (("trainset", trainset), ("valset", valset or [])):
            check_inputs(name, examples, student)  # before any call: a missing input would only score 0
        policy_lms = self._policy_lms(program)  # fail early, with a clear message, when no LM is configured
        reflection_lm = self._reflection_lm(program)
        if self.max_cost is not None:
            if not history_kept():
                raise ValueError("max_cost needs DSPy's LM history, the only place where the price of a call is kept, "
                                 "and it is off (dspy.configure(disable_history=True) or max_history_size=0): turn it "
                                 "back on, or budget with max_total_tokens, which is measured either way")
            check_prices([*policy_lms.values()], reflection_lm)
        explain_learning_path(self.learning_path, self.resolve_learning_path(str(getattr(reflection_lm, "model", ""))),
                              reflection_lm)
        library = starting_library(student, program, targets, max_words=self.max_words_per_experience,
                                   max_experiences=self.max_experiences)
        path, path_name = self.resolve_path(reflection_lm)  # every check before start: a refusal writes no run.json
        ckpt.start(self._fingerprint(program, targets, trainset, valset, library, policy_lms, reflection_lm))
        if kept := ckpt.saved_units():
            logger.info("resuming from %s: %d finished units kept", ckpt.root, kept)

        rng, step, steps, epochs, demos = random.Random(self.seed), 0, [], [], []
        total_steps = self.total_steps(len(trainset))
        overall = self.progress or StageBar(resumed=True)  # the whole run: steps done of all, with its ETA
        if total_steps:
            overall("step", sum(ckpt.has(f"steps/{i:04d}/done") for i in range(total_steps)), total_steps)
        best: tuple[float, dict, list, int] | None = None
        run_totals, stopped, metric_calls = {"policy": {}, "reflection": {}}, None, 0
        totals = {"policy": {}, "reflection": {}}  # calls made by this call, not those of steps reused from log_dir
        for epoch in range(self.num_train_epochs):
            if step == total_steps:  # max_steps reached with the last epoch
                break
            order = list(range(len(trainset)))
            rng.shuffle(order)
            for at in range(0, len(order), self.batch_size):
                if stopped or step == total_steps:
                    break
                batch = order[at: at + self.batch_size]
                reused = ckpt.has(f"steps/{step:04d}/done")
                library, demos, stats = Step(self, path=path, path_name=path_name, program=program, targets=targets,
                                             library=library, demos=demos, trainset=trainset, batch=batch, index=step,
                                             epoch=epoch, reflection_lm=reflection_lm, ckpt=ckpt).run()
                steps.append(stats)
                for tracker in trackers:
                    tracker.step(stats)
                step += 1
                if total_steps:
                    overall("step", step, total_steps)
                for stage, usage in stats.usage.items():
                    role = "policy" if stage in ("rollout", "probe") else "reflection"
                    add_usage(run_totals[role], usage)
                    if not reused:  # nor what a stopped run had spent in this step
                        before = stats.usage_before_resume.get(stage, {})
                        add_usage(totals[role], {k: v - before.get(k, 0) for k, v in usage.items()})
                metric_calls += stats.metric_calls
                stopped = self._over_budget(run_totals, metric_calls)
            if stopped:
                logger.warning("Stopping early: %s", stopped)
                break
            if valset:
                record = self._validate(program, targets, library, demos, valset, epoch, ckpt)
                metric_calls += len(valset)
                if step < total_steps:  # steps remain: a budget reached here stops them
                    stopped = self._over_budget(run_totals, metric_calls)
                epochs.append(EpochResult(epoch=epoch, library_size=len(library), **record))
                for tracker in trackers:
                    tracker.validation(epochs[-1].__dict__, step=step - 1)
                if best is None or record["val_score"] >= best[0]:  # ties go to the later library
                    best = (record["val_score"], library.dump_state(), demos, epoch)

        if isinstance(overall, StageBar):
            overall.close()  # a run stopped early ends its bar short
        if best:
            logger.info("Keeping the library of epoch %d: validation score %.3f, the best of %d validated epoch(s) "
                        "(ties go to the later epoch); %d experiences", best[3], best[0], len(epochs),
                        len(best[1]["experiences"]))
        final, final_demos = (ExperienceLibrary.from_state(best[1]), best[2]) if best else (library, demos)
        compiled = with_learned(student, targets, final, final_demos)
        compiled.detailed_results = TrainingFreeGRPOResult(
            steps=steps, epochs=epochs, best_val_score=best[0] if best else None, best_epoch=best[3] if best else None,
            usage=totals, run_usage=run_totals, reused_units=ckpt.reused, stopped_early=stopped)
        compiled._compiled = True
        return compiled

    # -- pieces ---------------------------------------------------------------------------------------------
    def resolve_learning_path(self, reflection_model: str) -> str:
        """The name of the learning path for a reflection LM of this name ("auto": contrast for small models)."""
        if isinstance(self.learning_path, LearningPath):
            return type(self.learning_path).__name__
        if self.learning_path != "auto":
            return self.learning_path
        return "contrast" if model_size_b(reflection_model) <= SMALL_REFLECTOR_B else "paper"

    def resolve_path(self, reflection_lm: dspy.BaseLM) -> tuple[LearningPath, str]:
        """The learning path object and its name; a contrast path with G = 1 is refused (it compares attempts)."""
        name = self.resolve_learning_path(getattr(reflection_lm, "model", ""))
        if isinstance(self.learning_path, LearningPath):
            return self.learning_path, name
        if name == "contrast" and self.num_generations == 1:
            raise ValueError("the contrast learning path compares attempts of one query and learns nothing from "
                             "num_generations=1: use learning_path='paper' (the paper's G = 1 ablation) or G >= 2")
        return (ContrastPath() if name == "contrast" else PaperPath()), name

    def _over_budget(self, run_totals: dict, metric_calls: int) -> str | None:
        return over_budget(run_totals, max_total_tokens=self.max_total_tokens, max_cost=self.max_cost,
                           metric_calls=metric_calls, max_metric_calls=self.max_metric_calls)

    def _parallel(self, fn, items, stage):
        if items:
            logger.info("%s: %d call(s) on %d thread(s)", stage, len(items), self.num_threads)
        return run_parallel(fn, items, num_threads=self.num_threads, stage=stage, progress=self.progress)

    def _policy_lms(self, program) -> dict[int, dspy.BaseLM]:
        lms = {}
        for name, predictor in program.named_predictors():
            lm = predictor.lm or dspy.settings.lm
            if lm is None:
                raise ValueError(f"predictor {name!r} has no LM: call dspy.configure(lm=dspy.LM(...)) or set one on it")
            lms[id(lm)] = lm
        return lms

    def _reflection_lm(self, program) -> dspy.BaseLM:
        return self.reflection_lm or dspy.settings.lm or next(iter(self._policy_lms(program).values()))

    def _params(self, program) -> dict[str, str]:
        """The knobs as text for trackers, LMs by model name only (never a key or URL), plus what they resolve to
        for `program`."""
        params = {name: str(getattr(self, name)) for name in KNOBS if name not in ("reflection_lm", "progress")}
        reflection = _lm_name(self._reflection_lm(program))
        params.update(reflection_lm=reflection, learning_path_used=self.resolve_learning_path(reflection),
                      policy_lm=", ".join(sorted({_lm_name(lm) for lm in self._policy_lms(program).values()})),
                      student=type(program).__name__)
        return params

    def _validate(self, program, targets, library, demos, valset, epoch, ckpt) -> dict:
        """The epoch's validation record: `val_score` (mean metric; a run of the program that raised, or whose metric
        call timed out, scores 0) and `val_failures`. More failures than `max_failure_rate` allows stop the run with
        `TooManyFailuresError`: an outage must not pass for a bad library."""
        if (saved := ckpt.get(f"epochs/{epoch}")) is not None:
            return {"val_score": saved["val_score"], "val_failures": saved.get("val_failures", 0)}
        cand, _ = with_own_lms(with_learned(program, targets, library, demos))

        def score(example):
            prediction, rec = run_program(cand, example)
            if rec["error"]:
                return 0.0, rec["error"]
            try:
                return call_metric(self.metric, example, prediction, self.metric_timeout_s)[0], None
            except MetricTimeout as exc:  # a failure of this example, not of the run
                return 0.0, str(exc)

        results = self._parallel(score, list(valset), "validation")
        errors = [error for _, error in results if error]
        if len(errors) > self.max_failure_rate * len(results):
            raise TooManyFailuresError(f"validation after epoch {epoch}: the program failed on {len(errors)} of "
                                       f"{len(results)} examples (first: {errors[0]}); finished work is kept in "
                                       f"log_dir={self.log_dir!r}")
        if errors:
            logger.warning("Epoch %d: the program failed on %d of %d validation examples, scored 0 (first: %s)",
                           epoch, len(errors), len(results), errors[0])
        value = statistics.fmean(s for s, _ in results)
        logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(library))
        ckpt.put(f"epochs/{epoch}", {"val_score": value, "val_failures": len(errors), "library": library.dump_state(),
                                     "demos": demos})
        return {"val_score": value, "val_failures": len(errors)}

    def _fingerprint(self, program, targets, trainset, valset, library, policy_lms, reflection_lm) -> dict:
        models = {"policy": sorted({str(getattr(lm, "model", type(lm).__name__)) for lm in policy_lms.values()}),
                  "reflection": str(getattr(reflection_lm, "model", type(reflection_lm).__name__))}
        knobs = fingerprinted_knobs(self)
        if isinstance(knobs["learning_path"], LearningPath):  # a plug-in path is known by its class
            knobs["learning_path"] = f"{type(knobs['learning_path']).__module__}.{type(knobs['learning_path']).__qualname__}"
        return {"knobs": knobs, "targets": targets, "models": models,
                "instructions": digest([p.signature.instructions for _, p in program.named_predictors()]),
                "trainset": digest([dict(x) for x in trainset]), "valset": digest([dict(x) for x in valset or []]),
                "initial_library": digest(library.dump_state()), **code_fingerprint(self.metric, program)}


def _lm_name(lm) -> str:
    return str(getattr(lm, "model", None) or type(lm).__name__)


TrainingFreeGRPO.__doc__ = TrainingFreeGRPO.__doc__.rstrip() + "\n" + args_doc()  # the knobs' Args, from knobs.py
