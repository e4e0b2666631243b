"""What a step works with: the run (`Run`, fixed while it lasts), what a step changes (`State`), and the `Scope` of one
step, validation or attribution, whose verbs run every unit of work:

    scope.attempts(stage, [(program, example), ...])   the program on each example, on the run's backend
    scope.score(attempt, example)                      the metric on one (stage "reward")
    scope.calls(stage, [fn, ...])                      learning calls (a raised one comes back as a `Failed`)
    scope.map(stage, fn, items) / scope.each(fn, items)   any other units / a step's groups side by side
    scope.check(stage)                                 the stage's failure check

Every LM call a unit makes leaves through the run's record (record.py), under the unit's scope and stage: answered
from it where it asked the same before, else charged to the budget, sent and recorded. So a scope saves nothing of its
own: a resume runs its units again and their calls come back from the record.

An attempt the provider did not answer has no answer: an LM call that failed (an `LMError`: a rate limit, a timeout,
a lost connection, a prompt refused for its length or content), or a reply with nothing in it (no choices, or a
content filter's or a length cut's empty content). It is never scored; the step leaves it out of its group and the
probe and counts it in `failed_calls`, and a validation leaves it out of its score. Any other error of the program (a
reply with content that does not parse, a tool that raises) is the program's own doing: it scores 0.

Failures are counted in one place, the scope, by stage: an attempt that failed, a metric call that timed out, a
learning call that raised. `check(stage)` stops the scope with `TooManyFailuresError` when more than
`max_failure_rate` of the stage's units failed; where the stage's count of units is known beforehand (`expect`), the
scope stops as soon as its failures pass that share of it, so an outage does not run the step to its end first.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import dspy

from tfgrpo.base.util import digest, jsonable
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.record import TAG, Record, Tag, install, role
from tfgrpo.optimizers.records import Attempt, Demo, Failed, Group, Lessons, Scored, Verdict
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.optimizers.workers import EMPTY_REPLIES, EMPTY_REPLY, Cancelled, StageBars, Threads, backend, empty_reply
from tfgrpo.programs.library import ApplyReport, ExperienceLibrary
from tfgrpo.programs.render import MAX_ATTEMPT_CHARS, MAX_FEEDBACK_CHARS

logger = logging.getLogger(__name__)

CONTEXT_REFUSALS = ("contextwindowexceeded", "context length", "context_length_exceeded", "maximum context",
                    "context window", "exceeds the available context size")  # LiteLLM, OpenAI, vLLM, llama.cpp
# what may be cut for the learning calls: kind -> (the length kept, what it is)
CUTS = {"attempt": (MAX_ATTEMPT_CHARS, "An attempt"),
        "feedback": (MAX_FEEDBACK_CHARS, "The metric's feedback on an attempt")}


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
    the reflection LM, the program and its target predictors, the trainset, the record of its calls, its backend and
    its store (the finished steps and validations in log_dir). `with Run(...) as run:` closes the backend and the
    record at the end."""

    knobs: Knobs
    metric: Callable
    record: Record = field(default_factory=lambda: Record(None))
    backend: Threads | None = None
    store: Checkpoint = field(default_factory=lambda: Checkpoint(None))
    path: LearningPath | None = None
    path_name: str = ""
    reflection_lm: dspy.BaseLM | None = None
    program: dspy.Module | None = None
    targets: list[str] = field(default_factory=list)
    trainset: list = field(default_factory=list)
    instructions: str = ""  # the program's own instructions (what a rule may repeat)
    roles: dict[str, str] = field(default_factory=dict)  # several target predictors: each one's name and what it does
    # (the learning calls are told them and place each experience on some); one: empty, and nothing is placed
    library_tokens: int | None = None  # `max_library_tokens` as plan() resolved it (None: no cap)
    count_tokens: Callable[[str], int] | None = None  # the policy model's tokens in a text, as plan() counts them

    def __post_init__(self):
        install()  # (once per process: every LM call of a unit leaves through its run's record)
        if self.backend is None:
            object.__setattr__(self, "backend", backend(self.knobs))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.backend.close(interrupted=kind is not None and issubclass(kind, KeyboardInterrupt))
        self.record.close()


