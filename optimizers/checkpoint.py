"""Crash-safe record of a run in `log_dir`: every finished unit of work is one small JSON file.

Layout:
    run.json                      what the run was started with (a fingerprint; a resume must match it)
    steps/0003/rollouts/7_2.json  query 7, generation 2 of step 3: outputs, trace, attempt text, error
    steps/0003/rewards/7_2.json   that rollout's reward and the metric's feedback
    steps/0003/summaries/7_2.json the summary of that rollout
    steps/0003/advantages/7.json  the operations proposed by query 7's group
    steps/0003/plan.json          the consolidated plan
    steps/0003/done.json          library after the step and the step's stats: the step is complete
    epochs/0.json                 validation score of the library after epoch 0

Files are written atomically (`tfgrpo.util.write_atomic`), so a kill at any moment leaves either the old state or
the new one, never a torn file. A file that does not parse (written by something else) is treated as absent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from tfgrpo.util import write_atomic


class RunMismatchError(ValueError):
    """The log_dir holds a run started with other settings or data."""


class Checkpoint:
    def __init__(self, log_dir: str | Path | None):
        self.root = Path(log_dir) if log_dir is not None else None
        self._lock = threading.Lock()
        self.reused = 0  # units found on disk instead of recomputed (for reports and tests)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def start(self, fingerprint: dict[str, Any]) -> None:
        """Record the run's fingerprint, or check it against the one already there."""
        if not self.enabled:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "run.json"
        old = self._read(path)
        if old is None:
            self._write(path, fingerprint)
            return
        diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        if diff:
            raise RunMismatchError(
                f"{self.root} holds a run with different {', '.join(diff)}; resume with the same settings and "
                "data, or use a new log_dir")

    def get(self, key: str) -> Any | None:
        if not self.enabled:
            return None
        value = self._read(self.root / f"{key}.json")
        if value is not None:
            with self._lock:
                self.reused += 1
        return value

    def put(self, key: str, value: Any) -> None:
        if self.enabled:
            self._write(self.root / f"{key}.json", value)

    def discard(self, key: str) -> None:
        """Forget a unit, so that a resume computes it again."""
        if self.enabled:
            (self.root / f"{key}.json").unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> Any | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _write(path: Path, value: Any) -> None:
        write_atomic(path, json.dumps(value, ensure_ascii=False))


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def jsonable(value: Any) -> Any:
    """`value` made JSON-safe (for checkpoints): structures kept, anything else as text."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))
