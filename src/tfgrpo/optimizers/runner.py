"""The verbs a step calls: every unit of work of a run goes through one `Runner`, inside a `Scope`.

A unit is one attempt of a program on a query (a rollout, a probe attempt, a validation or attribution run), its score,
or one learning call. Every unit goes through one verb, `Scope.unit`, which

  1. reuses it from the checkpoint, when a run before this one finished it;
  2. charges the budget before it starts (`spend.Budget`): its expected tokens, dollars and metric call must fit in
     what is left beside the units in flight, else the run stops with `BudgetExhausted`, nothing half-written;
  3. runs it on the scope's workers (`workers.py`: threads, or Ray), metered by stage, priced by the models' prices,
     and saves it;
  4. counts it as a failure when it raised (save a reply with content that did not parse: the program's own 0);
     `Scope.check` then stops the scope with `TooManyFailuresError` when more than `max_failure_rate` of a stage's
     units failed: an outage must not pass for "nothing to learn".

An attempt the provider did not answer has no answer: an LM call that failed (an `LMError`: a rate limit, a timeout,
a lost connection, a prompt refused for its length or content), or a reply with nothing in it (no choices, or a
content filter's or a length cut's empty content). It is never scored; the step leaves it out of its group and the
probe and counts it in `failed_calls`, and a validation leaves it out of its score. Any other error of the program (a
reply with content that does not parse, a tool that raises) is the program's own doing: it scores 0.

The `Runner` is the run's: its knobs, metric, checkpoint, budget and what was spent. A `Scope` is one step, one
validation or one attribution, opened with `with runner.scope(...) as scope`: its workers, meters by stage and failure
counts. The step holds its scope and passes it on (to the probe and the learning path); nothing of a scope is written
on the runner. The run's own records (a finished step, a validation, the attribution) are read and written with the
runner's `record` and `keep`. `Run` and `State` are what a step reads and changes, and `LearningPath` what a path of
learning calls provides.

No verb waits on another group: learning calls of which one failed, at a stage the step has not checked yet, raise
`Held`, and the step (which catches it) runs the stage's failure check over every group before the group goes on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import dspy
import pydantic

from tfgrpo.base.util import jsonable
from tfgrpo.optimizers.checkpoint import Checkpoint, RunMismatchError
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import Attempt, Demo, Failed, Group, Lessons, Scored, Verdict
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.optimizers.spend import Budget, BudgetExhausted, UsageMeter, add_usage
from tfgrpo.optimizers.workers import (EMPTY_REPLIES, EMPTY_REPLY, AsyncWorkers, RayAttempts, StageBars, Workers,
                                       arun_attempt, empty_reply, rebuilt, rollout_id, run_program, typed, with_own_lms)
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.programs.render import MAX_ATTEMPT_CHARS, MAX_FEEDBACK_CHARS

logger = logging.getLogger(__name__)

CONTEXT_REFUSALS = ("contextwindowexceeded", "context length", "context_length_exceeded", "maximum context",
                    "context window", "exceeds the available context size")  # LiteLLM, OpenAI, vLLM, llama.cpp
# the stages of units of work with their role, which is whose calls they are: the program's ("policy"), the metric's
# (an LLM judge's); every other stage is a learning path's (its `stages`): "reflection" (`role`)
ROLE = {"rollout": "policy", "reward": "metric", "probe": "policy", "validation": "policy", "attribution": "policy"}
# what may be cut for the learning calls: kind -> (the length kept, what it is)
CUTS = {"attempt": (MAX_ATTEMPT_CHARS, "An attempt"),
        "feedback": (MAX_FEEDBACK_CHARS, "The metric's feedback on an attempt")}


def role(stage: str) -> str:
    """Whose calls a stage's are: "policy", "metric" or "reflection" (see `ROLE`)."""
    return ROLE.get(stage, "reflection")