@dataclass(frozen=True)
class State:
    """What a step changes: the library and demos the program carries, the demo candidates found for the next step
    (`pending`), the steps done, and where the probe found each program's attempts (`probed`: by the program's digest,
    each probe query's step, whose rollout ID the program's attempt on it keeps while the program stays the same)."""

    library: ExperienceLibrary
    demos: list[Demo] = field(default_factory=list)
    pending: list[Demo] = field(default_factory=list)
    step: int = 0
    probed: dict[str, dict[str, int]] = field(default_factory=dict)

    def apply(self, verdict: Verdict, sources: list[str], *, quiet: bool = False, fold_at: float | None = None
              ) -> tuple[State, ApplyReport]:
        """The state after a step: the verdict's operations validated and applied in code, all or nothing per operation,
        to a copy of the library (`sources`: the queries they came from; `quiet`: a probe said its refusals already;
        `fold_at`: `duplicate_overlap`)."""
        library = self.library.copy()
        report = library.apply(verdict.plan, step=self.step, sources=sources, quiet=quiet, fold_at=fold_at)
        probed = {program: {**verdict.probed.get(program, {}), **self.probed.get(program, {})}
                  for program in {*self.probed, *verdict.probed}}  # (a query's first step stays)
        return State(library=library, demos=verdict.demos, pending=verdict.found, step=self.step + 1,
                     probed=probed), report

    def to_record(self) -> dict:
        return {"library": self.library.dump_state(), "demos": [d.to_record() for d in self.demos],
                "found": [d.to_record() for d in self.pending], "probed": self.probed}

    @classmethod
    def from_record(cls, rec: dict, step: int) -> State:
        return cls(library=ExperienceLibrary.from_state(rec["library"]),
                   demos=[Demo.from_record(d) for d in rec.get("demos", [])],
                   pending=[Demo.from_record(d) for d in rec.get("found", [])], step=step,
                   probed=rec.get("probed", {}))


@runtime_checkable
class LearningPath(Protocol):
    """How one step's groups with reward contrast become a plan of library operations (step.py holds the
    paper's path, contrast_path.py the contrast path). `learn` makes one group's learning calls through the step's
    `scope` (`scope.call`, `scope.calls`; groups run side by side, each as soon as its attempts are scored) and returns
    what `finish` needs; `finish` turns every group's result into the step's `Lessons`. `stages` names the stages its
    calls are charged and checked under. An instance holds settings only: one serves every step."""

    stages: tuple[str, ...] = ()

    def learn(self, run: Run, scope: Scope, library: ExperienceLibrary, group: Group) -> Any: ...

    def finish(self, run: Run, scope: Scope, library: ExperienceLibrary, results: list[tuple[Group, Any]]
               ) -> Lessons: ...


