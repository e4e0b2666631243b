"""How a compile reports to trackers (MLflow's is `tfgrpo.tracking`) without importing them.

A tracker is an object with two methods, registered under the entry point group `tfgrpo.trackers` (see
pyproject.toml; another package can add its own the same way):

    built(optimizer)        an optimizer was constructed (MLflow's tracker lets an autolog called earlier patch
                            its compile)
    compile(info)           a context manager around one compile, yielding an object with `step(stats)`,
                            `validation(epoch, step)` and `finish(compiled)`, or None when it does not track
                            this compile

The optimizer only calls `built` and `tracked`: it reports its steps, validations and result, and never learns
who listens. Trackers are loaded once per process, at the first optimizer built.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, ContextManager, Iterator, Protocol

GROUP = "tfgrpo.trackers"


@dataclass(frozen=True)
class CompileInfo:
    """What a compile tells its trackers before its first step."""

    knobs: dict[str, Any]  # the optimizer's settings by name (log_dir, use_mlflow, ...)
    params: Callable[[], dict[str, str]]  # the knobs and what they resolve to for this program, as text (LMs by
    # model name only); called only by a tracker that logs it, and raises when the program has no LM


class CompileHooks(Protocol):
    """What a compile calls on each tracker it reports to."""

    def step(self, stats: Any) -> None: ...  # after each step, with its StepResult
    def validation(self, epoch: dict, step: int) -> None: ...  # after each validation, at the epoch's last step
    def finish(self, compiled: Any) -> None: ...  # at the end, with the compiled program


class Tracker(Protocol):
    def built(self, optimizer: Any) -> None: ...
    def compile(self, info: CompileInfo) -> ContextManager[CompileHooks | None]: ...


@functools.cache
def installed() -> dict[str, Tracker]:
    """The installed trackers by entry point name, in name order."""
    return {ep.name: ep.load() for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name)}


def trackers() -> tuple[Tracker, ...]:
    return tuple(installed().values())


def built(optimizer: Any) -> None:
    """Tell the trackers that `optimizer` was constructed."""
    for tracker in trackers():
        tracker.built(optimizer)


@contextlib.contextmanager
def tracked(info: CompileInfo) -> Iterator[list[CompileHooks]]:
    """The hooks of the trackers that track this compile, open for its lifetime (an error inside reaches each)."""
    with contextlib.ExitStack() as stack:
        yield [hooks for tracker in trackers() if (hooks := stack.enter_context(tracker.compile(info))) is not None]
