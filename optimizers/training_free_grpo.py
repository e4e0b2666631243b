"""Training-Free GRPO (arXiv 2510.08191) as a DSPy teleprompter.

GRPO's outer loop is kept: each query of a batch is attempted `num_generations` times, the attempts are
scored, and a group is only informative when its rewards differ. The gradient step is replaced by edits of
an experience library that lives in the program's instructions:

    rollouts -> rewards -> (groups with contrast) -> summaries -> group advantages -> consolidation -> library

or, for small reflection LMs (`learning_path="contrast"`, see `contrast.py`):

    rollouts -> rewards -> (groups with contrast) -> one best-vs-worst call per group -> folded in code -> library

Each group goes through the step at its own pace: its summaries start as soon as its own attempts are scored,
while other groups still roll out (`parallel.run_flows`, `paths.py`); only the consolidation waits for the batch.
Every finished unit of work is checkpointed in `log_dir` (see `checkpoint.py`), so a crashed run resumes without
resending it.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any, Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.optimizers.checkpoint import Checkpoint, digest
from tfgrpo.optimizers.contrast import SMALL_REFLECTOR_B, ContrastPath, model_size_b
from tfgrpo.optimizers.demos import apply_demos, demo_candidates, select_demos
from tfgrpo.optimizers.knobs import KNOBS, check_knob, fingerprinted_knobs
from tfgrpo.optimizers.parallel import StageBars, TooManyFailuresError, WaitFor, run_flows, run_parallel
from tfgrpo.optimizers.paths import PaperPath
from tfgrpo.optimizers.render import format_attempt, query_key
from tfgrpo.optimizers.rewards import call_metric, reference_example, score_attempt
from tfgrpo.optimizers.rollout import run_program, with_own_lms
from tfgrpo.optimizers.usage import add_usage, history_kept, metered_stages, over_budget, stage_usage
from tfgrpo.programs.inject import LIBRARY_KEY, apply_library, resolve_targets
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.tracking import track_compile

logger = logging.getLogger(__name__)

class TrainingFreeGRPO(Teleprompter):
    """Learns a library of natural-language experiences for a DSPy program, and writes it into the
    instructions of its predictors; the weights and the program's own instructions are left alone.

    `compile(student, trainset=..., valset=None)` returns a copy of the student with the library in place
    (`compiled.experience_library`) and the run's record in `compiled.detailed_results`: per step the mean
    reward, groups kept, failures, operations, library size and LM usage by stage; per epoch the validation
    score. Every finished unit of work is saved in `log_dir`; the same call resumes an interrupted run.

    Args:
        metric: `metric(example, prediction, trace=None)` returns a reward in [0, 1], or a
            `dspy.Prediction(score=..., feedback=...)` whose feedback the learning calls read. A metric that
            raises or leaves [0, 1] stops the run with a `MetricError`.
        num_generations: Attempts per query (G). A group is only learned from when its rewards differ; 1
            turns the group comparison off (the paper's ablation). Default 5.
        temperature: Sampling temperature of the attempts while learning, in [0, 2]. Default 0.7.
        num_train_epochs: Passes over the trainset. Default 3.
        batch_size: Queries per optimization step. Default 50.
        seed: Seeds the order of the trainset and the attempts' rollout IDs. Default 0.
        reflection_lm: LM of the learning calls (summaries, group advantages, consolidation). Default None:
            `dspy.settings.lm`, else the student's LM. A stronger model than the student learns better.
        max_operations_per_group: Most library edits one group may propose. Default 2.
        use_ground_truth: False scores each attempt against the majority answer of its group and shows the
            learning calls no answer key. Default True.
        learning_path: "paper" (summaries, group advantages, one consolidation call), "contrast" (one short
            call per best-vs-worst pair of a group, typed from the live library, folded in code; made for small
            reflection LMs) or "auto": contrast when the reflection model's name gives at most 8B parameters.
            Default "auto".
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
        num_threads: Concurrent LM calls of a step (all stages share them). Default 8.
        max_failure_rate: When more than this share of a step's attempts, summaries or group advantages
            fail, the run stops with `TooManyFailuresError` and the step is not done; a resume redoes the
            failed units. Default 0.5.
        max_cost: USD, where LiteLLM knows the price: stop after the step that reaches it, keeping the
            library so far. Needs DSPy's LM history (refused under `disable_history=True`). Default None.
        max_total_tokens: Prompt plus completion tokens of all calls: stop after the step that reaches it.
            Default None.
        log_dir: Folder where every finished unit of work is saved and resumed from; None keeps nothing.
            Default None.
        progress: `progress(stage, done, total)`, called as units finish, for UIs. Default None: a tqdm bar
            per stage, as DSPy's own optimizers draw (pass `lambda *_: None` for silence).
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
        # execution
        num_threads: int = 8,  # concurrent LM calls of a step (rollouts and learning calls share them)
        max_failure_rate: float = 0.5,  # stop when more of a stage's units than this fail (the checkpoint stays)
        max_cost: float | None = None,  # USD (where litellm knows the price): stop after the step that reaches it
        max_total_tokens: int | None = None,  # prompt + completion tokens of all calls: stop after the step reaching it
        log_dir: str | None = None,  # where every finished unit of work is saved, and resumed from
        progress: Callable[[str, int, int], None] | None = None,  # progress(stage, done, total); None: tqdm bars
        use_mlflow: bool = False,  # log to MLflow (a run is started); an active MLflow run is logged to anyway
    ):
        if not callable(metric):
            raise TypeError("metric must be callable: metric(example, prediction, trace=None) -> float | dspy.Prediction")
        self.metric = metric
        for name in KNOBS:  # every knob is checked (knobs.py) and kept under its own name
            setattr(self, name, check_knob(name, locals()[name]))

    # -- the outer loop -------------------------------------------------------------------------------------
    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset: list | None = None) -> dspy.Module:
        with track_compile(self, student) as tracker:  # MLflow, when a run is active or use_mlflow (tracking.py)
            compiled = self._compile(student, trainset=trainset, valset=valset, tracker=tracker)
            if tracker:
                tracker.finish(compiled)
        return compiled

    def _compile(self, student, *, trainset, valset, tracker) -> dspy.Module:
        if not trainset:
            raise ValueError("trainset is empty")
        program = student.deepcopy()
        targets = resolve_targets(program, self.target_predictors)
        self._policy_lms(program)  # fail early, with a clear message, when no LM is configured
        if self.max_cost is not None and not history_kept():
            raise ValueError("max_cost needs DSPy's LM history, the only place where the price of a call is kept, "
                             "and it is off (dspy.configure(disable_history=True) or max_history_size=0): turn it "
                             "back on, or budget with max_total_tokens, which is measured either way")
        start = getattr(student, LIBRARY_KEY, None)
        library = ExperienceLibrary.from_state(start.dump_state()) if isinstance(start, ExperienceLibrary) else \
            ExperienceLibrary(max_words=self.max_words_per_experience, max_experiences=self.max_experiences)
        library.max_words, library.max_experiences = self.max_words_per_experience, self.max_experiences
        ckpt = Checkpoint(self.log_dir)
        ckpt.start(self._fingerprint(program, targets, trainset, valset, library))

        rng, step, steps, epochs, demos = random.Random(self.seed), 0, [], [], []
        best: tuple[float, dict] | None = None
        totals, stopped = {"policy": {}, "reflection": {}}, None
        for epoch in range(self.num_train_epochs):
            order = list(range(len(trainset)))
            rng.shuffle(order)
            for at in range(0, len(order), self.batch_size):
                if stopped:
                    break
                batch = order[at: at + self.batch_size]
                library, demos, stats = self._step(program, targets, library, demos, trainset, batch, step, epoch,
                                                   ckpt)
                steps.append(stats)
                if tracker:
                    tracker.step(stats)
                step += 1
                for stage, usage in stats["usage"].items():
                    add_usage(totals["policy" if stage == "rollout" else "reflection"], usage)
                stopped = over_budget(totals, max_total_tokens=self.max_total_tokens, max_cost=self.max_cost)
            if stopped:
                logger.warning("Stopping early: %s", stopped)
                break
            if valset:
                score = self._validate(program, targets, library, demos, valset, epoch, ckpt)
                epochs.append({"epoch": epoch, "val_score": score, "library_size": len(library)})
                if tracker:
                    tracker.validation(epochs[-1], step=step - 1)
                if best is None or score >= best[0]:  # ties go to the later library
                    best = (score, library.dump_state(), demos)

        final, final_demos = (ExperienceLibrary.from_state(best[1]), best[2]) if best else (library, demos)
        compiled = self._with_learned(student, targets, final, final_demos)
        compiled.detailed_results = {"steps": steps, "epochs": epochs, "reused_units": ckpt.reused,
                                     "best_val_score": best[0] if best else None, "usage": totals,
                                     "stopped_early": stopped}
        compiled._compiled = True
        return compiled

    # -- one optimization step ------------------------------------------------------------------------------
    def _step(self, program, targets, library, demos, trainset, batch, step, epoch, ckpt):
        key = f"steps/{step:04d}"
        done = ckpt.get(f"{key}/done")
        if done is not None:
            logger.info("Step %d: complete in the checkpoint, reused", step)
            return ExperienceLibrary.from_state(done["library"]), done.get("demos", []), done["stats"]
        G, t0, finished_at = self.num_generations, time.time(), {}
        stats: dict[str, Any] = {"step": step, "epoch": epoch, "batch_size": len(batch), "usage": {}}
        candidates, rollout_lms = self._candidates(program, targets, library, demos, step)
        reflection_lm = self._reflection_lm(program)
        contrast = self.resolve_learning_path(getattr(reflection_lm, "model", "")) == "contrast"
        records: dict[tuple[int, int], dict] = {}
        path = (ContrastPath if contrast else PaperPath)(self, program, reflection_lm, library, trainset, records,
                                                          key, ckpt, stats)

        def rollout(job):  # G distinct samples per query, each candidate with its own LM copies (rollout_id)
            qi, g = job
            unit = f"{key}/rollouts/{qi}_{g}"
            if (rec := ckpt.get(unit)) is not None:
                return rec
            _, rec = run_program(candidates[g], trainset[qi])  # a failed attempt is recorded and scored 0
            rec["attempt"] = format_attempt(dict(trainset[qi].inputs().items()), rec["outputs"], rec["trace"],
                                            rec["error"])
            ckpt.put(unit, rec)
            return rec

        def reward(job):  # against the ground truth, or against the group's majority answer
            qi, g, reference = job
            unit = f"{key}/rewards/{qi}_{g}"
            if (rec := ckpt.get(unit)) is None:
                rec = score_attempt(self.metric, reference, records[(qi, g)])
                ckpt.put(unit, rec)
            return rec

        def has_contrast(qi):  # only a group whose rewards differ carries a direction
            return len({records[(qi, g)]["reward"] for g in range(G)}) > 1

        def group(qi):
            """One query's way through the step: it learns as soon as its own attempts are scored."""
            attempts = yield [("rollout", rollout, (qi, g)) for g in range(G)]
            records.update({(qi, g): rec for g, rec in enumerate(attempts)})
            if any(rec["error"] for rec in attempts):
                yield WaitFor("rollout")  # nothing more is spent on it before the attempts' failure check
            reference = reference_example(trainset[qi], attempts, self.use_ground_truth)
            for g, scored in enumerate((yield [("reward", reward, (qi, g, reference)) for g in range(G)])):
                records[(qi, g)].update(scored)
            if has_contrast(qi):
                yield from path.learn(qi)

        def stage_checked(stage):  # a flow waits at this stage's failure check (WaitFor)
            if stage != "rollout":
                return path.stage_done(stage)
            errors = [rec["error"] for rec in records.values() if rec["error"]]
            if len(errors) > self.max_failure_rate * len(batch) * G:
                for (qi, g), rec in records.items():  # a resume retries them (the outage may be over), not replays them
                    if rec["error"]:
                        ckpt.discard(f"{key}/rollouts/{qi}_{g}")
            self._stop_if_failing(step, "attempts", errors, len(batch) * G)

        def progress(stage, n, total):
            finished_at[stage] = time.time() - t0  # stages overlap: when each one's latest unit finished
            (self.progress or bars)(stage, n, total)

        # 1-6. rollouts -> rewards -> (groups with contrast) -> learning calls, each group at its own pace
        bars, stages = StageBars(), ("rollout", *path.stages)
        logger.info("Step %d: %d queries x %d attempts on %d thread(s)", step, len(batch), G, self.num_threads)
        with metered_stages(stages) as meters:
            try:
                run_flows([group(qi) for qi in batch], num_threads=self.num_threads, progress=progress, meters=meters,
                          on_stage_done=stage_checked)
            finally:
                bars.close()
        stats["usage"]["rollout"] = stage_usage(meters["rollout"], rollout_lms)
        for stage in path.stages:
            stats["usage"][stage] = stage_usage(meters[stage], [path.lms[stage]])
        kept = [qi for qi in batch if has_contrast(qi)]
        rewards = [r["reward"] for r in records.values()]
        stats.update(mean_reward=statistics.fmean(rewards), groups=len(batch), groups_kept=len(kept),
                     frac_skipped_zero_std=1 - len(kept) / len(batch),
                     rollout_failures=sum(bool(r["error"]) for r in records.values()),
                     tool_calls_mean=statistics.fmean(r["tool_calls"] for r in records.values()))
        logger.info("Step %d: mean reward %.3f, %d/%d groups with contrast", step, stats["mean_reward"], len(kept), len(batch))
        plan, proposals, learned = path.finish(kept)  # failure checks of the learning calls, then the plan
        finished_at["learning"] = time.time() - t0

        # 7. the plan is validated and applied in code, all or nothing
        if self.max_demos:  # winning attempts as demos (optimizers/demos.py)
            keys = {qi: query_key(trainset[qi], qi) for qi in kept}
            demos = select_demos(demos, demo_candidates(records, kept, G, step, keys), self.max_demos)
            stats["demos"] = [d["query"] for d in demos]
        sources = sorted({q for q, _ in proposals})
        report = library.apply(plan, step=step, sources=sources)
        stats.update(learned)
        stats.update(operations_applied=report.applied, operations_rejected=len(report.rejected),
                     library_size=len(library), seconds=finished_at, wall_s=time.time() - t0)
        logger.info("Step %d: %d operations proposed, applied %s, %d refused; library has %d experiences",
                    step, stats["operations_proposed"], report.applied, len(report.rejected), len(library))
        ckpt.put(f"{key}/done", {"library": library.dump_state(), "demos": demos, "stats": stats})
        return library, demos, stats

    # -- pieces ---------------------------------------------------------------------------------------------
    def resolve_learning_path(self, reflection_model: str) -> str:
        """The learning path for a reflection LM of this name ("auto": contrast for small models)."""
        if self.learning_path != "auto":
            return self.learning_path
        return "contrast" if model_size_b(reflection_model) <= SMALL_REFLECTOR_B else "paper"

    def _stop_if_failing(self, step: int, units: str, errors: list[str], total: int) -> None:
        """Stop the run, leaving the step unfinished, when more than `max_failure_rate` of a stage's units failed:
        an outage must not pass for "nothing to learn". A resume redoes the failed units."""
        if len(errors) > self.max_failure_rate * total:
            raise TooManyFailuresError(f"step {step}: {len(errors)} of {total} {units} failed (first: {errors[0]}); "
                                       f"finished work is kept in log_dir={self.log_dir!r}")

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

    @staticmethod
    def _with_learned(program, targets, library, demos) -> dspy.Module:
        """A copy of `program` carrying what was learned: the library in the targets' instructions, and demos."""
        return apply_demos(apply_library(program.deepcopy(), library, targets), demos, targets)

    def _candidates(self, program, targets, library, demos, step):
        """G copies of the program with the library (and demos) and private, distinct LM copies."""
        candidates, lms = [], []
        for g in range(self.num_generations):
            rollout_id = int(digest([self.seed, step, g]), 16) % 2**31
            cand, copies = with_own_lms(self._with_learned(program, targets, library, demos), rollout_id=rollout_id,
                                        temperature=self.temperature)
            candidates.append(cand)
            lms += copies
        return candidates, lms

    def _validate(self, program, targets, library, demos, valset, epoch, ckpt) -> float:
        if (saved := ckpt.get(f"epochs/{epoch}")) is not None:
            return saved["val_score"]
        cand, _ = with_own_lms(self._with_learned(program, targets, library, demos))

        def score(example):
            prediction, rec = run_program(cand, example)
            return 0.0 if rec["error"] else call_metric(self.metric, example, prediction)[0]

        value = statistics.fmean(self._parallel(score, list(valset), "validation"))
        logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(library))
        ckpt.put(f"epochs/{epoch}", {"val_score": value, "library": library.dump_state(), "demos": demos})
        return value

    def _fingerprint(self, program, targets, trainset, valset, library) -> dict:
        return {"knobs": fingerprinted_knobs(self), "targets": targets,
                "instructions": digest([p.signature.instructions for _, p in program.named_predictors()]),
                "trainset": digest([dict(x) for x in trainset]), "valset": digest([dict(x) for x in valset or []]),
                "initial_library": digest(library.dump_state())}

