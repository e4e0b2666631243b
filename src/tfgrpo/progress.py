"""The CLI's progress display: one bar for the whole run and fresh bars for the stages of each step.

`RunBars` is the optimizer's `progress(stage, done, total)` callback drawn with rich. Stage "step" is the run's own
bar (epoch, steps done of all, elapsed, ETA); every other stage (rollout, reward, summary, ...) gets a new bar at each
step, so that its elapsed time and ETA are the step's, not a sum over steps. Where the console is not a terminal (a
log file, CI) the bars are not redrawn; plain lines say the same at a few points.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text


class MeanRateRemaining(TimeRemainingColumn):
    """Time left at the task's mean rate since it started. The run's bar moves once a step, too seldom for rich's
    30-second speed window; units that were done before the bar started (a resume's, field `first`) do not count."""

    def render(self, task) -> Text:
        done = task.completed - task.fields.get("first", 0)
        if task.finished or task.total is None or done <= 0 or not task.elapsed:
            return super().render(task)
        left = int(task.elapsed / done * (task.total - task.completed))
        return Text(f"{left // 3600:d}:{left // 60 % 60:02d}:{left % 60:02d}", style="progress.remaining")


def progress_display(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), MeanRateRemaining(), console=console)


class RunBars:
    """`progress(stage, done, total)` drawn on a rich `Progress`: the run's bar for stage "step", a bar per stage of
    the current step for the others (a new step removes the last one's). `plain_lines`: print a line now and then
    instead, for a console that is not a terminal."""

    def __init__(self, progress: Progress, num_train_epochs: int = 1, *, plain_lines: bool = False):
        self.progress, self.epochs, self.plain_lines = progress, max(1, num_train_epochs), plain_lines
        self.tasks: dict[str, int] = {}
        self.run = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "step":
            return self._step(done, total)
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)
        if self.plain_lines and (done == total or done % max(1, total // 4) == 0):
            self._say(f"{stage}: {done}/{total}")

    def _step(self, done: int, total: int) -> None:
        for task in self.tasks.values():  # a new step: the finished step's stage bars go
            self.progress.remove_task(task)
        self.tasks = {}
        epoch = min(done * self.epochs // max(1, total) + 1, self.epochs)
        description = f"run: epoch {epoch}/{self.epochs}, steps"
        if self.run is None:
            self.run = self.progress.add_task(description, total=total, completed=done, first=done)
        self.progress.update(self.run, completed=done, total=total, description=description)
        if self.plain_lines:
            self._say(f"{description} {done}/{total}")

    def _say(self, line: str) -> None:
        self.progress.console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False)
