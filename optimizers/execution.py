"""The execution layer: every unit of work of a run goes through one `Executor`.

A unit is one attempt of a program on a query (a rollout, a probe attempt, a validation or attribution run), its score,
or one learning call. For each unit the executor

  1. reuses it from the checkpoint, when a run before this one finished it;
  2. charges the budget before it starts (`Budget`): its expected tokens, dollars and metric call must fit in what is
     left beside the units in flight, else the run stops with `BudgetExhausted`, nothing half-written;
  3. runs it on the scope's bounded pool, metered by stage, priced by the models' prices, and saves it;
  4. counts it as a failure when it raised, and stops the scope with `TooManyFailuresError` when more than
     `max_failure_rate` of a stage's units failed: an outage must not pass for "nothing to learn".

An attempt the provider did not answer has no answer: an LM call that failed (an `LMError`: a rate limit, a timeout,
a lost connection, a prompt refused for its length or content), or a reply with nothing in it (no choices, or a
content filter's or a length cut's empty content). It is never scored; the step leaves it out of its group and the
probe and counts it in `failed_calls`, and a validation leaves it out of its score. Any other error of the program (a
reply with content that does not parse, a tool that raises) is the program's own doing: it scores 0.

A scope is one step, one validation or one attribution: its own pool, meters, failure counts and gates, opened with
`with executor.scope(...)`. Calls and tokens come from DSPy's usage-tracker hook, which every call that reaches the
provider reports to (replies from DSPy's cache are not counted); dollars are tokens times the model's price (DSPy's
copy of LiteLLM's price map, or `prices=`), cached prompt tokens at the cached price.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from typing import Any, Callable

import dspy
from dspy.utils.exceptions import AdapterParseError, LMError

from tfgrpo.base.util import digest, jsonable
from tfgrpo.optimizers.checkpoint import Checkpoint, RunMismatchError
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.parallel import (POLICY_STAGES, ROLE, Budget, BudgetExhausted, StageBars,
                                        TooManyFailuresError, UsageMeter, Workers, add_usage)
from tfgrpo.optimizers.result import Attempt, Failed
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.programs.render import MAX_FEEDBACK_CHARS, count_tool_calls, format_attempt

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
    exception as text; never raised), `failed` (the error is an LM call's), `trace` (every predictor call: name, inputs,
    outputs, whole) and `tool_calls`."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            if not hasattr(type(program), "forward") and hasattr(type(program), "aforward"):  # an async-only program
                prediction = asyncio.run(program.acall(**example.inputs()))
            else:
                prediction = program(**example.inputs())
        outputs, error, failed = jsonable(dict(prediction.items())), None, False
    except Exception as exc:
        prediction, outputs, error, failed = None, None, f"{type(exc).__name__}: {exc}", False
        cause = exc
        while cause is not None and not failed:  # the provider's failure or empty reply, wherever in the chain
            failed, cause = no_answer(cause), cause.__cause__ or cause.__context__
    names = {id(predictor): name for name, predictor in program.named_predictors()}
    steps = [{"predictor": names.get(id(predictor), type(predictor).__name__), "inputs": jsonable(inputs),
              "outputs": jsonable(dict(out.items()))} for predictor, inputs, out in trace]
    return prediction, {"outputs": outputs, "error": error, "failed": failed, "trace": steps,
                        "tool_calls": count_tool_calls(outputs)}


# -- the executor -----------------------------------------------------------------------------------------------------
class Executor:
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
        self.clipped = False  # a metric's feedback was cut for the learning calls (said once)
        self._lock, self._cond = threading.Lock(), threading.Condition()
        self.name = self.prefix = ""
        self.meters, self.failures, self.finished, self.work, self.tally = {}, {}, {}, None, lambda usage: None

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
            self.meter(stage).absorb(own)
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
            metric = self.metric if score else None
            record = self._unit(stage, lambda: _attempt_record(program, example, metric, self.knobs.metric_timeout_s),
                                metric_calls=1)
            if key is not None and not record["error"] and "timeout" not in record:
                self.ckpt.put(key, record)
        self._done(stage, record["error"] or record.get("timeout"))
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

    def _say_clipped(self, scored: dict) -> None:
        """Say once per run that the metric's feedback was cut for the learning calls."""
        cut = "feedback_chars" in scored
        with self._lock:
            first, self.clipped = cut and not self.clipped, self.clipped or cut
        if first:
            logger.warning("The metric's feedback on an attempt ran to %d characters: the learning calls read it cut to "
                           "%d (its head and tail; further cuts are not said again)", scored["feedback_chars"],
                           MAX_FEEDBACK_CHARS)

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
                    value = Failed(f"{type(exc).__name__}: {exc}")
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
    rec["attempt"] = format_attempt(dict(example.inputs().items()), rec["outputs"], rec["trace"], rec["error"])
    if metric is None:
        return rec
    if rec["failed"]:
        return {**rec, "reward": None, "feedback": ""}
    return {**rec, **score_attempt(metric, example, rec, timeout_s)}


EMPTY_REPLY = "The LM returned an empty or null response"  # what DSPy's adapters raise for a reply with no content


def no_answer(exc: BaseException) -> bool:
    """Whether `exc` says the provider gave no answer: an LM call that failed, or a reply with nothing to parse (DSPy's
    adapters raise an `AdapterParseError` for no choices, or an empty content such as a content filter leaves)."""
    return isinstance(exc, LMError) or (isinstance(exc, AdapterParseError) and EMPTY_REPLY in str(exc))


def rollout_id(*parts) -> int:
    """A stable rollout ID for DSPy's cache and the provider's sampling, from `parts` (seed, step, attempt)."""
    return int(digest(list(parts)), 16) % 2**31