class TooManyFailuresError(RuntimeError):
    """More of a stage's units failed than `max_failure_rate` allows: the step stops, unfinished."""


@dataclass
class StageFailures:
    """A stage's units so far in a scope, and the errors of those that failed."""

    units: int = 0
    errors: list[str] = field(default_factory=list)


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


@runtime_checkable
class LearningPath(Protocol):
    """How one step's groups with reward contrast become a plan of library operations (step.py holds the
    paper's path, contrast_path.py the contrast path). `learn` makes one group's learning calls through the step's
    `scope` (`scope.call`, `scope.calls`; groups run side by side, each as soon as its attempts are scored) and returns what
    `finish` needs; `finish` turns every group's result into the step's `Lessons`. `stages` names the stages its calls
    are metered and checked under. An instance holds settings only: one serves every step."""

    stages: tuple[str, ...] = ()

    def learn(self, run: Run, scope: Scope, library: ExperienceLibrary, group: Group) -> Any: ...

    def finish(self, run: Run, scope: Scope, library: ExperienceLibrary, results: list[tuple[Group, Any]]
               ) -> Lessons: ...


class Runner:
    """What a whole run shares (see the module docstring): the knobs, the metric, the checkpoint, the `budget` (the
    knobs' budgets), the prices and what every scope spent (`spent` by role and `sent` by stage, in this process;
    `unrecorded` by stage: what no step record holds). Open a `scope()` around each step, validation or attribution;
    its verbs run the units."""

    def __init__(self, knobs: Knobs, metric: Callable, ckpt: Checkpoint | None = None):
        self.knobs, self.metric, self.ckpt = knobs, metric, ckpt or Checkpoint(None)
        self.budget, self.custom_prices, self.prices = Budget(knobs), knobs.prices, {}
        self.spent: dict[str, dict] = {"policy": {}, "reflection": {}}  # by this process, every scope ("metric" too,
        # once a metric calls an LM)
        self.unrecorded: dict[str, dict] = {}  # by stage, what no step record holds (validation, attribution, a stop)
        self.sent: dict[str, dict] = {}  # by stage, what this process sent (every scope)
        self.direct_calls = 0  # LM calls of the program outside its predictors (they get no library)
        self.clipped: set[str] = set()  # what was cut for the learning calls: "feedback", "attempt" (each said once)
        self.lock = threading.Lock()
        self.ray = (RayAttempts(knobs.prices, other_versions=knobs.ray_other_versions) if knobs.backend == "ray"
                    else None)

    @contextlib.contextmanager
    def scope(self, name: str, *, prefix: str = "", usage_key: str | None = None,
              before: dict | None = None) -> Iterator[Scope]:
        """A step, validation or attribution (`name`, as errors say it). Its learning calls are saved under `prefix`
        (the step's folder); with `usage_key` (a step's), its usage so far is saved there after each unit, on top of
        `before` (what a stopped run had spent in it), and counts as recorded once the block ends without an error.
        An enclosing `dspy.track_usage()` receives every call of the scope once, as it ends."""
        outer, bars = dspy.settings.usage_tracker, StageBars()
        scope = Scope(self, name, prefix=prefix, usage_key=usage_key, before=before or {})
        recorded = False
        workers = AsyncWorkers if self.knobs.backend == "async" else Workers
        try:
            with workers(self.knobs.num_threads, progress=self.knobs.progress or bars) as scope.work:
                try:
                    yield scope
                    recorded = usage_key is not None  # the step's record holds the scope's usage
                except KeyboardInterrupt:
                    if self.ray is not None:  # Ctrl-C ends the run's tasks on the cluster too
                        self.ray.cancel()
                    raise
        finally:  # (after the workers' exit: a scope stopped by an error has let its running units finish)
            bars.close()
            for stage, meter in scope.meters.items():
                if not (totals := meter.totals())["calls"]:  # (a metric with no LM call, say)
                    continue
                add_usage(self.spent.setdefault(role(stage), {}), totals)
                add_usage(self.sent.setdefault(stage, {}), totals)
                if not recorded:  # a validation, an attribution, a step stopped part way
                    add_usage(self.unrecorded.setdefault(stage, {}), totals)
                for lm, entries in (meter.usage_data.items() if outer is not None else ()):
                    outer.usage_data[lm].extend(entries)

    # -- the run's own records ---------------------------------------------------------------------------------------
    def record(self, key: str, *, reused: bool = True) -> Any | None:
        """The record of the run saved under `key` (a finished step, a validation; `reused=False`: a tally, such as a
        step's usage so far, which is no reused work), or None."""
        return self.ckpt.get(key, unit=reused)

    def keep(self, key: str, value: Any, *, once: bool = False) -> None:
        """Save a record of the run under `key` (`once`: unless one is saved there already)."""
        if not (once and self.ckpt.get(key, unit=False) is not None):
            self.ckpt.put(key, value)

    def recheck(self, program: dspy.Module, trainset: list) -> None:
        """Before a resume reuses saved work, check that today's metric and program would have made it: up to 3 saved
        attempts are scored again, and one is run again through the program with each predictor answering what it
        answered then (no LM call). Another reward, or other inputs to a predictor, or other outputs, is a change the
        fingerprint cannot see (a setting the metric or program holds elsewhere): `RunMismatchError`, nothing reused."""
        paths = sorted(self.ckpt.root.glob("steps/*/rollouts/*.json")) if self.ckpt.root is not None else []
        saved = [(p, json.loads(p.read_text())) for p in paths[:20]]
        saved = [(p, r) for p, r in saved if not r["error"] and "characters cut ...]" not in json.dumps(r["trace"])]
        where = f"{self.ckpt.root} holds work that today's {{}} would not have made ({{}}): the resume would reuse it as " \
                "if it had; use a new log_dir (or delete this one), or restore the {} as it was"
        for path, record in saved[:3] if self.knobs.use_ground_truth else []:
            reward = json.loads((path.parent.parent / "rewards" / path.name).read_text())["reward"] if (
                path.parent.parent / "rewards" / path.name).exists() else None
            again = score_attempt(self.metric, trainset[int(path.stem.split("_")[0])],
                                  typed(program, Attempt.from_record(record)), self.knobs.metric_timeout_s)
            if reward is not None and again.timeout is None and abs(again.reward - reward) > 1e-9:
                raise RunMismatchError(where.format("metric", f"{path.name}: reward {reward} then, "
                                                    f"{again.reward} now", "metric"))
        if saved:  # the program as that rollout ran it (its LM copy's rollout ID, which a program may read)
            path, record = saved[0]
            step, (query, g) = int(path.parent.parent.name), path.stem.split("_")
            replay, asked = with_own_lms(program, rollout_id=rollout_id(self.knobs.seed, step, int(g)),
                                         temperature=self.knobs.temperature), []
            for name, predictor in replay.named_predictors():
                def answer(name=name, calls=[c for c in record["trace"] if c["predictor"] == name],
                           types={k: f.annotation for k, f in predictor.signature.output_fields.items()}, **inputs):
                    asked.append({"predictor": name, "inputs": jsonable({k: v for k, v in inputs.items() if k not in
                                                                         ("config", "demos", "signature", "lm")})})
                    # (what a Predict takes as settings of the call; its trace holds the inputs alone)
                    return dspy.Prediction(**rebuilt(types, calls.pop(0)["outputs"])) if calls else dspy.Prediction()
                predictor.forward = answer
            _, now = run_program(replay, trainset[int(query)])
            if now.outputs != record["outputs"] or _by_predictor(asked) != _by_predictor(record["trace"]):
                raise RunMismatchError(where.format("program", f"{path.name}, given the same replies, now asks "
                                                    f"{asked[:2]} and answers {now.outputs or now.error}", "program"))


