"""Running a stage's units of work on threads, with DSPy's settings, progress, and no swallowed error."""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Future
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
    called after every finished item; None draws a tqdm bar. Ctrl-C stops it at once, as `run_flows`.
    """
    if not items:
        return []

    def flow(item):
        (result,) = yield [(stage, fn, item)]
        return result

    return run_flows([flow(item) for item in items], num_threads=num_threads, progress=progress or StageBar())


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


class WaitFor:
    """Yielded by a flow of `run_flows`: park me until every other flow is finished or parked, then, once the check
    `on_stage_done(stage)` has passed, resume me. Flows parked at different stages resume stage by stage, in the order
    the stages first ran, so a stage's check sees all of its units."""

    def __init__(self, stage: str):
        self.stage = stage


def run_flows(flows: list, *, num_threads: int, progress: Callable[[str, int, int], None] | None = None,
              meters: dict | None = None, on_stage_done: Callable[[str], None] | None = None) -> list:
    """Drive generator `flows` (one per group of a step) to their end, each as far as its own results allow, and
    return what each flow returned, in order.

    A flow yields a list of units `(stage, fn, item)` and is sent back the list of `fn(item)`s, in order, once all of
    them are done; the units of every flow share one pool of `num_threads` threads, so a group's learning calls start
    while other groups still roll out: no stage waits for the slowest call of the stage before it. The flows' own code
    runs in this thread, one at a time, so what they record needs no lock. A unit runs with this thread's DSPy
    settings, and with `meters[stage]` as DSPy's usage tracker. Nothing is swallowed: the first unit or flow that
    raises stops everything (units not started are cancelled, running ones finish) and its exception is raised here;
    on Ctrl-C (KeyboardInterrupt) nothing is waited for: a unit that hangs is abandoned on its daemon thread.
    """
    from dspy.dsp.utils.settings import thread_local_overrides

    flows = list(flows)
    bars = StageBars() if progress is None else None
    progress, meters = progress or bars, meters or {}
    parent = thread_local_overrides.get().copy()
    counts: dict[str, list[int]] = {}  # stage -> [done, submitted], in the order the stages first ran
    pending: dict = {}  # future -> (flow, its batch of results, units of the batch left, index in it, stage)
    waiting: dict[str, list] = {}  # stage -> flows parked at WaitFor(stage)
    finished: queue.SimpleQueue = queue.SimpleQueue()  # futures as they finish (waiting on all pending is O(n) each)
    returned: dict[int, object] = {}  # id(flow) -> the value it returned

    def in_worker(stage, fn, item):
        overrides = {**parent, **({"usage_tracker": meters[stage]} if stage in meters else {})}
        token = thread_local_overrides.set(overrides)
        try:
            return fn(item)
        finally:
            thread_local_overrides.reset(token)

    def advance(flow, value) -> None:
        try:
            request = flow.send(value)
        except StopIteration as stop:
            returned[id(flow)] = stop.value
            return
        if isinstance(request, WaitFor):
            waiting.setdefault(request.stage, []).append(flow)
            return
        if not request:
            advance(flow, [])
            return
        batch, left = [None] * len(request), [len(request)]
        for i, (stage, fn, item) in enumerate(request):
            counts.setdefault(stage, [0, 0])[1] += 1
            future = pool.submit(in_worker, stage, fn, item)
            pending[future] = (flow, batch, left, i, stage)
            future.add_done_callback(finished.put)

    def release() -> None:  # nothing runs: resume the flows parked at the earliest stage
        while not pending and waiting:
            stage = min(waiting, key=list(counts).index)
            if on_stage_done:
                on_stage_done(stage)
            for flow in waiting.pop(stage):
                advance(flow, None)

    pool = DaemonPool(num_threads)
    try:
        for flow in flows:
            advance(flow, None)
        release()
        while pending:
            future = finished.get()
            flow, batch, left, i, stage = pending.pop(future)
            batch[i] = future.result()  # a unit that raised stops the step here
            counts[stage][0] += 1
            progress(stage, *counts[stage])
            left[0] -= 1
            if left[0] == 0:
                advance(flow, batch)
            release()
    except KeyboardInterrupt:  # Ctrl-C: never wait for a unit that may hang; what finished is saved already
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        if bars is not None:
            bars.close()
    return [returned[id(flow)] for flow in flows]
