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
from typing import Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.base.util import digest
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.optimizers.contrast import SMALL_REFLECTOR_B, ContrastPath, model_size_b
from tfgrpo.optimizers.demos import with_learned
from tfgrpo.optimizers.inputs import (check_examples, check_inputs, check_prices, check_program, explain_learning_path,
                                      starting_library)
from tfgrpo.optimizers.knobs import KNOBS, check_knob, fingerprinted_knobs
from tfgrpo.optimizers.learning_paths import LearningPath, PaperPath
from tfgrpo.optimizers.parallel import StageBar, TooManyFailuresError, run_parallel
from tfgrpo.optimizers.result import EpochResult, TrainingFreeGRPOResult
from tfgrpo.optimizers.rewards import MetricTimeout, call_metric, metric_takes_trace
from tfgrpo.optimizers.rollout import run_program, with_own_lms
from tfgrpo.optimizers.step import run_step
from tfgrpo.optimizers.usage import add_usage, history_kept, over_budget
from tfgrpo.programs.inject import resolve_targets
from tfgrpo.programs.library import ExperienceLibrary

logger = logging.getLogger(__name__)

class TrainingFreeGRPO(Teleprompter):
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

    Args:
        metric: `metric(example, prediction, trace=None)` (or `metric(example, prediction)`, as dspy.Evaluate
            calls it) returns a reward in [0, 1] (a bool counts as 0 or 1), or a
            `dspy.Prediction(score=..., feedback=...)` whose feedback the learning calls read. A metric that
            raises, leaves [0, 1] or returns anything else (such as the string "1") stops the run with a
            `MetricError`.
        num_generations: Attempts per query (G). A group is only learned from when its rewards differ; 1
            turns the group comparison off (the paper's ablation). Default 5.
        temperature: Sampling temperature of the attempts while learning, in [0, 2]. Default 0.7.
        num_train_epochs: Passes over the trainset. Default 3.
        batch_size: Queries per optimization step. Default 50.
        max_steps: Stop after this many steps, part way through an epoch if need be (TRL's `max_steps`); the
            epoch it stops in is still validated. Default None: every batch of every epoch.
        seed: Seeds the order of the trainset and the attempts' rollout IDs. Default 0.
        reflection_lm: LM of the learning calls (summaries, group advantages, consolidation). Default None:
            `dspy.settings.lm`, else the student's LM. A stronger model than the student learns better.
        max_operations_per_group: Most library edits one group may propose. Default 2.
        use_ground_truth: False scores each attempt against the majority answer of its group and shows the
            learning calls no answer key. Default True.
        learning_path: "paper" (summaries, group advantages, one consolidation call), "contrast" (one short
            call per best-vs-worst pair of a group, typed from the live library, folded in code; made for small
            reflection LMs) or "auto": contrast when the reflection model's name gives at most 8B parameters,
            the paper's path when it gives more or no size at all (the choice is logged). Set it yourself when the
            name does not tell: "paper" for a capable API model, "contrast" for a small local one. Default "auto".
        constrained_decoding: For the contrast path: "json_object" (llama.cpp servers' JSON-schema form),
            "json_schema" (OpenAI, vLLM, SGLang, Ollama), "off" (parse and validate only) or "auto" (json_schema
            where LiteLLM says the model supports it, else off). Default "auto".
        max_experiences: Cap on the library's size; None for no cap. Default None.
        max_words_per_experience: Experiences longer than this are refused (at least 4). Default 32.
        target_predictors: Names of the predictors that get the library; None for all. Default None.
        max_demos: Winning attempts kept as few-shot demos of the target predictors: after each step, a
            query's best attempt that fully succeeded (reward >= 1) while its groupmates did worse, ranked by
            group advantage, one per query (see optimizers/demos.py). An extension of the paper for small
            policy models, which copy a working example far better than they follow advice. Default 0 (off).
        max_excerpt_lines: Contrast path: a rule the reflection LM adds carries up to this many lines copied from
            the better attempt (code, a formula, a tool-call pattern), picked by the LM and checked in code to be
            copied, not invented (programs/excerpt.py). An extension for small reflection LMs, which select code
            far better than they describe it. Default 0 (off).
        excerpt_whole_attempt: With max_excerpt_lines, the excerpt is the better attempt's own code (its largest
            fenced block, the query's own values masked as `<?>`) when it fits, as Dynamic Cheatsheet keeps a
            whole working solver; the reflection LM picks lines only from a longer attempt. Default False.
        probe_size: Each step's candidate edits (library operations, demos) are tried on this many training
            queries outside the step's batch, one attempt each, against the current program on the same queries,
            ranked by full successes first and mean reward second: an operation is kept only if it ranks no lower;
            a demo, or an experience carrying an excerpt, only if it adds full successes; of the winning demos the
            best one's set is kept, and of the winning experiences with an excerpt the best one
            (optimizers/probe.py). Needs use_ground_truth. Default 0 (off: every valid
            operation is applied, as in the paper).
        keep_tied_demos: With probe_size, a demo that solves as many probe queries as the current program (no more)
            is kept too, provided the program already solves at least one: on a task the model half solves, a
            probe of a few queries is at its ceiling and a demo can rarely add a success there. A tie at zero
            stays refused (on the Game of 24, narrow demos that tied at zero taught nothing). Default False.
        max_probed_edits: Most candidate edits probed per step (half of them demos, when max_demos > 0); edits
            beyond it are dropped. Default 3.
        num_threads: Concurrent LM calls of a step (all stages share them). Default 8.
        max_failure_rate: When more than this share of a step's attempts, summaries or group advantages, or of
            an epoch's validation runs, fail, the run stops with `TooManyFailuresError` and the step is not done;
            a resume redoes the failed units. Default 0.5.
        metric_timeout_s: Seconds one metric call may take: a call still running then (a judge LM that hangs, a
            sandbox that never returns) is abandoned and scores 0, counted as a failure: said in a warning, under
            `details["metric_timeouts"]` of the step, in `val_failures` of a validation; more than
            `max_failure_rate` of a step's attempts timing out stops the run, as an outage does. None waits for
            ever. Ctrl-C stops a run at once either way. Default None.
        max_cost: USD: stop after the step that reaches it, keeping the library so far. Refused when DSPy knows
            no price for the policy or reflection model (LiteLLM's price map has no entry: the cost would stay $0),
            and under `disable_history=True` (the price is only kept in DSPy's LM history). Default None.
        max_total_tokens: Prompt plus completion tokens of all calls: stop after the step that reaches it.
            Default None.
        log_dir: Folder where every finished unit of work is saved and resumed from; None keeps nothing. A
            resume must use the same fingerprinted knobs, data, program, target predictors and LM models (the
            refusal names what differs); num_threads, max_failure_rate, the budgets and progress may change. One
            compile at a time: the folder is locked while a compile runs, and a second one is refused with a
            `RunLockedError` naming the holder (a lock of a process that died is taken over). Default None.
        progress: `progress(stage, done, total)`, called as units finish, for UIs; stage "step" is the whole
            run (steps done of all, the steps a resume reuses counted in its first call), the others restart with
            each step. Default None: a tqdm bar for the run and one per stage of each step on stderr, as DSPy's own
            optimizers draw, when stderr is a terminal (pass `lambda *_: None` for silence).
        use_mlflow: Log the compile to MLflow (`tfgrpo.tracking`): per step metrics, validation scores, knobs,
            the library and program; into the active MLflow run, else one it starts (or resumes from log_dir).
            It logs into an active run (e.g. `mlflow.dspy.autolog(log_compiles=True)`'s) even when off.
            Default False.
    """

    def __init__(
        self,
        metric: Callable,
        *,
        # group rollouts
        num_generations: int = 5,  # G: attempts per query; 1 disables the group comparison (an ablation)
        temperature: float = 0.7,  # sampling temperature of the attempts while learning
        # schedule
        num_train_epochs: int = 3,  # passes over the trainset
        batch_size: int = 50,  # queries per optimization step
        max_steps: int | None = None,  # stop after this many steps; None: every batch of every epoch
        seed: int = 0,  # shuffling of the trainset and the attempts' rollout IDs
        # learning calls
        reflection_lm: dspy.BaseLM | None = None,  # LM of the learning calls; None: the student's LM
        max_operations_per_group: int = 2,  # cap on the edits one group may propose
        use_ground_truth: bool = True,  # False: majority vote of the group is the pseudo-label, no answer key shown
        learning_path: str = "auto",  # "paper" | "contrast" (pairwise, for small reflectors) | "auto": by model size
        constrained_decoding: str = "auto",  # contrast path: "json_object" (llama.cpp) | "json_schema" | "off" | "auto"
        # the library
        max_experiences: int | None = None,  # cap on the library's size; None: no cap
        max_words_per_experience: int = 32,  # longer experiences are refused
        target_predictors: list[str] | None = None,  # predictor names that get the library; None: all
        max_demos: int = 0,  # keep this many winning attempts as few-shot demos (an extension; 0: the paper's method)
        max_excerpt_lines: int = 0,  # contrast path: rules carry this many lines copied from the better attempt
        excerpt_whole_attempt: bool = False,  # an excerpt is the better attempt's code itself when it fits
        probe_size: int = 0,  # try each edit on this many other training queries before keeping it (0: off)
        keep_tied_demos: bool = False,  # probe: keep a demo that ties a program already solving some probe queries
        max_probed_edits: int = 3,  # most candidate edits probed per step
        # execution
        num_threads: int = 8,  # concurrent LM calls of a step (rollouts and learning calls share them)
        max_failure_rate: float = 0.5,  # stop when more of a stage's units than this fail (the checkpoint stays)
        metric_timeout_s: float | None = None,  # a metric call still running after this many seconds scores 0, counted
        max_cost: float | None = None,  # USD (where litellm knows the price): stop after the step that reaches it
        max_total_tokens: int | None = None,  # prompt + completion tokens of all calls: stop after the step reaching it
        log_dir: str | None = None,  # where every finished unit of work is saved, and resumed from
        progress: Callable[[str, int, int], None] | None = None,  # progress(stage, done, total); None: tqdm bars
        use_mlflow: bool = False,  # log to MLflow (a run is started); an active MLflow run is logged to anyway
    ):
        if not callable(metric):
            raise TypeError("metric must be callable: metric(example, prediction, trace=None) -> float | dspy.Prediction")
        metric_takes_trace(metric)  # a TypeError now for a metric that takes neither (example, pred) nor a trace
        self.metric = metric
        for name in KNOBS:  # every knob is checked (knobs.py) and kept under its own name
            setattr(self, name, check_knob(name, locals()[name]))
        if probe_size and not use_ground_truth:
            raise ValueError("probe_size needs use_ground_truth=True: a probe scores single attempts, which have no "
                             "group to take a majority answer from")
        if use_mlflow and "mlflow" not in hooks.installed():
            raise RuntimeError("use_mlflow=True, but no MLflow tracker is registered: tfgrpo's entry point "
                               f"{hooks.GROUP}:mlflow comes with its install (pip install -e . in a clone)")
        hooks.built(self)  # trackers learn of it (tfgrpo.base.hooks)

    # -- the outer loop -------------------------------------------------------------------------------------
    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset: list | None = None) -> dspy.Module:
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
        ckpt.start(self._fingerprint(program, targets, trainset, valset, library, policy_lms, reflection_lm))
        if kept := ckpt.saved_units():
            logger.info("resuming from %s: %d finished units kept", ckpt.root, kept)

        path, path_name = self.resolve_path(reflection_lm)
        rng, step, steps, epochs, demos = random.Random(self.seed), 0, [], [], []
        total_steps = self.num_train_epochs * -(-len(trainset) // self.batch_size)
        total_steps = min(total_steps, self.max_steps or total_steps)
        overall = self.progress or StageBar(resumed=True)  # the whole run: steps done of all, with its ETA
        if total_steps:
            overall("step", sum(ckpt.has(f"steps/{i:04d}/done") for i in range(total_steps)), total_steps)
        best: tuple[float, dict, list, int] | None = None
        run_totals, stopped = {"policy": {}, "reflection": {}}, None
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
                library, demos, stats = run_step(self, path, path_name, program, targets, library, demos, trainset,
                                                 batch, step, epoch, reflection_lm, ckpt)
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
                stopped = over_budget(run_totals, max_total_tokens=self.max_total_tokens, max_cost=self.max_cost)
            if stopped:
                logger.warning("Stopping early: %s", stopped)
                break
            if valset:
                record = self._validate(program, targets, library, demos, valset, epoch, ckpt)
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
                "initial_library": digest(library.dump_state())}


def _lm_name(lm) -> str:
    return str(getattr(lm, "model", None) or type(lm).__name__)