def _by_predictor(calls: list[dict]) -> dict[str, list]:
    """Each predictor's inputs, in the order it was called: the order across predictors is the program's threads'
    (dspy.Parallel), that of one predictor's own calls is its program's."""
    grouped: dict[str, list] = {}
    for call in calls:
        grouped.setdefault(call["predictor"], []).append(call["inputs"])
    return grouped


def _as_record(value: Any) -> Any:
    """What a unit saves by default: its value as JSON; a failed learning call nothing (a resume makes it again)."""
    return None if isinstance(value, Failed) else jsonable(value)


def _as_failure(value: Any) -> str | None:
    """What makes a unit a failure by default: a failed learning call (its error)."""
    return value.error if isinstance(value, Failed) else None


def _attempt_record(attempt: Attempt) -> dict | None:
    """What an attempt's unit saves: the attempt, unless it raised or its metric call timed out (it runs again)."""
    return None if attempt.error or getattr(attempt, "timeout", None) else attempt.to_record()


def _attempt_failure(attempt: Attempt) -> str | None:
    """What makes an attempt's unit a failure: its error, unless the reply came back and did not parse (the program's
    own 0, no outage), or its metric call's timeout."""
    return None if attempt.unparsed else attempt.error or getattr(attempt, "timeout", None)


def _or_failed(fn: Callable[[], Any]) -> Any:
    """`fn()`, a learning call, or the `Failed` it raised (a failed learning call is counted, not fatal). The call's
    LM replies are recorded on a module of its own in DSPy's caller list, so that a reply with nothing in it can be
    named."""
    replies = dspy.Module()
    try:
        with dspy.context(caller_modules=[*(dspy.settings.caller_modules or []), replies]):
            return fn()
    except BudgetExhausted:
        raise
    except Exception as exc:
        return Failed(_why(exc, replies.history))


