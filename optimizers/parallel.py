"""Running a stage's units of work on threads, with DSPy's settings, progress, and no swallowed error."""

from __future__ import annotations

import sys
import threading
from typing import Callable

import tqdm
from dspy.utils.parallelizer import ParallelExecutor


class Failed:
    """A unit of work that raised, kept as a value so the caller can count it and go on."""

    def __init__(self, error: BaseException):
        self.error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"Failed({self.error!r})"


class TooManyFailuresError(RuntimeError):
    """More of a stage's units failed than `max_failure_rate` allows: the step stops, unfinished."""


class StageBar:
    """A tqdm bar for one stage, as DSPy draws its own: the progress callback when the caller gives none."""

    def __init__(self):
        self.bar: tqdm.tqdm | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm.tqdm(total=total, desc=stage, dynamic_ncols=True, file=sys.stdout)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def run_parallel(fn: Callable, items: list, *, num_threads: int, stage: str,
                 progress: Callable[[str, int, int], None] | None = None) -> list:
    """Map `fn` over `items` on `num_threads` threads with DSPy settings propagated; order is kept.

    Nothing is swallowed: the first item that raises stops the map (items not yet started are skipped, those
    running finish) and its exception is raised again here. A failure that is a result, such as an LM call
    that may fail, must be caught inside `fn` (and returned as a `Failed`). `progress(stage, done, total)` is
    called after every finished item (from worker threads, under a lock); None draws a tqdm bar.
    """
    if not items:
        return []
    progress = progress or StageBar()
    lock, done, errors = threading.Lock(), [0], []

    def guarded(item):
        if errors:
            return None
        try:
            result = fn(item)
        except Exception as exc:
            with lock:
                errors.append(exc)
            return None
        with lock:
            done[0] += 1
            progress(stage, done[0], len(items))
        return result

    # timeout=0 turns off the executor's straggler re-submission, which would send duplicate LM calls.
    executor = ParallelExecutor(num_threads=num_threads, max_errors=len(items) + 1, disable_progress_bar=True,
                                timeout=0)
    results = executor.execute(guarded, items)
    if errors:
        raise errors[0]
    return results
