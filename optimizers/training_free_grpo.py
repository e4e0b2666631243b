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

import dataclasses
import functools
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.base.util import digest
from tfgrpo.optimizers.checkpoint import Checkpoint, Keys, code_fingerprint
from tfgrpo.optimizers.contrast import ContrastPath
from tfgrpo.optimizers.inputs import (check_examples, check_inputs, check_prices, check_program, explain_learning_path,
                                      starting_library)
from tfgrpo.optimizers.knobs import AUTO_SMALL, KNOBS, PRESETS, Knobs, args_doc, fingerprinted_knobs, with_preset
from tfgrpo.optimizers.learning_paths import SMALL_REFLECTOR_B, LearningPath, model_size_b, path_name
from tfgrpo.optimizers.paper_path import PaperPath
from tfgrpo.optimizers.parallel import StageBar
from tfgrpo.optimizers.result import EpochResult, StepResult, TrainingFreeGRPOResult, WorthResult
from tfgrpo.optimizers.rewards import metric_takes_trace
from tfgrpo.optimizers.step import RunSetup, Step, StepStart
from tfgrpo.optimizers.usage import add_usage, history_kept, over_budget
from tfgrpo.optimizers.validate import validate
from tfgrpo.optimizers.worth import Attribution, Learned, log_worth
from tfgrpo.programs.inject import resolve_targets, with_learned
from tfgrpo.programs.library import ExperienceLibrary

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    """The state of one compile as its steps go: the library and demos kept so far, what is known of the queries the
    current program solves, the steps' and epochs' records, the best validated epoch, and what was spent (`usage`:
    by this call; `run_usage`: by the whole run, steps reused from log_dir included)."""

    library: ExperienceLibrary
    total_steps: int
    trackers: tuple = ()  # told of every step and validation (MLflow's)
    progress: Callable = lambda *_: None  # the whole run's progress: steps done of all
    demos: list[dict] = field(default_factory=list)
    evidence: dict[int, bool] = field(default_factory=dict)
    pending: list[dict] = field(default_factory=list)  # demo candidates the last step found for the next one
    step: int = 0
    steps: list[StepResult] = field(default_factory=list)
    epochs: list[EpochResult] = field(default_factory=list)
    best: tuple[float, dict, list, int] | None = None
    usage: dict = field(default_factory=lambda: {"policy": {}, "reflection": {}})
    run_usage: dict = field(default_factory=lambda: {"policy": {}, "reflection": {}})
    metric_calls: int = 0
    stopped: str | None = None

    def count(self, stats: StepResult, reused: bool) -> None:
        """Add a step's calls and tokens: to the run's, and to this call's unless the step was reused (nor what a
        stopped run had spent in it)."""
        for stage, usage in stats.usage.items():
            role = "policy" if stage in ("rollout", "probe") else "reflection"
            add_usage(self.run_usage[role], usage)
            if not reused:
                before = stats.usage_before_resume.get(stage, {})
                add_usage(self.usage[role], {k: v - before.get(k, 0) for k, v in usage.items()})
        self.metric_calls += stats.metric_calls


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
        check_program(student)
        ckpt = Checkpoint(self.log_dir)
        knobs = {name: getattr(self, name) for name in KNOBS}
        info = hooks.CompileInfo(knobs=knobs, params=lambda: self._params(student))
        with ckpt.locked(), hooks.tracked(info) as trackers:  # one compile per log_dir; trackers such as MLflow's
            compiled = self._compile(student, trainset=trainset, valset=valset, trackers=trackers, ckpt=ckpt,
                                     attribution_set=attribution_set)
            for tracker in trackers:
                tracker.finish(compiled)
        return compiled

    def _compile(self, student, *, trainset, valset, trackers, ckpt, attribution_set=None) -> dspy.Module:
        held_out = self._held_out(student, valset, attribution_set)
        setup, start = self._prepare(student, trainset, valset, ckpt)
        knobs = setup.knobs  # the knobs as the run uses them (the preset's, where `auto` set them)
        overall = self.progress or StageBar(resumed=True)  # the whole run: steps done of all, with its ETA
        run = _Run(library=start.library, total_steps=knobs.total_steps(len(trainset)), trackers=trackers,
                   progress=overall)
        if run.total_steps:
            overall("step", sum(ckpt.has(Keys.done(i)) for i in range(run.total_steps)), run.total_steps)
        rng = random.Random(knobs.seed)
        for epoch in range(knobs.num_train_epochs):
            if run.step == run.total_steps:  # max_steps reached with the last epoch
                break
            order = list(range(len(trainset)))
            rng.shuffle(order)
            self._epoch(setup, start, run, epoch, order)
            if run.stopped:
                logger.warning("Stopping early: %s", run.stopped)
                break
            if valset:
                self._validated(setup, start, run, epoch, valset)
        if isinstance(overall, StageBar):
            overall.close()  # a run stopped early ends its bar short
        learned, worth = _kept(run), None
        if knobs.attribution:
            worth, learned = Attribution(self.metric, knobs, ckpt).run(student, start.targets, learned, held_out)
            log_worth(worth)
            ckpt.put("worth", worth.to_dict())
        return self._finish(student, start.targets, run, ckpt, learned, worth)

    def _held_out(self, student, valset: list | None, attribution_set: list | None) -> list | None:
        """The queries the attribution measures on (`attribution_set`, else the valset), checked before anything is
        spent."""
        held_out = attribution_set if attribution_set is not None else valset
        if not self.attribution:
            if attribution_set is not None:
                raise ValueError("attribution_set is only read with attribution=True")
            return None
        if not held_out:
            raise ValueError("attribution=True measures the kept items on held-out queries: pass valset= or "
                             "attribution_set=")
        check_examples("attribution_set", held_out)
        check_inputs("attribution_set", held_out, student)
        return held_out

    def _prepare(self, student, trainset, valset, ckpt) -> tuple[RunSetup, StepStart]:
        """Every check before anything is spent (a refusal writes no run.json); then the run's fingerprint."""
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
        model = str(getattr(reflection_lm, "model", ""))
        knobs = self.resolved(model, log=True)  # the settings alone, as the steps read them
        explain_learning_path(knobs.learning_path, path_name(knobs.learning_path, model), reflection_lm)
        library = starting_library(student, program, targets, max_words=knobs.max_words_per_experience,
                                   max_experiences=knobs.max_experiences)
        path, name = _path(knobs, model)
        ckpt.start(self._fingerprint(knobs, program, targets, (trainset, valset), library, (policy_lms, reflection_lm)))
        if saved := ckpt.saved_units():
            logger.info("resuming from %s: %d finished units found", ckpt.root, saved)
        setup = RunSetup(knobs=knobs, metric=self.metric, path=path, path_name=name, reflection_lm=reflection_lm,
                         ckpt=ckpt)
        start = StepStart(index=0, epoch=0, program=program, targets=targets, library=library, demos=[],
                          trainset=trainset, batch=[])
        return setup, start

    def _epoch(self, setup: RunSetup, start: StepStart, run: _Run, epoch: int, order: list[int]) -> None:
        """The epoch's steps, one batch after another, each from what the one before it kept."""
        knobs, used = setup.knobs, set()  # used: the queries this epoch has rolled out
        for at in range(0, len(order), knobs.batch_size):
            if run.stopped or run.step == run.total_steps:
                return
            ranked, size = _ranked(knobs, order, at, run.evidence, used), len(order[at: at + knobs.batch_size])
            reused = setup.ckpt.has(Keys.done(run.step))
            begin = dataclasses.replace(start, index=run.step, epoch=epoch, library=run.library, demos=run.demos,
                                        batch=ranked[:size], reserve=ranked[size:], evidence=run.evidence,
                                        pending=run.pending)
            run.library, run.demos, stats, run.pending = Step(setup, begin).run()
            run.evidence = {int(q): ok for q, ok in stats.evidence.items()}
            used.update(stats.queries or begin.batch)
            run.steps.append(stats)
            for tracker in run.trackers:
                tracker.step(stats)
            run.step += 1
            if run.total_steps:
                run.progress("step", run.step, run.total_steps)
            run.count(stats, reused)
            run.stopped = _over_budget(knobs, run) or _learned_out(knobs, stats)

    def _validated(self, setup: RunSetup, start: StepStart, run: _Run, epoch: int, valset: list) -> None:
        """Score the epoch's library on the valset; the best so far (the later on a tie) is the one kept."""
        record = validate(setup, dataclasses.replace(start, library=run.library, demos=run.demos), valset=valset,
                          epoch=epoch)
        run.metric_calls += len(valset)
        if run.step < run.total_steps:  # steps remain: a budget reached here stops them
            run.stopped = _over_budget(setup.knobs, run)
        run.epochs.append(EpochResult(epoch=epoch, library_size=len(run.library), **record))
        for tracker in run.trackers:
            tracker.validation(run.epochs[-1].__dict__, step=run.step - 1)
        if run.best is None or record["val_score"] >= run.best[0]:  # ties go to the later library
            run.best = (record["val_score"], run.library.dump_state(), run.demos, epoch)

    def _finish(self, student, targets: list[str], run: _Run, ckpt: Checkpoint, learned: Learned,
                worth: WorthResult | None) -> dspy.Module:
        """The compiled copy of the student, carrying `learned`, with the run's record."""
        best = run.best
        compiled = with_learned(student, targets, *learned)
        compiled.detailed_results = TrainingFreeGRPOResult(
            steps=run.steps, epochs=run.epochs, best_val_score=best[0] if best else None,
            best_epoch=best[3] if best else None, usage=run.usage, run_usage=run.run_usage, reused_units=ckpt.reused,
            stopped_early=run.stopped, worth=worth)
        compiled._compiled = True
        return compiled

    # -- pieces ---------------------------------------------------------------------------------------------
    def resolve_learning_path(self, reflection_model: str) -> str:
        """The name of the learning path for a reflection LM of this name ("auto": contrast for small models)."""
        return path_name(self.resolved(reflection_model).learning_path, reflection_model)

    def resolve_path(self, reflection_lm: dspy.BaseLM) -> tuple[LearningPath, str]:
        """The learning path object and its name; a contrast path with G = 1 is refused (it compares attempts)."""
        model = str(getattr(reflection_lm, "model", ""))
        return _path(self.resolved(model), model)

    def resolved(self, reflection_model: str, *, log: bool = False) -> Knobs:
        """The knobs a run with a reflection LM of this name uses: the `auto` preset's values (for "auto", by the
        model's size) for every knob not passed explicitly. `log`: say which preset was taken."""
        preset = None if self.auto == "off" else self.auto
        if preset == "auto":
            preset = AUTO_SMALL if model_size_b(reflection_model) <= SMALL_REFLECTOR_B else "paper"
        explicit = set(getattr(self, "_explicit", KNOBS))
        if not self.use_ground_truth:  # a probe needs the ground truth: a preset does not turn it on without
            explicit.add("probe_size")
        if "num_generations" in explicit:  # exploring attempts never outnumber a group
            explicit.add("num_explore_generations")
        knobs = with_preset(self, preset, explicit)
        if log and preset is not None:
            changed = {k: v for k, v in PRESETS.get(preset, {}).items() if k not in explicit}
            logger.info("auto=%r: preset %r for the reflection model %r (%s); set auto=None to use the knobs as "
                        "declared", self.auto, preset, reflection_model,
                        ", ".join(f"{k}={v}" for k, v in changed.items()) or "every knob passed explicitly")
        return knobs

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

    def _fingerprint(self, knobs: Knobs, program, targets, data: tuple, library, lms: tuple) -> dict:
        """What a resume must match: the knobs that change what is computed, the targets, the LMs' models, the
        program's instructions and code, the metric, the data (trainset, valset) and the starting library."""
        (trainset, valset), (policy_lms, reflection_lm) = data, lms
        models = {"policy": sorted({str(getattr(lm, "model", type(lm).__name__)) for lm in policy_lms.values()}),
                  "reflection": str(getattr(reflection_lm, "model", type(reflection_lm).__name__))}
        knobs = fingerprinted_knobs(knobs)
        if isinstance(knobs["learning_path"], LearningPath):  # a plug-in path is known by its class
            knobs["learning_path"] = f"{type(knobs['learning_path']).__module__}.{type(knobs['learning_path']).__qualname__}"
        return {"knobs": knobs, "targets": targets, "models": models,
                "instructions": digest([p.signature.instructions for _, p in program.named_predictors()]),
                "trainset": digest([dict(x) for x in trainset]), "valset": digest([dict(x) for x in valset or []]),
                "initial_library": digest(library.dump_state()), **code_fingerprint(self.metric, program)}


