"""The runner: every unit of work of a run goes through one `Runner`.

A unit is one attempt of a program on a query (a rollout, a probe attempt, a validation or attribution run), its score,
or one learning call. For each unit the runner

  1. reuses it from the checkpoint, when a run before this one finished it;
  2. charges the budget before it starts (`Budget`): its expected tokens, dollars and metric call must fit in what is
     left beside the units in flight, else the run stops with `BudgetExhausted`, nothing half-written;
  3. runs it on the scope's bounded pool, metered by stage, priced by the models' prices, and saves it;
  4. counts it as a failure when it raised (save a reply with content that did not parse: the program's own 0), and
     stops the scope with `TooManyFailuresError` when more than `max_failure_rate` of a stage's units failed: an
     outage must not pass for "nothing to learn".

An attempt the provider did not answer has no answer: an LM call that failed (an `LMError`: a rate limit, a timeout,
a lost connection, a prompt refused for its length or content), or a reply with nothing in it (no choices, or a
content filter's or a length cut's empty content). It is never scored; the step leaves it out of its group and the
probe and counts it in `failed_calls`, and a validation leaves it out of its score. Any other error of the program (a
reply with content that does not parse, a tool that raises) is the program's own doing: it scores 0.

A scope is one step, one validation or one attribution: its own pool, meters, failure counts and gates, opened with
`with runner.scope(...)`. Calls and tokens come from DSPy's usage-tracker hook, which every call that reaches the
provider reports to (replies from DSPy's cache are not counted); dollars are tokens times the model's price (DSPy's
copy of LiteLLM's price map, or `prices=`), cached prompt tokens at the cached price.

Every read and write of the checkpoint goes through the runner: the units through its verbs (`attempt`, `scored`,
`score`, `call`, `calls`), the step's and the run's own records (a finished step, its usage so far, a validation, the
attribution) through `record` and `keep`. Its concurrency is one seam: `Workers`, a bounded pool whose `map` runs a
stage's units and whose `each` runs a step's groups side by side; another backend (asyncio, a cluster) takes its place
behind the same two verbs without the step changing. With `backend="ray"` the pool's threads stay the units in flight
and each attempt's body (the program run, and its metric where the unit scores it) runs as a task on a Ray cluster
(`RayAttempts`); everything else of a unit (the checkpoint, the budget, the meters, the failure count) stays here.
Below the runner: that pool, the meters that price every call, and the budget they are charged to.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import queue
import re
import statistics
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import dspy
import pydantic
import tqdm
from dspy.utils.callback import BaseCallback
from dspy.utils.exceptions import AdapterParseError, LMError
from dspy.utils.usage_tracker import UsageTracker

from tfgrpo.base.util import clip, digest, jsonable
from tfgrpo.optimizers.checkpoint import Checkpoint, RunMismatchError
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import Attempt, Failed
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.programs.render import MAX_ATTEMPT_CHARS, MAX_FEEDBACK_CHARS, count_tool_calls, format_attempt

logger = logging.getLogger(__name__)

CONTEXT_REFUSALS = ("contextwindowexceeded", "context length", "context_length_exceeded", "maximum context",
                    "context window", "exceeds the available context size")  # LiteLLM, OpenAI, vLLM, llama.cpp


# -- running a program ------------------------------------------------------------------------------------------------
def with_own_lms(program: dspy.Module, **overrides: Any) -> dspy.Module:
    """A deep copy of `program` whose predictors call private copies of their LMs (the predictor's own, else
    `dspy.settings.lm`), with `overrides` (such as rollout_id, temperature) set on the copies. A temperature is not set
    on a model that takes only its own (`fixed_temperature`)."""
    program = program.deepcopy()
    copies: dict[int, dspy.BaseLM] = {}
    for name, predictor in program.named_predictors():
        base = predictor.lm or dspy.settings.lm
        if base is None:
            raise ValueError(f"predictor {name!r} has no LM: call dspy.configure(lm=dspy.LM(...)) or set one on it")
        if id(base) not in copies:
            keep = fixed_temperature(base) is not None
            copies[id(base)] = base.copy(**{k: v for k, v in overrides.items() if not (keep and k == "temperature")})
        predictor.lm = copies[id(base)]
    return program


def fixed_temperature(lm: dspy.BaseLM) -> float | None:
    """The temperature a model requires (OpenAI's o-series and gpt-5 reasoning models take only 1.0), else None."""
    family = str(getattr(lm, "model", "")).split("/")[-1].lower()
    reasoning = re.match(r"^(o[1345](-(mini|nano|pro))?(-\d{4}-\d{2}-\d{2})?|gpt-5(\.\d+)*(?!-chat)(-.*)?)$", family)
    return 1.0 if reasoning else None


def run_program(program: dspy.Module, example: dspy.Example) -> tuple[dspy.Prediction | None, dict]:
    """Run `program` on `example`'s inputs (an async-only program, with `aforward` and no `forward`, through its event
    loop). Returns the prediction (None when the program raised) and a JSON record of the run: `outputs`, `error` (the
    exception as text; never raised), `failed` (the error is an LM call's), `unparsed` (the error is a reply with
    content the adapter could not parse), `trace` (every predictor call: name, inputs, outputs, whole) and
    `tool_calls`."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            if not hasattr(type(program), "forward") and hasattr(type(program), "aforward"):  # an async-only program
                prediction = asyncio.run(program.acall(**example.inputs()))
            else:
                prediction = program(**example.inputs())
        outputs, error, failed, unparsed = jsonable(dict(prediction.items())), None, False, False
    except Exception as exc:
        prediction, outputs, error, failed, unparsed = None, None, f"{type(exc).__name__}: {exc}", False, False
        cause = exc
        while cause is not None and not failed:  # the provider's failure or empty reply, wherever in the chain
            failed, unparsed = no_answer(cause), unparsed or isinstance(cause, AdapterParseError)
            cause = cause.__cause__ or cause.__context__
        unparsed = unparsed and not failed
    names = {id(predictor): name for name, predictor in program.named_predictors()}
    steps = [{"predictor": names.get(id(predictor), type(predictor).__name__), "inputs": jsonable(inputs),
              "outputs": jsonable(dict(out.items()))} for predictor, inputs, out in trace]
    return prediction, {"outputs": outputs, "error": error, "failed": failed, "unparsed": unparsed, "trace": steps,
                        "tool_calls": count_tool_calls(outputs)}


# -- the runner -------------------------------------------------------------------------------------------------------
# what a record says was cut for the learning calls: kind -> (its key, the length kept, what it is)
CUTS = {"attempt": ("attempt_chars", MAX_ATTEMPT_CHARS, "An attempt"),
        "feedback": ("feedback_chars", MAX_FEEDBACK_CHARS, "The metric's feedback on an attempt")}


class Runner:
    """Runs every unit of work of a run (see the module docstring): `attempt` (a program on an example, scored in the
    same unit or later by `score`), `scored` (attempts scored: the probe, validation, the attribution) and `call` (a
    learning call), each checkpointed, charged to the run's `budget` (the knobs' budgets) and metered by stage, priced
    by the knobs' `prices` or LiteLLM's map; `map` runs any function on the scope's pool (`work.each`: one thread per
    group). Open a `scope()` around each step, validation or attribution."""

    def __init__(self, knobs: Knobs, metric: Callable, ckpt: Checkpoint | None = None):
        self.knobs, self.metric, self.ckpt = knobs, metric, ckpt or Checkpoint(None)
        self.budget, self.custom_prices, self.prices = Budget(knobs), knobs.prices, {}
        self.spent: dict[str, dict] = {"policy": {}, "reflection": {}}  # by this process, every scope
        self.unrecorded: dict[str, dict] = {}  # by stage, what no step record holds (validation, attribution, a stop)
        self.direct_calls = 0  # LM calls of the program outside its predictors (they get no library)
        self.clipped: set[str] = set()  # what was cut for the learning calls: "feedback", "attempt" (each said once)
        self._lock, self._cond = threading.Lock(), threading.Condition()
        self.name = self.prefix = ""
        self.meters, self.failures, self.finished, self.work, self.tally = {}, {}, {}, None, lambda usage: None
        self.ray = RayAttempts(knobs.prices) if knobs.backend == "ray" else None

    @contextlib.contextmanager
    def scope(self, name: str, groups: list = (), *, prefix: str = "", tally: Callable[[dict], None] | None = None):
        """A step, validation or attribution (`name`, as errors say it): its pool, its meters by stage (`meter`), its
        failure counts (`check`), and the groups (`groups`, each on a thread of its own) whose stages `settle` waits
        on. `tally(usage)` is told after each unit; learning calls are saved under `prefix` (the step's folder). An
        enclosing `dspy.track_usage()` receives every call of the scope once, as it ends."""
        self.prefix, self.name, self.meters, self.failures, self.finished = prefix, name, {}, {}, {}
        self.recorded = False  # a step sets it once its record holds the scope's usage
        self.tally, outer, bars = tally or (lambda usage: None), dspy.settings.usage_tracker, StageBars()
        self.expect(groups)
        with Workers(self.knobs.num_threads, progress=self.knobs.progress or bars, meters=self.meters) as self.work:
            try:
                yield self
            except KeyboardInterrupt:
                if self.ray is not None:  # Ctrl-C ends the run's tasks on the cluster too
                    self.ray.cancel()
                raise
            finally:
                bars.close()
                for stage, meter in self.meters.items():
                    add_usage(self.spent[ROLE.get(stage, "reflection")], meter.totals())
                    if not self.recorded:  # a validation, an attribution, a step stopped part way
                        add_usage(self.unrecorded.setdefault(stage, {}), meter.totals())
                    for lm, entries in (meter.usage_data.items() if outer is not None else ()):
                        outer.usage_data[lm].extend(entries)

    def meter(self, stage: str) -> UsageMeter:
        """The stage's meter in this scope (`meter(stage).totals()`: its calls, tokens and dollars so far)."""
        with self._lock:
            if stage not in self.meters:
                self.meters[stage] = UsageMeter(self.prices, self.custom_prices)
            return self.meters[stage]

    def map(self, stage: str, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]` on the scope's pool, shown as `stage`."""
        self.meter(stage)
        return self.work.map(stage, fn, items)

    # -- units ----------------------------------------------------------------------------------------------------
    def _unit(self, stage: str, fn: Callable[[], Any], metric_calls: int = 0) -> Any:
        """Run `fn` as one unit of `stage`: charged before it starts, under a meter of its own, then counted."""
        share, own = self.budget.reserve(stage, metric_calls), UsageMeter(self.prices, self.custom_prices)
        value = None
        try:
            with dspy.context(usage_tracker=own):
                value = fn()
        finally:
            self.meter(stage).absorb(own.usage_data)
            failed = isinstance(value, dict) and value.get("failed")
            self.budget.release(stage, share, own.totals(), 0 if failed else metric_calls)
        direct = sum(e["direct"] for entries in list(own.usage_data.values()) for e in entries)
        with self._lock:  # said once per run, whichever unit's thread sees it first
            first, self.direct_calls = direct and not self.direct_calls, self.direct_calls + direct
        if first:
            logger.warning("The program called an LM outside its predictors (dspy.settings.lm(...) or an LM of its own, "
                           "called directly): tfgrpo puts what it learns into the predictors' instructions and demos, "
                           "so those calls get none of it. Make them through a dspy.Predict to have them learn too.")
        return value

    def _done(self, stage: str, error: str | None) -> None:
        """A unit of `stage` has ended (`error`: it failed): counted, timed (`finished`: when the stage's latest unit
        ended), and the scope's usage told to its tally."""
        self.finished[stage] = time.time()
        with self._lock:
            errors, total = self.failures.get(stage, ([], 0))
            self.failures[stage] = (errors + ([error] if error else []), total + 1)
        if self.ckpt.root is not None:  # (a tally is saved in the checkpoint: none, none to keep)
            self.tally({s: meter.totals() for s, meter in list(self.meters.items())})

    def attempt(self, stage: str, key: str | None, program: dspy.Module, example: dspy.Example, *,
                score: bool = False) -> dict:
        """One attempt of `program` (with its own LM copies) on `example`, scored in the same unit with `score`: its
        record (outputs, error, `failed` when its LM call failed, trace, the attempt's text; with `score`, `reward`,
        None for a failed one, `feedback`, and `timeout` for a metric call that timed out). Saved under `key` unless
        it raised or timed out (a resume runs it again); counted as a failure when it did."""
        if key is not None and (record := self.ckpt.get(key)) is not None:
            self.budget.add({}, metric_calls=1)  # reused: it counts in the run's metric calls all the same
        else:
            metric, body = self.metric if score else None, _attempt_record if self.ray is None else self.ray.attempt
            record = self._unit(stage, lambda: body(program, example, metric, self.knobs.metric_timeout_s),
                                metric_calls=1)
            if key is not None and not record["error"] and "timeout" not in record:
                self.ckpt.put(key, record)
        # a reply that came back and did not parse is the program's own 0, no outage: it does not count as a failure
        self._done(stage, None if record.get("unparsed") else record["error"] or record.get("timeout"))
        self._say_clipped(record)
        return record

    def scored(self, stage: str, jobs: list[tuple[str | None, dspy.Module, dspy.Example]]) -> list[dict]:
        """`attempt(stage, key, program, example, score=True)` for each job (key, program, example), on the pool."""
        return self.map(stage, lambda job: self.attempt(stage, *job, score=True), jobs)

    def score(self, key: str, attempt: Attempt, example: dspy.Example) -> dict:
        """`reward` and `feedback` of an answered attempt against `example` (the ground truth, or its group's majority
        answer), saved under `key`; a metric call that timed out scores 0 with its message under `timeout`, unsaved."""
        if (saved := self.ckpt.get(key)) is not None:
            return saved
        scored = score_attempt(self.metric, example, attempt.to_record(), self.knobs.metric_timeout_s)
        if "timeout" not in scored:
            self.ckpt.put(key, scored)
        self._done("reward", None)
        self._say_clipped(scored)
        return scored

    def _say_clipped(self, record: dict) -> None:
        """Say once per run that an attempt's text, or the metric's feedback on it, was cut for the learning calls."""
        for kind, (key, limit, what) in CUTS.items():
            if key not in record:
                continue
            with self._lock:
                first = kind not in self.clipped
                self.clipped.add(kind)
            if first:
                logger.warning("%s ran to %d characters: the learning calls read it cut to %d (its head and tail; "
                               "further cuts are not said again)", what, record[key], limit)

    # -- the run's own records ---------------------------------------------------------------------------------------
    def record(self, key: str, *, reused: bool = True) -> Any | None:
        """The record of the run saved under `key` (a finished step, a validation; `reused=False`: a tally, such as a
        step's usage so far, which is no reused work), or None."""
        return self.ckpt.get(key, unit=reused)

    def keep(self, key: str, value: Any, *, once: bool = False) -> None:
        """Save a record of the run under `key` (`once`: unless one is saved there already)."""
        if not (once and self.ckpt.get(key, unit=False) is not None):
            self.ckpt.put(key, value)

    def call(self, stage: str, name: str, fn: Callable[[], Any]) -> Any:
        """One learning call on the pool (see `calls`)."""
        return self.calls(stage, {name: fn})[0]

    def calls(self, stage: str, units: dict[str, Callable[[], Any]]) -> list[Any]:
        """Learning calls on the scope's pool, in order (`units`: name -> fn): each the value saved under the scope's
        `prefix/name`, or `fn()`
        (charged, metered under `stage`) saved; one that raises is returned as a `Failed` and counted as a failure of
        its stage."""
        def one(name: str) -> Any:
            key = f"{self.prefix}/{name}"
            if (value := self.ckpt.get(key)) is None:
                try:
                    value = self._unit(stage, units[name])
                except BudgetExhausted:
                    raise
                except Exception as exc:  # a failed learning call is counted, not fatal
                    value = Failed(_why(exc))
                else:
                    self.ckpt.put(key, value)
            self._done(stage, value.error if isinstance(value, Failed) else None)
            return value
        return self.map(stage, one, list(units))

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
            again = score_attempt(self.metric, trainset[int(path.stem.split("_")[0])], record, self.knobs.metric_timeout_s)
            if reward is not None and "timeout" not in again and abs(again["reward"] - reward) > 1e-9:
                raise RunMismatchError(where.format("metric", f"{path.name}: reward {reward} then, "
                                                    f"{again['reward']} now", "metric"))
        if saved:  # the program as that rollout ran it (its LM copy's rollout ID, which a program may read)
            path, record = saved[0]
            step, (query, g) = int(path.parent.parent.name), path.stem.split("_")
            replay, asked = with_own_lms(program, rollout_id=rollout_id(self.knobs.seed, step, int(g)),
                                         temperature=self.knobs.temperature), []
            for name, predictor in replay.named_predictors():
                def answer(name=name, calls=[c for c in record["trace"] if c["predictor"] == name], **inputs):
                    asked.append({"predictor": name, "inputs": jsonable(inputs)})
                    return dspy.Prediction(**calls.pop(0)["outputs"]) if calls else dspy.Prediction()
                predictor.forward = answer
            _, rec = run_program(replay, trainset[int(query)])
            if rec["outputs"] != record["outputs"] or asked != [{k: c[k] for k in ("predictor", "inputs")}
                                                                 for c in record["trace"]]:
                raise RunMismatchError(where.format("program", f"{path.name}, given the same replies, now asks "
                                                    f"{asked[:2]} and answers {rec['outputs'] or rec['error']}",
                                                    "program"))

    # -- the failure rule --------------------------------------------------------------------------------------------
    def expect(self, groups: list) -> None:
        """The groups `settle` waits for from now on (a step's next round of queries: dynamic sampling); the stages'
        checks run again, on every unit so far."""
        with self._cond:
            self._groups, self._arrived, self._left, self._verdicts = set(groups), {}, set(), {}

    def settle(self, stage: str, group, failed: bool) -> None:
        """`group` has reached `stage`. One that saw failures there waits until every group of the scope has reached it
        (or left), and the stage's failure check (`check`) has passed, before it spends more on its query: the check
        must see all of the stage's units. It runs once per stage; its verdict is every waiter's."""
        with self._cond:
            self._arrived.setdefault(stage, set()).add(group)
            self._cond.notify_all()
            if not failed:
                return
            self._cond.wait_for(lambda: self._groups <= self._arrived.get(stage, set()) | self._left)
            if stage not in self._verdicts:
                try:
                    self.check(stage)
                    self._verdicts[stage] = None
                except TooManyFailuresError as exc:
                    self._verdicts[stage] = exc
            if self._verdicts[stage] is not None:
                raise self._verdicts[stage]

    def leave(self, group) -> None:
        """`group` is done, or failed: it counts as arrived at every stage."""
        with self._cond:
            self._left.add(group)
            self._cond.notify_all()

    def check(self, stage: str) -> None:
        """Stop the scope, unfinished, when more than `max_failure_rate` of the stage's units failed: a resume redoes
        the failed units."""
        errors, total = self.failures.get(stage, ([], 0))
        if total and len(errors) > self.knobs.max_failure_rate * total:
            units = "attempts" if stage in POLICY_STAGES else f"{stage} calls"
            where = str(self.ckpt.root) if self.ckpt.root is not None else None
            raise TooManyFailuresError(f"{self.name}: {len(errors)} of {total} {units} failed (first: {errors[0]}); "
                                       f"finished work is kept in log_dir={where!r}")


def _attempt_record(program: dspy.Module, example: dspy.Example, metric: Callable | None,
                    timeout_s: float | None) -> dict:
    """An attempt's checkpoint record: `run_program`'s, with the attempt as the learning calls read it; with `metric`,
    its score too (none for an attempt whose LM call failed)."""
    _, rec = run_program(program, example)
    text = format_attempt(dict(example.inputs().items()), rec["outputs"], rec["trace"], rec["error"], limit=None)
    rec["attempt"] = clip(text, MAX_ATTEMPT_CHARS)
    if len(text) > MAX_ATTEMPT_CHARS:  # said once by the runner
        rec["attempt_chars"] = len(text)
    if metric is None:
        return rec
    if rec["failed"]:
        return {**rec, "reward": None, "feedback": ""}
    return {**rec, **score_attempt(metric, example, rec, timeout_s)}


def _no_answer_record(example: dspy.Example, metric: Callable | None, error: str) -> dict:
    """The record of an attempt that got no answer because it never ran to the end (a Ray task lost with its node)."""
    rec = {"outputs": None, "error": error, "failed": True, "trace": [], "tool_calls": 0,
           "attempt": format_attempt(dict(example.inputs().items()), None, [], error)}
    return rec if metric is None else {**rec, "reward": None, "feedback": ""}


EMPTY_REPLY = "The LM returned an empty or null response"  # what DSPy's adapters raise for a reply with no content


def no_answer(exc: BaseException) -> bool:
    """Whether `exc` says the provider gave no answer: an LM call that failed, or a reply with nothing to parse (DSPy's
    adapters raise an `AdapterParseError` for no choices, or an empty content such as a content filter leaves)."""
    return isinstance(exc, LMError) or (isinstance(exc, AdapterParseError) and EMPTY_REPLY in str(exc))


REASONING_HINT = ("the reflection LM's reply had no content: a reasoning model may have put all of it in its "
                  "reasoning (reasoning_content) or run out of max_tokens before answering; give it more max_tokens, "
                  "or use a model that answers in its content")


def _why(exc: BaseException) -> str:
    """A failed learning call's error as text, its hint first where the reply had no content (what a reasoning model
    that answers only in its reasoning sends), since the error's own text is long and its end gets cut in logs."""
    text = f"{type(exc).__name__}: {exc}"
    return f"{REASONING_HINT} ({text})" if EMPTY_REPLY in text else text


def rollout_id(*parts) -> int:
    """A stable rollout ID for DSPy's cache and the provider's sampling, from `parts` (seed, step, attempt)."""
    return int(digest(list(parts)), 16) % 2**31


# -- the seam: units on threads ----------------------------------------------------------------------------------------
POLICY_STAGES = ("rollout", "probe", "validation", "attribution")  # the program's own calls; the rest are learning calls
ROLE = dict.fromkeys(POLICY_STAGES, "policy")  # a stage's role: ROLE.get(stage, "reflection")


class TooManyFailuresError(RuntimeError):
    """More of a stage's units failed than `max_failure_rate` allows: the step stops, unfinished."""


@dataclass
class StageBars:
    """A tqdm bar per stage on stderr, as DSPy draws its own: the progress callback when the caller gives none, for the
    overlapping stages of a pipelined step (a stage's total may grow as groups reach it); `close()` them when it is
    over. Drawn only when stderr is a terminal: in a log file or CI a redrawn bar is a stream of escape codes.
    `resumed=True` takes a stage's first report for work done before (a resume's), not for progress, so that the rate
    and ETA count from it (the whole run's bar)."""

    resumed: bool = False
    bars: dict = field(default_factory=dict)  # stage -> its tqdm bar

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.bars:
            self.bars[stage] = tqdm.tqdm(total=total, desc=stage, dynamic_ncols=True, file=sys.stderr,
                                         disable=not sys.stderr.isatty(), initial=done if self.resumed else 0)
        bar = self.bars[stage]
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


class DaemonPool:
    """A fixed pool of daemon threads with `ThreadPoolExecutor`'s submit and shutdown. The standard pool's threads
    are joined when the interpreter exits, so one call that hangs (a metric, a tool) would keep a stopped run alive
    forever; these threads are abandoned instead, and a Ctrl-C ends the process at once."""

    def __init__(self, num_threads: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"tfgrpo-worker-{i}")
                         for i in range(max(1, num_threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking work; `cancel_futures` cancels what has not started; `wait` waits for what runs."""
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


class Workers:
    """A bounded pool for the units of work of one stage or step: `map(stage, fn, items)` runs `fn` over `items` on at
    most `num_threads` threads in all and returns the results in order, and may be called from several threads at
    once (one per group of a step, `each`), so that a group's learning calls start while other groups still roll out.

    A unit runs with the caller's DSPy settings and with `meters[stage]` as DSPy's usage tracker; `progress(stage,
    done, total)` is told of each finished unit. Nothing is swallowed: the first unit that raises stops everything
    (units not started are cancelled, running ones finish) and its exception is raised by the `with` block's
    `map`/`each`; on Ctrl-C nothing is waited for: a unit that hangs is abandoned on its daemon thread."""

    def __init__(self, num_threads: int, *, progress: Callable[[str, int, int], None] | None = None,
                 meters: dict | None = None):
        from dspy.dsp.utils.settings import thread_local_overrides

        self._overrides = thread_local_overrides
        self._parent = thread_local_overrides.get().copy()
        self._bars = StageBars() if progress is None else None
        self.progress, self.meters = progress or self._bars, meters or {}
        self._pool, self._groups = DaemonPool(num_threads), None
        self._counts: dict[str, list[int]] = {}  # stage -> [done, submitted]
        self._lock = threading.Lock()
        self._stopped = False  # a unit failed: nothing more is started

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, error, tb) -> None:
        interrupted = kind is not None and issubclass(kind, KeyboardInterrupt)
        for pool in (self._pool, self._groups):
            if pool is not None:  # never wait on Ctrl-C; after an error, wait for running units (they finish)
                pool.shutdown(wait=not interrupted, cancel_futures=kind is not None)
        if self._bars is not None:
            self._bars.close()

    def _in_context(self, fn: Callable, overrides: dict) -> Callable:
        def run(*args):
            token = self._overrides.set(overrides)
            try:
                return fn(*args)
            finally:
                self._overrides.reset(token)
        return run

    def map(self, stage: str, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]`, run on the pool, in order."""
        caller = self._overrides.get().copy()
        overrides = {**caller, **({"usage_tracker": self.meters[stage]} if stage in self.meters else {})}
        with self._lock:
            if self._stopped:
                raise Cancelled()
            self._counts.setdefault(stage, [0, 0])[1] += len(items)
            futures = [self._pool.submit(self._in_context(fn, overrides), item) for item in items]
        results = []
        for future in futures:
            try:
                results.append(future.result())  # a unit that raised stops the caller here
            except CancelledError:  # cancelled because another unit failed: that one's error is raised instead
                raise Cancelled() from None
            with self._lock:
                self._counts[stage][0] += 1
                self.progress(stage, *self._counts[stage])  # one at a time: bars and callbacks need no lock
        return results

    def each(self, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]`, each item on a thread of its own (a group of a step: it waits on its units,
        which run on the bounded pool), in order; the first that raises stops the others' units not yet started, and
        is raised here once the rest have ended."""
        if self._groups is None:
            self._groups = DaemonPool(max(1, len(items)))
        futures = [self._groups.submit(self._in_context(fn, self._parent.copy()), item) for item in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            with self._lock:
                self._stopped = True
            self._pool.shutdown(wait=False, cancel_futures=True)  # the other items end with their units
            wait(futures)
            raise next((f.exception() for f in futures if f.exception() is not None
                        and not isinstance(f.exception(), Cancelled)), failed.exception())
        return [f.result() for f in futures]


class Cancelled(Exception):
    """A unit of work was cancelled because another one failed: the failure that caused it is raised instead."""


class RayAttempts:
    """The attempts of a run as Ray tasks: `attempt` has `_attempt_record`'s contract, and runs it on any node of the
    cluster (RAY_ADDRESS, else the one `ray.init()` finds or starts; a cluster the caller connected to is used as it
    is). What travels: the program (its LM copies with their settings), the example, the metric when the unit scores
    the attempt, and DSPy's `lm` and `adapter` settings; what comes back: the attempt's record and the usage of its LM
    calls, metered here as a local call is. A task whose worker or node dies is sent again by Ray (`max_retries`);
    lost for good, it is an attempt with no answer (`failed`, never scored), as a failed LM call is. The program's
    classes must import on the nodes: tfgrpo's do wherever it is installed; a class of the caller's own module needs
    that module there (installed, or Ray's `runtime_env`)."""

    max_retries = 3  # sends of one task whose worker or node died, after the first

    def __init__(self, prices: dict | None = None):
        try:
            import ray
        except ImportError:
            raise ImportError('backend="ray" needs Ray on this machine and the nodes: pip install "tfgrpo[ray]"') from None
        if not ray.is_initialized():
            ray.init(logging_level="WARNING")
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        logger.info("backend ray: attempts run as tasks on %d node(s), %g CPU(s) (%s)", len(nodes),
                    ray.cluster_resources().get("CPU", 0), ray.get_runtime_context().gcs_address)
        self._ray, self.prices = ray, prices
        self._task = ray.remote(_remote_attempt).options(max_retries=self.max_retries, retry_exceptions=False)
        self._lock, self._running = threading.Lock(), set()

    def attempt(self, program: dspy.Module, example: dspy.Example, metric: Callable | None,
                timeout_s: float | None) -> dict:
        settings = {"lm": dspy.settings.lm, "adapter": dspy.settings.adapter}
        if paced(settings["lm"]) or any(paced(p.lm) for p in program.predictors()):
            raise ValueError('backend="ray" sends the attempts\' calls from the nodes, where a RequestPacer '
                             "(max_requests_per_minute) paces nothing: leave it off and let the provider's 429s and "
                             'num_retries pace the run, or use backend="threads"')
        ref = self._task.remote(program, example, metric, timeout_s, settings, self.prices)
        with self._lock:
            self._running.add(ref)
        try:
            record, usage = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:  # the task's own error (a program that cannot unpickle)
            raise exc.as_instanceof_cause() from None
        except self._ray.exceptions.RayError as exc:  # its worker or node died more than max_retries times
            record, usage = _no_answer_record(example, metric, f"RayTaskLost: {type(exc).__name__}: {exc}"), {}
        finally:
            with self._lock:
                self._running.discard(ref)
        if dspy.settings.usage_tracker is not None:  # the unit's own meter
            dspy.settings.usage_tracker.absorb(usage)
        return record

    def cancel(self) -> None:
        """End the tasks still running (Ctrl-C on the driver)."""
        with self._lock:
            running, self._running = list(self._running), set()
        for ref in running:
            self._ray.cancel(ref, force=True)


_WORKER_PRICES: dict[str, dict] = {}  # a Ray worker's price lookups by the run's `prices`, kept for its later tasks


def _remote_attempt(program: dspy.Module, example: dspy.Example, metric: Callable | None, timeout_s: float | None,
                    settings: dict, prices: dict | None) -> tuple[dict, dict]:
    """A Ray task's body: the attempt's record and its LM calls' usage (`UsageMeter.usage_data`)."""
    meter = UsageMeter(_WORKER_PRICES.setdefault(digest(prices), {}), custom=prices)
    with dspy.context(usage_tracker=meter, **settings):
        record = _attempt_record(program, example, metric, timeout_s)
    return record, dict(meter.usage_data)


# -- meters and prices -------------------------------------------------------------------------------------------------
def model_price(model: str, prices: dict | None = None) -> dict[str, float] | None:
    """USD per token of `model` (a dspy.LM model string): {"input", "output", "cached_input"}, from `prices` (per
    million tokens, by model string) or DSPy's copy of LiteLLM's price map; None when neither knows it."""
    if prices and model in prices:
        given = prices[model]
        return {k: given.get(k, given["input"] if k == "cached_input" else 0.0) / 1e6 for k in ("input", "output",
                                                                                                 "cached_input")}
    try:
        from dspy.clients.capabilities import resolve
        from dspy.clients.model_metadata import model_info, rate

        route = resolve(dspy.LM(model))
        info = model_info(route.provider, route.model)
    except Exception:  # a model DSPy cannot route (a custom BaseLM, a name without a provider)
        return None
    found = {k: rate(info, key) for k, key in (("input", "input_cost_per_token"), ("output", "output_cost_per_token"),
                                              ("cached_input", "cache_read_input_token_cost"))}
    if found["input"] is None or found["output"] is None:
        return None
    return {**found, "cached_input": found["cached_input"] if found["cached_input"] is not None else found["input"]}


class UsageMeter(UsageTracker):
    """A usage tracker that the threads of a stage share: calls, tokens (cached ones apart) and, where the model's price
    is known, dollars. It also counts the calls made outside any predictor (`direct`), which get no library."""

    def __init__(self, prices: dict[str, dict | None] | None = None, custom: dict | None = None):
        super().__init__()
        self._lock, self.prices, self.custom = threading.Lock(), prices if prices is not None else {}, custom

    def __deepcopy__(self, memo) -> UsageMeter:
        return self  # DSPy's parallel executor gives each thread a copy of the tracker, which would lose the counts

    def add_usage(self, lm: str, usage_entry: dict[str, Any]) -> None:
        entry = {k: v.model_dump() if isinstance(v, pydantic.BaseModel) else v for k, v in (usage_entry or {}).items()}
        entry["direct"] = not any(isinstance(m, dspy.Predict) for m in dspy.settings.caller_modules or [])
        with self._lock:
            if lm not in self.prices:
                self.prices[lm] = model_price(lm, self.custom)
            price, cached = self.prices[lm], _cached(entry)
            entry["cost"] = None if price is None else (
                (int(entry.get("prompt_tokens") or 0) - cached) * price["input"] + cached * price["cached_input"]
                + int(entry.get("completion_tokens") or 0) * price["output"])
            self.usage_data[lm].append(entry)

    def totals(self) -> dict[str, float]:
        """Calls, tokens, cached tokens and cost so far (cost left out when no call had a known price); safe to read
        while threads still report."""
        with self._lock:
            entries = [e for lm_entries in list(self.usage_data.values()) for e in lm_entries]
        total = {"calls": len(entries), "prompt_tokens": sum(int(e.get("prompt_tokens") or 0) for e in entries),
                 "completion_tokens": sum(int(e.get("completion_tokens") or 0) for e in entries),
                 "cached_tokens": sum(_cached(e) for e in entries)}
        costs = [e["cost"] for e in entries if e.get("cost") is not None]
        return {**total, "cost": sum(costs)} if costs else total

    def absorb(self, usage_data: dict[str, list[dict]]) -> None:
        """Take in every call another meter saw (its `usage_data`: a unit's own meter, into its stage's; a Ray task's)."""
        with self._lock:
            for lm, entries in usage_data.items():
                self.usage_data[lm].extend(entries)


def _cached(entry: dict) -> int:
    return int((entry.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@contextlib.contextmanager
def metered(prices: dict | None = None) -> Iterator[UsageMeter]:
    """Meter the LM calls made inside the block, in this thread and in those DSPy starts from it (`meter.totals()`);
    an enclosing `dspy.track_usage()` still receives them."""
    meter, outer = UsageMeter(custom=prices), dspy.settings.usage_tracker
    try:
        with dspy.context(usage_tracker=meter):
            yield meter
    finally:
        if outer is not None:
            for lm, entries in meter.usage_data.items():
                outer.usage_data[lm].extend(entries)


def add_usage(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


class RequestPacer(BaseCallback):
    """Holds an LM's calls to `per_minute` starts in any sliding minute, as a provider's requests-per-minute limit
    counts them: a call that would be one too many waits for the oldest start to leave the window instead of drawing a
    429 and a Retry-After wait. Add it to the LM (`dspy.LM(..., callbacks=[RequestPacer(500)])`, or
    `max_requests_per_minute` in a config's LM section); `lm.copy()` shares it, so every copy the optimizer makes is
    paced together.

    It paces the calls of one process; a call DSPy answers from its cache takes a start too. A provider's other
    limits (tokens a minute) are still met by its 429 and DSPy's retries (`num_retries`)."""

    window_s = 60.0
    margin_s = 0.25  # a start waits this much past the window: the provider's clock sees the request a little later

    def __init__(self, per_minute: int):
        if not isinstance(per_minute, int) or per_minute < 1:
            raise ValueError(f"RequestPacer needs a whole number of requests a minute, at least 1 (got {per_minute!r})")
        self.per_minute = per_minute
        self._starts: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self.waited_s = 0.0  # the time calls spent waiting for a start, all threads together

    def on_lm_start(self, call_id, instance, inputs) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                while self._starts and now - self._starts[0] >= self.window_s + self.margin_s:
                    self._starts.popleft()
                if len(self._starts) < self.per_minute:
                    self._starts.append(now)
                    return
                wait = self.window_s + self.margin_s - (now - self._starts[0])
                self.waited_s += wait
            time.sleep(wait)

    def __deepcopy__(self, memo) -> RequestPacer:
        return self  # a deep copy of a program's LM still shares the provider's limit

    def __reduce__(self):
        return RequestPacer, (self.per_minute,)  # the lock cannot travel; a copy in another process paces apart


def paced(lm) -> bool:
    """Whether `lm` carries a RequestPacer."""
    return any(isinstance(c, RequestPacer) for c in getattr(lm, "callbacks", None) or [])


# -- the budget -------------------------------------------------------------------------------------------------------
class BudgetExhausted(RuntimeError):
    """The next unit of work would pass `max_cost`, `max_total_tokens` or `max_metric_calls`: the run stops there, with
    every finished unit saved, and a resume with a larger budget goes on from it."""


class Budget:
    """`max_cost`, `max_total_tokens` and `max_metric_calls`, charged before each unit starts: what was spent, plus what
    the units in flight are expected to spend, plus this unit's expected share (the mean of the stage's finished units,
    else of all finished units) must stay within each limit. So a run overshoots a budget by at most what its units in
    flight spend beyond their expected share."""

    def __init__(self, knobs: Knobs):
        self.limits = {"cost": knobs.max_cost, "tokens": knobs.max_total_tokens, "metric_calls": knobs.max_metric_calls}
        self.spent = {"cost": 0.0, "tokens": 0, "metric_calls": 0}
        self.in_flight = {"cost": 0.0, "tokens": 0, "metric_calls": 0}
        self.done: dict[str, list[tuple[float, int]]] = {}  # stage -> (cost, tokens) of each finished unit
        self._lock = threading.Lock()

    def add(self, usage: dict, metric_calls: int = 0) -> None:
        """Count what reused work had spent (a resumed run's finished steps and units)."""
        with self._lock:
            self.spent["cost"] += usage.get("cost", 0.0)
            self.spent["tokens"] += usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            self.spent["metric_calls"] += metric_calls

    def reserve(self, stage: str, metric_calls: int = 0) -> dict[str, float]:
        """This unit's expected share, now counted as in flight; `BudgetExhausted` if it does not fit."""
        with self._lock:  # nothing measured yet: the first units of a run are the measurement
            done = self.done.get(stage) or [x for units in self.done.values() for x in units] or [(0.0, 0)]
            share = {"cost": statistics.fmean(c for c, _ in done), "tokens": statistics.fmean(t for _, t in done),
                     "metric_calls": metric_calls}
            for name, limit in self.limits.items():
                if limit is not None and self.spent[name] + self.in_flight[name] + share[name] > limit - (
                        1e-12 if name == "cost" else 0) and (share[name] or self.spent[name] >= limit):
                    raise BudgetExhausted(self._why(name, stage, share[name]))
            for name in self.in_flight:
                self.in_flight[name] += share[name]
            return share

    def release(self, stage: str, share: dict, used: dict, metric_calls: int = 0) -> None:
        """The unit has ended: its share leaves the flight, what it `used` (meter totals) is spent."""
        with self._lock:
            cost, tokens = used.get("cost", 0.0), used.get("prompt_tokens", 0) + used.get("completion_tokens", 0)
            for name, value in (("cost", cost), ("tokens", tokens), ("metric_calls", metric_calls)):
                self.in_flight[name] -= share[name]
                self.spent[name] += value
            if used.get("calls"):
                self.done.setdefault(stage, []).append((cost, tokens))

    def reached(self, attempts: int = 0) -> str | None:
        """Why no more work fits (checked between steps): a budget is spent, or too little of one is left for the
        `attempts` the next step needs at least (each a metric call, costing what a finished attempt did on average);
        else None."""
        with self._lock:
            done = self.done.get("rollout") or [x for units in self.done.values() for x in units] or [(0.0, 0)]
            need = {"cost": attempts * statistics.fmean(c for c, _ in done), "metric_calls": attempts,
                    "tokens": attempts * statistics.fmean(t for _, t in done)}
        for name, limit in self.limits.items():
            if limit is not None and self.spent[name] >= limit:
                return self._why(name, "", 0)
        for name, limit in self.limits.items():
            if limit is not None and need[name] and self.spent[name] + need[name] > limit:
                return self._why(name, "", need[name], attempts)
        return None

    def _why(self, name: str, stage: str, share: float, attempts: int = 0) -> str:
        knob = {"cost": "max_cost", "tokens": "max_total_tokens", "metric_calls": "max_metric_calls"}[name]
        show = (lambda v: f"${v:.4f}" if v >= 0.01 else f"${v:.6f}") if name == "cost" else (lambda v: f"{v:,.0f}")
        if attempts:  # the next step cannot be paid for
            left = show(self.limits[name] - self.spent[name])
            return (f"budget {knob}={self.limits[name]:g} cannot pay for another step: {left} left, a step needs "
                    f"~{show(share)} ({attempts} attempts: its rollouts, and a probe of the program and one edit, "
                    f"where it probes); more calls cannot pay")
        what = {"cost": "spent", "tokens": "tokens used", "metric_calls": "metric calls made"}[name]
        nxt = f"; the next {stage} unit (~{show(share)}) would pass it" if stage else ""
        used = self.spent[name] + self.in_flight[name]  # (those in flight are as good as spent)
        return f"budget {knob}={self.limits[name]:g} reached: {show(used)} {what}{nxt}"
