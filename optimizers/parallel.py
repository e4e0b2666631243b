"""Running a stage's units of work on threads, with DSPy's settings, progress, and no swallowed error."""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, wait
from typing import Callable

import tqdm


class Failed:
    """A unit of work that raised, kept as a value so the caller can count it and go on."""

    def __init__(self, error: BaseException):
        self.error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"Failed({self.error!r})"


class TooManyFailuresError(RuntimeError):
    """More of a stage's units failed than `max_failure_rate` allows: the step stops, unfinished."""


class StageBar:
    """A tqdm bar for one stage on stderr, as DSPy draws its own: the progress callback when the caller gives none.
    Drawn only when stderr is a terminal: in a log file or CI a redrawn bar is a stream of escape codes. Its total
    may grow (a pipelined step learns of a stage's units as groups reach it); `close_when_done=False` leaves closing
    to the caller; `resumed=True` takes the first report for work done before (a resume's), not for progress, so
    that the rate and ETA count from it."""

    def __init__(self, close_when_done: bool = True, resumed: bool = False):
        self.bar: tqdm.tqdm | None = None
        self.close_when_done, self.resumed = close_when_done, resumed

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm.tqdm(total=total, desc=stage, dynamic_ncols=True, file=sys.stderr,
                                 disable=not sys.stderr.isatty(), initial=done if self.resumed else 0)
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)
        if done >= total and self.close_when_done:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StageBars:
    """One `StageBar` per stage, for the overlapping stages of a pipelined step; `close()` them when it is over."""

    def __init__(self):
        self.bars: dict[str, StageBar] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.bars.setdefault(stage, StageBar(close_when_done=False))(stage, done, total)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def run_parallel(fn: Callable, items: list, *, num_threads: int, stage: str,
                 progress: Callable[[str, int, int], None] | None = None) -> list:
    """Map `fn` over `items` on `num_threads` threads with DSPy settings propagated; order is kept.

    Nothing is swallowed: the first item that raises stops the map (items not yet started are skipped, those
    running finish) and its exception is raised again here. A failure that is a result, such as an LM call
    that may fail, must be caught inside `fn` (and returned as a `Failed`). `progress(stage, done, total)` is
    called after every finished item; None draws a tqdm bar. Ctrl-C stops it at once, as `Workers` does.
    """
    if not items:
        return []
    with Workers(num_threads, progress=progress or StageBar()) as work:
        return work.map(stage, fn, items)


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
            results.append(_result(future))  # a unit that raised stops the caller here
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


def _result(future: Future):
    """The future's result; a unit cancelled because another one failed ends its caller quietly (`Cancelled`)."""
    try:
        return future.result()
    except CancelledError:
        raise Cancelled() from None


class Cancelled(Exception):
    """A unit of work was cancelled because another one failed: the failure that caused it is raised instead."""


class Gates:
    """Stage-wide checks for the groups of a step, each running on its own thread: a group that saw failures in a stage
    `wait`s until every group has `arrive`d at that stage (or finished), so that the stage's failure check (`check(
    stage)`, raising TooManyFailuresError) sees all of its units before the group spends more on its query. Groups
    without failures go on at once; the check runs once per stage, and its verdict is every waiter's."""

    def __init__(self, groups: list, check: Callable[[str], None]):
        self._check, self._cond = check, threading.Condition()
        self.expect(groups)

    def expect(self, groups: list) -> None:
        """The groups to wait for from now on (a step's next round of queries: dynamic sampling); the checks run
        again, on every unit so far."""
        with self._cond:
            self._groups = set(groups)
            self._arrived: dict[str, set] = {}  # stage -> the groups that reached it
            self._finished: set = set()
            self._verdicts: dict[str, BaseException | None] = {}

    def arrive(self, stage: str, group) -> None:
        with self._cond:
            self._arrived.setdefault(stage, set()).add(group)
            self._cond.notify_all()

    def finish(self, group) -> None:
        """`group` is done, or failed: it counts as arrived at every stage."""
        with self._cond:
            self._finished.add(group)
            self._cond.notify_all()

    def wait(self, stage: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._groups <= self._arrived.get(stage, set()) | self._finished)
            if stage not in self._verdicts:
                try:
                    self._check(stage)
                    self._verdicts[stage] = None
                except TooManyFailuresError as exc:
                    self._verdicts[stage] = exc
            if self._verdicts[stage] is not None:
                raise self._verdicts[stage]