class Scope:
    """One step, validation or attribution of `run` (`name`: how errors, logs and the record name it): its units' failure
    counts by stage, when each stage's last unit ended (`finished`), and a progress bar per stage. `with scope:` waits,
    when the block raises, for the units still running (none starts after it; never on Ctrl-C)."""

    def __init__(self, run: Run, name: str):
        self.run, self.name, self.knobs = run, name, run.knobs
        self.failures: dict[str, StageFailures] = {}
        self.expected: dict[str, int] = {}  # stage -> its units, where known beforehand (`expect`)
        self.finished: dict[str, float] = {}
        self._counts: dict[str, list[int]] = {}  # stage -> [done, submitted], for the progress bars
        self._bars = StageBars()
        self.progress = run.knobs.progress or self._bars
        self._futures: list[concurrent.futures.Future] = []
        self._lock, self._stopped = threading.Lock(), threading.Event()

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is not None:
            self._stopped.set()
            for future in self._futures:
                future.cancel()  # (a unit not started yet)
            if not issubclass(kind, KeyboardInterrupt):
                concurrent.futures.wait(self._futures)
        self._bars.close()

    def tag(self, stage: str, unit: str | None = None) -> dict:
        """The DSPy setting under which a unit of `stage` runs (`dspy.context(**scope.tag(stage))`): its calls are
        answered, charged and recorded by the run's record, under this scope and `stage` (and an attempt's `unit`)."""
        return {TAG: Tag(self.run.record, self.name, stage, unit)}

    # -- running units ----------------------------------------------------------------------------------------------
    def map(self, stage: str, fn: Callable[[Any], Any], items: list) -> list:
        """`[fn(item) for item in items]` on the run's workers, each under `stage`'s tag, in order."""
        return self._wait(stage, [self.run.backend.submit(functools.partial(self._unit, stage, fn, item))
                                  for item in items])

    def _unit(self, stage: str, fn: Callable[[Any], Any], item: Any) -> Any:
        self._go_on()
        with dspy.context(**self.tag(stage)):
            value = fn(item)
        self._ended(stage, value.metric_failed if isinstance(value, Scored) else None)  # (a metric that failed)
        return value

    def each(self, fn: Callable[[Any], Any], items: list) -> list:
        """`[fn(item) for item in items]`, each item (a group of a step) on a thread of its own, side by side with the
        others, its units on the run's workers; in order."""
        return self._wait(None, [self.run.backend.spawn(functools.partial(fn, item)) for item in items])

    def _wait(self, stage: str | None, futures: list[concurrent.futures.Future]) -> list:
        """The futures' results in order. The first that raised stops the scope (no unit starts after it) and is raised
        once the others have ended."""
        with self._lock:
            self._futures += futures
            if stage is not None:
                self._counts.setdefault(stage, [0, 0])[1] += len(futures)
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
            self._stopped.set()
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            raised = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            raise next((e for e in raised if not isinstance(e, Cancelled)), raised[0])
        return [f.result() for f in futures]

    def _go_on(self) -> None:
        if self._stopped.is_set():  # another unit of the scope failed: its error is raised instead
            raise Cancelled()

    def _ended(self, stage: str, error: str | None = None) -> None:
        """A unit of `stage` has ended (`error`: it failed): counted, timed and shown; past the failures the stage's
        expected count allows, the scope stops."""
        with self._lock:
            self.finished[stage] = time.time()
            counted = self.failures.setdefault(stage, StageFailures())
            counted.units += 1
            counted.errors += [error] if error else []
            over = error and stage in self.expected and len(counted.errors) > self.knobs.max_failure_rate * \
                self.expected[stage]
            done = self._counts.setdefault(stage, [0, 0])
            done[0] += 1
            self.progress(stage, *done)
        if over:
            self._too_many(stage)

    def expect(self, stage: str, units: int) -> None:
        """`stage` makes `units` units in this scope: once more than `max_failure_rate` of them have failed, it stops."""
        with self._lock:
            self.expected[stage] = self.expected.get(stage, 0) + units

    def check(self, stage: str) -> None:
        """Stop the scope, unfinished, when more than `max_failure_rate` of the stage's units failed (a resume makes
        them again)."""
        counted = self.failures.get(stage, StageFailures())
        if counted.units and len(counted.errors) > self.knobs.max_failure_rate * counted.units:
            self._too_many(stage)

    def _too_many(self, stage: str) -> None:
        counted = self.failures[stage]
        units = {"policy": "attempts", "metric": "metric calls"}.get(role(stage), f"{stage} calls")
        where = str(self.run.store.root) if self.run.store.root is not None else None
        raise TooManyFailuresError(f"{self.name}: {len(counted.errors)} of {max(counted.units, self.expected.get(stage, 0))}"
                                   f" {units} failed (first: {counted.errors[0]}); every reply so far is kept in "
                                   f"log_dir={where!r}")

    # -- attempts ---------------------------------------------------------------------------------------------------
    def attempts(self, stage: str, jobs: list[tuple[dspy.Module, dspy.Example]], *, score: bool = False
                 ) -> list[Attempt]:
        """An attempt of each (program, example) of `jobs` on the run's backend (`attempt`); with `score`, each scored
        against its example in its own unit (a `Scored`)."""
        return self._wait(stage, [self.run.backend.submit_attempt(self, stage, program, example, score=score)
                                  for program, example in jobs])

    def scored(self, stage: str, jobs: list[tuple[dspy.Module, dspy.Example]]) -> list[Scored]:
        """`attempts(stage, jobs, score=True)` (the probe, validation, the attribution)."""
        return self.attempts(stage, jobs, score=True)

    def attempt(self, stage: str, program: dspy.Module, example: dspy.Example, *, score: bool = False) -> Attempt:
        """One attempt of `program` (with its own LM copies) on `example`, a unit of `stage`, its metric call charged
        before it starts (`max_metric_calls`); with `score`, scored too. Counted as a failure when it raised (a reply
        that came back and did not parse is the program's own 0: no failure) or its metric call timed out."""
        self._go_on()
        share, attempt = self.run.record.charge_attempt(self.name), None
        try:
            with dspy.context(**self.tag(stage, unit(program, example))):
                attempt = self.run.backend.run(program, example)
        finally:
            self.run.record.attempt_ended(self.name, stage, share, answered=attempt is not None and not attempt.failed)
        attempt = self.score(attempt, example) if score else attempt
        self._said(stage, attempt)
        return attempt

    async def aattempt(self, stage: str, program: dspy.Module, example: dspy.Example, *, score: bool = False
                       ) -> Attempt:
        """`attempt` as a coroutine (backend="async"): the program through its async path, the metric on a thread."""
        self._go_on()
        share, attempt = self.run.record.charge_attempt(self.name), None
        try:
            with dspy.context(**self.tag(stage, unit(program, example))):
                attempt = await self.run.backend.arun(program, example)
        finally:
            self.run.record.attempt_ended(self.name, stage, share, answered=attempt is not None and not attempt.failed)
        attempt = await self.run.backend.offload(self.score, attempt, example) if score else attempt
        self._said(stage, attempt)
        return attempt

    def _said(self, stage: str, attempt: Attempt) -> None:
        self._say_clipped("attempt", attempt.text_chars)
        # (a reply that came back and did not parse is the program's own 0, no outage)
        self._ended(stage, None if attempt.unparsed else attempt.error or getattr(attempt, "metric_failed", None))

    def score(self, attempt: Attempt, example: dspy.Example, g: int = 0) -> Scored:
        """The metric on an attempt against `example` (the ground truth, or its group's majority answer), under the
        "reward" stage: the calls of a metric that calls an LM (an LLM judge) are charged and recorded there. A metric
        call that timed out scores 0 with its message in `timeout`. `g`: which of its query's attempts it is. An
        attempt that got no answer is never scored."""
        if attempt.failed:
            return Scored.of(attempt, {}, g)
        with dspy.context(**self.tag("reward")):
            scored = score_attempt(self.run.metric, example, attempt, self.knobs.metric_timeout_s, g)
        self._say_clipped("feedback", scored.feedback_chars)
        return scored

    def _say_clipped(self, kind: str, chars: int | None) -> None:
        """Say once per process that an attempt's text, or the metric's feedback on it (`kind`), was cut for the
        learning calls (`chars`: its length before; None: not cut)."""
        if chars is None or kind in _CLIPPED:
            return
        _CLIPPED.add(kind)
        limit, what = CUTS[kind]
        logger.warning("%s ran to %d characters: the learning calls read it cut to %d (its head and tail; further cuts "
                       "are not said again)", what, chars, limit)

    # -- learning calls ---------------------------------------------------------------------------------------------
    def calls(self, stage: str, fns: list[Callable[[], Any]]) -> list[Any]:
        """Learning calls on the run's workers, in order: each `fn()` (its LM calls charged and recorded under
        `stage`, told apart by their place in `fns`: two calls that ask the same, of two attempts alike, get each its own
        reply back on a resume), or the `Failed` it raised, counted as a failure of the stage."""
        return self._wait(stage, [self.run.backend.submit(functools.partial(self._call, stage, fn, f"{stage}#{i}"))
                                  for i, fn in enumerate(fns)])

    def _call(self, stage: str, fn: Callable[[], Any], unit: str) -> Any:
        self._go_on()
        with dspy.context(**self.tag(stage, unit)):
            value = _or_failed(fn)
        self._ended(stage, value.error if isinstance(value, Failed) else None)
        return value

    def call(self, stage: str, fn: Callable[[], Any]) -> Any:
        """One learning call (see `calls`)."""
        return self.calls(stage, [fn])[0]


_CLIPPED: set[str] = set()  # what this process has said was cut for the learning calls


def unit(program: dspy.Module, example: dspy.Example) -> str:
    """What tells an attempt from the others of its run: its example's inputs and its LMs' rollout IDs."""
    rollouts = sorted({str((p.lm.kwargs or {}).get("rollout_id")) for p in program.predictors() if p.lm is not None})
    return digest([jsonable(dict(example.inputs())), rollouts])


def _or_failed(fn: Callable[[], Any]) -> Any:
    """`fn()`, a learning call, or the `Failed` it raised (a failed learning call is counted, not fatal). The call's
    LM replies are recorded on a module of its own in DSPy's caller list, so that a reply with nothing in it can be
    named."""
    replies = dspy.Module()
    try:
        with dspy.context(caller_modules=[*(dspy.settings.caller_modules or []), replies]):
            return fn()
    except Exception as exc:
        return Failed(_why(exc, replies.history))


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
