"""The machinery under the execution layer: a stage's units of work on threads (with DSPy's settings, progress, and no
swallowed error), their meters (calls, tokens and dollars) and the budget they are charged to."""

from __future__ import annotations

import contextlib
import queue
import statistics
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import dspy
import pydantic
import tqdm
from dspy.utils.usage_tracker import UsageTracker

from tfgrpo.optimizers.knobs import Knobs

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

    def absorb(self, other: UsageMeter) -> None:
        """Take in every call another meter saw (a unit's own meter, into its stage's)."""
        with self._lock:
            for lm, entries in other.usage_data.items():
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
