"""Training-Free GRPO (arXiv 2510.08191) as a DSPy teleprompter.

GRPO's outer loop is kept: each query of a batch is attempted `num_generations` times, the attempts are
scored, and a group is only informative when its rewards differ. The gradient step is replaced by edits of
an experience library that lives in the program's instructions:

    rollouts -> rewards -> (groups with contrast) -> summaries -> group advantages -> consolidation -> library

or, for small reflection LMs (`learning_path="contrast"`, see `contrast.py`):

    rollouts -> rewards -> (groups with contrast) -> one best-vs-worst call per group -> folded in code -> library

Every stage runs its LM calls in parallel; only the consolidation of a step is one call. Every finished unit
of work is checkpointed in `log_dir` (see `checkpoint.py`), so a crashed run resumes without resending it.
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
from tfgrpo.optimizers.contrast import SMALL_REFLECTOR_B, learn_by_contrast, model_size_b
from tfgrpo.optimizers.demos import apply_demos, demo_candidates, select_demos
from tfgrpo.optimizers.knobs import KNOBS, check_knob, fingerprinted_knobs
from tfgrpo.optimizers.parallel import Failed, StageBar, TooManyFailuresError, run_parallel
from tfgrpo.optimizers.render import clip, format_attempt, format_fields, outcome, query_key
from tfgrpo.optimizers.rewards import call_metric, reference_example, score_attempt
from tfgrpo.optimizers.rollout import run_program, with_own_lms
from tfgrpo.optimizers.usage import add_usage, history_kept, metered, over_budget, stage_usage
from tfgrpo.programs.inject import LIBRARY_KEY, apply_library, resolve_targets
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"


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
        num_threads: Concurrent LM calls within a stage. Default 8.
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
        num_threads: int = 8,  # concurrent LM calls within a stage
        max_failure_rate: float = 0.5,  # stop when more of a stage's units than this fail (the checkpoint stays)
        max_cost: float | None = None,  # USD (where litellm knows the price): stop after the step that reaches it
        max_total_tokens: int | None = None,  # prompt + completion tokens of all calls: stop after the step reaching it
        log_dir: str | None = None,  # where every finished unit of work is saved, and resumed from
        progress: Callable[[str, int, int], None] | None = None,  # progress(stage, done, total); None: tqdm bars
    ):
        if not callable(metric):
            raise TypeError("metric must be callable: metric(example, prediction, trace=None) -> float | dspy.Prediction")
        self.metric = metric
        for name in KNOBS:  # every knob is checked (knobs.py) and kept under its own name
            setattr(self, name, check_knob(name, locals()[name]))

    # -- the outer loop -------------------------------------------------------------------------------------
    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset: list | None = None) -> dspy.Module:
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
        G, t0, timing = self.num_generations, time.time(), {}
        stats: dict[str, Any] = {"step": step, "epoch": epoch, "batch_size": len(batch), "usage": {}}
        rendered_library = library.render() or EMPTY_LIBRARY

        # 1. rollouts: G distinct samples per query, each candidate with its own LM copies (rollout_id)
        candidates, rollout_lms = self._candidates(program, targets, library, demos, step)
        jobs = [(qi, g) for qi in batch for g in range(G)]

        def rollout(job):
            qi, g = job
            unit = f"{key}/rollouts/{qi}_{g}"
            if (rec := ckpt.get(unit)) is not None:
                return rec
            _, rec = run_program(candidates[g], trainset[qi])  # a failed attempt is recorded and scored 0
            rec["attempt"] = format_attempt(dict(trainset[qi].inputs().items()), rec["outputs"], rec["trace"],
                                            rec["error"])
            ckpt.put(unit, rec)
            return rec

        with metered() as used:
            records = dict(zip(jobs, self._parallel(rollout, jobs, "rollout")))
        stats["usage"]["rollout"] = stage_usage(used, rollout_lms)
        failures = [r for r in records.values() if r["error"]]
        if len(failures) > self.max_failure_rate * len(jobs):
            for (qi, g), rec in records.items():  # a resume retries them (the outage may be over), not replays them
                if rec["error"]:
                    ckpt.discard(f"{key}/rollouts/{qi}_{g}")
        self._stop_if_failing(step, "attempts", [r["error"] for r in failures], len(jobs))
        timing["rollout"] = time.time() - t0

        # 2. rewards, against the ground truth or against the group's majority answer
        references = {qi: reference_example(trainset[qi], [records[(qi, g)] for g in range(G)], self.use_ground_truth)
                      for qi in batch}

        def reward(job):
            unit = f"{key}/rewards/{job[0]}_{job[1]}"
            if (rec := ckpt.get(unit)) is None:
                rec = score_attempt(self.metric, references[job[0]], records[job])
                ckpt.put(unit, rec)
            return rec

        for job, scored in zip(jobs, self._parallel(reward, jobs, "reward")):
            records[job].update(scored)
        timing["reward"] = time.time() - t0 - sum(timing.values())

        # 3. only groups whose rewards differ carry a direction; the others cost no further call
        kept = [qi for qi in batch if len({records[(qi, g)]["reward"] for g in range(G)}) > 1]
        rewards = [r["reward"] for r in records.values()]
        stats.update(mean_reward=statistics.fmean(rewards), groups=len(batch), groups_kept=len(kept),
                     frac_skipped_zero_std=1 - len(kept) / len(batch), rollout_failures=len(failures),
                     tool_calls_mean=statistics.fmean(r["tool_calls"] for r in records.values()))
        logger.info("Step %d: mean reward %.3f, %d/%d groups with contrast", step, stats["mean_reward"], len(kept), len(batch))

        # 4-6. learning calls: what did the better attempts know? -> a plan of operations on the library
        reflection_lm = self._reflection_lm(program)
        if self.resolve_learning_path(getattr(reflection_lm, "model", "")) == "contrast":
            plan, proposals, learned = learn_by_contrast(self, program, reflection_lm, library, trainset, records,
                                                         kept, key, ckpt, stats)
        else:
            plan, proposals, learned = self._learn_paper(reflection_lm, library, rendered_library, trainset,
                                                         records, kept, key, ckpt, stats)
        timing["learning"] = time.time() - t0 - sum(timing.values())

        # 7. the plan is validated and applied in code, all or nothing
        if self.max_demos:  # winning attempts as demos (optimizers/demos.py)
            keys = {qi: query_key(trainset[qi], qi) for qi in kept}
            demos = select_demos(demos, demo_candidates(records, kept, G, step, keys), self.max_demos)
            stats["demos"] = [d["query"] for d in demos]
        sources = sorted({q for q, _ in proposals})
        report = library.apply(plan, step=step, sources=sources)
        stats.update(learned)
        stats.update(operations_applied=report.applied, operations_rejected=len(report.rejected),
                     library_size=len(library), seconds=timing, wall_s=time.time() - t0)
        logger.info("Step %d: %d operations proposed, applied %s, %d refused; library has %d experiences",
                    step, stats["operations_proposed"], report.applied, len(report.rejected), len(library))
        ckpt.put(f"{key}/done", {"library": library.dump_state(), "demos": demos, "stats": stats})
        return library, demos, stats

    def _learn_paper(self, reflection_lm, library, rendered_library, trainset, records, kept, key, ckpt, stats):
        """The paper's path: summarize every attempt of a kept group, extract each group's advantage as
        operations, consolidate the batch's operations in one call. Returns (plan, proposals, counts)."""
        G, qkeys = self.num_generations, {qi: query_key(trainset[qi], qi) for qi in kept}
        # 4. summaries of every attempt in a kept group
        gt = self.use_ground_truth
        summarizer, advantage, consolidator = Summarizer(gt), AdvantageExtractor(gt), Consolidator()
        lms = {name: reflection_lm.copy() for name in ("summary", "advantage", "consolidation")}
        for module, name in ((summarizer, "summary"), (advantage, "advantage"), (consolidator, "consolidation")):
            module.set_lm(lms[name])
        answer_key = {qi: _answer_key(trainset[qi], [records[(qi, g)] for g in range(G)]) for qi in kept} if gt else {}
        summary_jobs = [(qi, g) for qi in kept for g in range(G)]

        def summarize(job):
            unit = f"{key}/summaries/{job[0]}_{job[1]}"
            if (rec := ckpt.get(unit)) is None:
                r = records[job]
                try:
                    rec = summarizer(task_input=format_fields(trainset[job[0]].inputs()), attempt=r["attempt"],
                                     outcome=outcome(r), reference_answer=answer_key.get(job[0], ""),
                                     experiences=rendered_library)
                except Exception as exc:  # a failed learning call is counted, not fatal
                    return Failed(exc)
                ckpt.put(unit, rec)
            return rec

        summaries = self.learning_stage(summarize, summary_jobs, "summary", lms["summary"], stats)
        learning_failures = 0
        for job, summary in zip(summary_jobs, summaries):
            if isinstance(summary, Failed):  # fall back to the raw attempt, cut short
                learning_failures += 1
                logger.warning("Summary of query %s attempt %d failed (%s); using the raw attempt", *job, summary.error)
                summary = clip(records[job]["attempt"], 1500)
            records[job]["summary"] = summary

        # 5. group advantage: what did the better attempts know? -> at most N operations per group
        def extract(qi):
            unit = f"{key}/advantages/{qi}"
            if (ops := ckpt.get(unit)) is None:
                attempts = "\n\n".join(f"Attempt {g + 1} (reward {records[(qi, g)]['reward']:.2f}):\n"
                                       f"{records[(qi, g)]['summary']}" for g in range(G))
                try:
                    ops = [o.model_dump() for o in advantage(
                        task_input=format_fields(trainset[qi].inputs()), reference_answer=answer_key.get(qi, ""),
                        attempts=attempts, experiences=rendered_library, max_operations=self.max_operations_per_group,
                        max_words=self.max_words_per_experience)]
                except Exception as exc:  # a failed learning call is counted, not fatal
                    return Failed(exc)
                ckpt.put(unit, ops)
            return ops

        advantages = self.learning_stage(extract, kept, "advantage", lms["advantage"], stats)
        proposals: list[tuple[str, Operation]] = []
        for qi, ops in zip(kept, advantages):
            if isinstance(ops, Failed):
                learning_failures += 1
                logger.warning("Group advantage of query %s failed (%s); the group proposes nothing", qi, ops.error)
                continue
            proposals += [(qkeys[qi], Operation.model_validate(o)) for o in ops]

        # 6. consolidation: one call turns the batch's proposals into the plan
        with metered() as used:
            plan, stats["consolidation"] = self._consolidate(consolidator, library, proposals, key, ckpt)
        stats["usage"]["consolidation"] = stage_usage(used, [lms["consolidation"]])
        return plan, proposals, {"learning_failures": learning_failures, "operations_proposed": len(proposals)}

    def _consolidate(self, consolidator, library, proposals, key, ckpt) -> tuple[list[Operation], str]:
        if not proposals:
            return [], "nothing proposed"
        if (saved := ckpt.get(f"{key}/plan")) is not None:
            return [Operation.model_validate(o) for o in saved["plan"]], saved["status"]
        progress = self.progress or StageBar()
        progress("consolidation", 0, 1)
        try:
            plan, status = consolidator(experiences=library.render() or EMPTY_LIBRARY, proposals=proposals,
                                        max_words=self.max_words_per_experience), "ok"
        except Exception as exc:  # the proposals were validated one by one already: apply them as they are
            logger.warning("Consolidation failed (%s); applying the %d proposals directly", exc, len(proposals))
            plan, status = [op for _, op in proposals], "fallback: proposals applied directly"
        ckpt.put(f"{key}/plan", {"plan": [o.model_dump() for o in plan], "status": status})
        progress("consolidation", 1, 1)
        return plan, status

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

    def learning_stage(self, fn, jobs: list, stage: str, lm: dspy.BaseLM, stats: dict) -> list:
        """Run a stage of learning calls (`fn` returns `Failed` for a call that failed): usage metered into
        `stats`, and the run stopped, unfinished, when more than `max_failure_rate` of the calls failed."""
        with metered() as used:
            results = self._parallel(fn, jobs, stage)
        stats["usage"][stage] = stage_usage(used, [lm])
        self._stop_if_failing(stats["step"], f"{stage} calls", [r.error for r in results if isinstance(r, Failed)],
                              len(jobs))
        return results

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


def _answer_key(example, group: list[dict]) -> str:
    """The ground truth shown to learning calls: the labels the program also outputs (else all labels)."""
    labels = dict(example.labels())
    produced = {k for r in group for k in (r["outputs"] or {})}
    return clip(format_fields({k: v for k, v in labels.items() if k in produced} or labels), 2000)