def _kept(run: _Run) -> Learned:
    """What the compiled program carries: the best validated epoch's library and demos, else the last ones."""
    if best := run.best:
        logger.info("Keeping the library of epoch %d: validation score %.3f, the best of %d validated epoch(s) "
                    "(ties go to the later epoch); %d experiences", best[3], best[0], len(run.epochs),
                    len(best[1]["experiences"]))
        return Learned(ExperienceLibrary.from_state(best[1]), best[2])
    return Learned(run.library, run.demos)


def _path(knobs: Knobs, reflection_model: str) -> tuple[LearningPath, str]:
    """The learning path object for these knobs and its name; a contrast path with G = 1 is refused."""
    name = path_name(knobs.learning_path, reflection_model)
    if isinstance(knobs.learning_path, LearningPath):
        return knobs.learning_path, name
    if name == "contrast" and knobs.num_generations == 1:
        raise ValueError("the contrast learning path compares attempts of one query and learns nothing from "
                         "num_generations=1: use learning_path='paper' (the paper's G = 1 ablation) or G >= 2")
    return (ContrastPath() if name == "contrast" else PaperPath()), name


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
    """Why the run stops with nothing left to learn (`stop_when_nothing_to_learn`), or None."""
    if not knobs.stop_when_nothing_to_learn:
        return None
    if not stats.groups_kept:
        return f"nothing left to learn: no group had reward contrast in step {stats.step} ({stats.groups} queries)"
    probe = stats.probe or {}
    if probe.get("queries") and probe["base_successes"] == len(probe["queries"]):
        return f"nothing left to learn: the program solved all {len(probe['queries'])} probe queries of step " \
               f"{stats.step}"
    return None


def _over_budget(knobs: Knobs, run: _Run) -> str | None:
    return over_budget(run.run_usage, max_total_tokens=knobs.max_total_tokens, max_cost=knobs.max_cost,
                       metric_calls=run.metric_calls, max_metric_calls=knobs.max_metric_calls)


def _lm_name(lm) -> str:
    return str(getattr(lm, "model", None) or type(lm).__name__)


TrainingFreeGRPO.__doc__ = TrainingFreeGRPO.__doc__.rstrip() + "\n" + args_doc()  # the knobs' Args, from knobs.py


def _remember_explicit(init):
    """The dataclass's __init__, noting which knobs the caller passed (they win over the `auto` preset)."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        self._explicit = set(kwargs) & set(KNOBS)
        init(self, *args, **kwargs)
    return __init__


TrainingFreeGRPO.__init__ = _remember_explicit(TrainingFreeGRPO.__init__)