class Scope:
    """One step, validation or attribution of a run (`Runner.scope`): the verbs that run its units, `attempt` (a
    program on an example, scored in the same unit or later by `score`), `scored` (attempts scored: the probe,
    validation, the attribution) and `calls` (learning calls), each checkpointed, charged to the run's budget and
    metered by stage (`meter`); `map` runs any function on the scope's workers and `each` runs a step's groups side by
    side; `check` applies the failure rule to a stage (`checked`: the stages whose check passed). `finished` holds when
    each stage's latest unit ended."""

    def __init__(self, runner: Runner, name: str, *, prefix: str, usage_key: str | None, before: dict):
        self.runner, self.knobs, self.name, self.prefix = runner, runner.knobs, name, prefix
        self.usage_key, self.before = usage_key, before
        self.meters: dict[str, UsageMeter] = {}
        self.failures: dict[str, StageFailures] = {}
        self.finished: dict[str, float] = {}
        self.checked: set[str] = set()
        self.work: Workers | None = None  # set by Runner.scope
        self._values: dict[str, Any] = {}  # learning calls made or read in this scope, a failed one's `Failed` too
        self._lock = threading.Lock()

    def meter(self, stage: str) -> UsageMeter:
        """The stage's meter in this scope (`meter(stage).totals()`: its calls, tokens and dollars so far)."""
        with self._lock:
            if stage not in self.meters:
                self.meters[stage] = UsageMeter(self.runner.prices, self.runner.custom_prices)
            return self.meters[stage]

    def usage(self) -> dict[str, dict]:
        """The scope's usage so far by stage, with what a stopped run had spent in it (`before`)."""
        return {**self.before, **{stage: add_usage(dict(self.before.get(stage, {})), meter.totals())
                                  for stage, meter in list(self.meters.items())}}

    def map(self, stage: str, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]` on the scope's workers, shown as `stage`."""
        self.meter(stage)
        return self.work.map(stage, fn, items)

    def each(self, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]`, each item a group of its own running side by side with the others (its
        units on the scope's workers); in order."""
        return self.work.each(fn, items)

    # -- units ----------------------------------------------------------------------------------------------------
    def unit(self, stage: str, key: str | None, make: Callable[[], Any], *, read: Callable[[Any], Any] | None = None,
             record: Callable[[Any], Any] = _as_record, failure: Callable[[Any], str | None] = _as_failure,
             metric_calls: int = 0) -> Any:
        """One unit of work of `stage`, done the same way for every stage (the metric's included): the value saved
        under `key` read back (`read`), counting its `metric_calls` in the budget all the same; else `make()`, charged
        to the budget before it starts, run under a meter of its own that then goes to the stage's, and saved under
        `key` as `record(value)` (None: not saved, a resume makes it again; by default its JSON, a `Failed` none).
        Then counted, as a failure of the stage where `failure(value)` gives its error (by default a `Failed`'s)."""
        if key is not None and (saved := self.runner.ckpt.get(key)) is not None:
            value = read(saved) if read is not None else saved
            self.runner.budget.add({}, metric_calls=metric_calls)
        else:
            share, own, value = self.runner.budget.reserve(stage, metric_calls), self._own_meter(), None
            try:
                with dspy.context(usage_tracker=own):
                    value = make()
            finally:
                self._spent(stage, share, own, value, metric_calls)
            if key is not None and (kept := record(value)) is not None:
                self.runner.ckpt.put(key, kept)
        self._done(stage, failure(value))
        return value

    async def aunit(self, stage: str, key: str | None, make: Callable[[], Any], *,
                    read: Callable[[Any], Any] | None = None, record: Callable[[Any], Any] = _as_record,
                    failure: Callable[[Any], str | None] = _as_failure, metric_calls: int = 0) -> Any:
        """`unit` for a coroutine function `make`, on the async workers' loop (backend="async")."""
        if key is not None and (saved := self.runner.ckpt.get(key)) is not None:
            value = read(saved) if read is not None else saved
            self.runner.budget.add({}, metric_calls=metric_calls)
        else:
            share, own, value = self.runner.budget.reserve(stage, metric_calls), self._own_meter(), None
            try:
                with dspy.context(usage_tracker=own):
                    value = await make()
            finally:
                self._spent(stage, share, own, value, metric_calls)
            if key is not None and (kept := record(value)) is not None:
                self.runner.ckpt.put(key, kept)
        self._done(stage, failure(value))
        return value

    def _own_meter(self) -> UsageMeter:
        return UsageMeter(self.runner.prices, self.runner.custom_prices)

    def _spent(self, stage: str, share: dict, own: UsageMeter, value: Any, metric_calls: int) -> None:
        """A unit has ended: what its own meter saw goes to the stage's meter and to the budget (no metric call for an
        attempt that got no answer), and a step's usage so far is saved, so that a resume knows what it had spent; the
        first call made outside the predictors is said."""
        runner = self.runner
        self.meter(stage).absorb(own.usage_data)
        failed = isinstance(value, Attempt) and value.failed
        runner.budget.release(stage, share, own.totals(), 0 if failed else metric_calls)
        if own.usage_data and self.usage_key is not None and runner.ckpt.root is not None:
            runner.keep(self.usage_key, self.usage())
        direct = sum(e["direct"] for entries in list(own.usage_data.values()) for e in entries
                     ) if role(stage) == "policy" else 0  # (a metric may call its judge LM as it likes)
        with runner.lock:  # said once per run, whichever unit's thread sees it first
            first, runner.direct_calls = direct and not runner.direct_calls, runner.direct_calls + direct
        if first:
            logger.warning("The program called an LM outside its predictors (dspy.settings.lm(...) or an LM of its own, "
                           "called directly): tfgrpo puts what it learns into the predictors' instructions and demos, "
                           "so those calls get none of it. Make them through a dspy.Predict to have them learn too.")

    def _done(self, stage: str, error: str | None) -> None:
        """A unit of `stage` has ended (`error`: it failed): counted and timed."""
        self.finished[stage] = time.time()
        with self._lock:
            counted = self.failures.setdefault(stage, StageFailures())
            counted.units += 1
            counted.errors += [error] if error else []

    def attempt(self, stage: str, key: str | None, program: dspy.Module, example: dspy.Example, *,
                score: bool = False) -> Attempt:
        """One attempt of `program` (with its own LM copies) on `example`, a unit of `stage`; with `score`, then scored
        (`score`) in the same unit: a `Scored` (its reward None where it got no answer, `timeout` where the metric call
        timed out). Saved under `key` unless it raised or timed out (a resume runs it again); counted as a failure when
        it did (a reply that came back and did not parse is the program's own 0: no failure)."""
        runner = self.runner

        def make() -> Attempt:
            attempt = runner.ray.attempt(program, example) if runner.ray is not None else run_program(program,
                                                                                                      example)[1]
            return self.score(None, attempt, example) if score else attempt
        attempt = self.unit(stage, key, make, read=lambda saved: typed(program, (Scored if score else Attempt
                                                                                 ).from_record(saved)),
                            record=_attempt_record, failure=_attempt_failure, metric_calls=1)
        self._say_clipped("attempt", attempt.text_chars)
        return attempt

    async def aattempt(self, stage: str, key: str | None, program: dspy.Module, example: dspy.Example, *,
                       score: bool = False) -> Attempt:
        """`attempt` as a coroutine on the async workers' loop (backend="async")."""
        async def make() -> Attempt:
            attempt = await arun_attempt(program, example, self.work)
            return await self.work.offload(self.score, None, attempt, example) if score else attempt
        attempt = await self.aunit(stage, key, make, read=lambda saved: typed(program, (Scored if score else Attempt
                                                                                        ).from_record(saved)),
                                   record=_attempt_record, failure=_attempt_failure, metric_calls=1)
        self._say_clipped("attempt", attempt.text_chars)
        return attempt

    def attempts(self, stage: str, jobs: list[tuple[str | None, dspy.Module, dspy.Example]], *,
                 score: bool = False) -> list[Attempt]:
        """`attempt(stage, key, program, example, score=score)` for each job (key, program, example), on the workers:
        as coroutines with backend="async", else on the pool's threads."""
        if isinstance(self.work, AsyncWorkers):
            self.meter(stage)
            return self.work.gather(stage, [functools.partial(self.aattempt, stage, *job, score=score) for job in jobs])
        return self.map(stage, lambda job: self.attempt(stage, *job, score=score), jobs)

    def scored(self, stage: str, jobs: list[tuple[str | None, dspy.Module, dspy.Example]]) -> list[Scored]:
        """`attempts(stage, jobs, score=True)`: each attempt scored in its own unit (the probe, validation, the
        attribution)."""
        return self.attempts(stage, jobs, score=True)

    def score(self, key: str | None, attempt: Attempt, example: dspy.Example, g: int = 0, *,
              save: bool = True) -> Scored:
        """The metric on an attempt against `example` (the ground truth, or its group's majority answer), as one unit of
        the "reward" stage, so that the calls of a metric that calls an LM (an LLM judge) count in the budget and in the
        run's usage: the score saved under `key`, or made and (with `save`) saved there; a metric call that timed out
        scores 0 with its message in `timeout`, unsaved. `g`: which of its query's attempts it is. An attempt that got
        no answer is never scored."""
        if attempt.failed:
            return Scored.of(attempt, {}, g)
        scored = self.unit("reward", key, lambda: score_attempt(self.runner.metric, example, attempt,
                                                                self.knobs.metric_timeout_s, g),
                           read=lambda saved: Scored.of(attempt, saved, g),
                           record=lambda s: s.score_record() if save and s.timeout is None else None)
        self._say_clipped("feedback", scored.feedback_chars)
        return scored

    def _say_clipped(self, kind: str, chars: int | None) -> None:
        """Say once per run that an attempt's text, or the metric's feedback on it (`kind`), was cut for the learning
        calls (`chars`: its length before; None: not cut)."""
        if chars is None:
            return
        with self.runner.lock:
            first = kind not in self.runner.clipped
            self.runner.clipped.add(kind)
        if first:
            limit, what = CUTS[kind]
            logger.warning("%s ran to %d characters: the learning calls read it cut to %d (its head and tail; "
                           "further cuts are not said again)", what, chars, limit)

    def call(self, stage: str, name: str, fn: Callable[[], Any], *, returns: Any = None) -> Any:
        """One learning call (see `calls`)."""
        return self.calls(stage, {name: fn}, returns=returns)[0]

    def calls(self, stage: str, units: dict[str, Callable[[], Any]], *, returns: Any = None) -> list[Any]:
        """Learning calls on the scope's workers, in order (`units`: name -> fn): each the value saved under the
        scope's `prefix/name` (read back as the type `returns`, a pydantic model, dataclass or `list[...]` of them;
        None: as its JSON), or `fn()` (charged, metered under `stage`) saved as JSON; one that raises is a `Failed`,
        counted as a failure of its stage. Where one failed and the stage's failure check has not passed yet, `Held`
        is raised once all have ended: the caller stops there until the step has checked the stage over every group;
        asked again, the same names give the same values (a failed one its `Failed`), with no new call."""
        read = pydantic.TypeAdapter(returns).validate_python if returns is not None else None

        def one(name: str) -> Any:
            key = self.key(name)
            if key not in self._values:  # (asked again, as a held group goes on: as it was, not counted again)
                self._values[key] = self.unit(stage, key, functools.partial(_or_failed, units[name]), read=read)
            return self._values[key]
        values = self.map(stage, one, list(units))
        if stage not in self.checked and any(isinstance(v, Failed) for v in values):
            raise Held(stage)
        return values

    def key(self, name: str) -> str:
        """Where the learning call `name` of this scope is saved."""
        return f"{self.prefix}/{name}"

    def check(self, stage: str) -> None:
        """Stop the scope, unfinished, when more than `max_failure_rate` of the stage's units failed: a resume redoes
        the failed units."""
        counted = self.failures.get(stage, StageFailures())
        if counted.units and len(counted.errors) > self.knobs.max_failure_rate * counted.units:
            units = "attempts" if role(stage) == "policy" else f"{stage} calls"
            where = str(self.runner.ckpt.root) if self.runner.ckpt.root is not None else None
            raise TooManyFailuresError(f"{self.name}: {len(counted.errors)} of {counted.units} {units} failed (first: "
                                       f"{counted.errors[0]}); finished work is kept in log_dir={where!r}")
        self.checked.add(stage)


class Held(BaseException):
    """A group met failed learning calls at `stage` (`Scope.calls`) before the stage's failure check: it stops there,
    and the step goes on with it once the check has passed over every group. (A BaseException, as a path's own
    `except Exception` must not take it for its call's error.)"""

    def __init__(self, stage: str, keep: dict[str, Any] | None = None):
        super().__init__(stage)
        self.stage, self.keep = stage, keep or {}  # keep: what the group saves once the check has passed, by key


def _why(exc: BaseException, history: list[dict]) -> str:
    """A failed learning call's error as text; where its reply had nothing in it, what came back (no choices, a filter,
    a cut, only reasoning: `empty_reply` over the call's `history`) and the fix that fits, first, since the error's
    own text is long and its end gets cut in logs."""
    text = f"{type(exc).__name__}: {exc}"
    if EMPTY_REPLY not in text:
        return text
    kind = empty_reply(history)
    said = EMPTY_REPLIES[kind] if kind else ("the reflection LM's reply had nothing in it (no choices, or an empty "
                                             "content); its history was off, so what came back is not known")
    return f"{said} ({text})"
