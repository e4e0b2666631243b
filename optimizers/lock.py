"""One compile at a time per run directory.

Two compiles writing into one log_dir would mix their units (a reward file of one run beside the rollout of the
other) and a later resume would reuse that mixture without a word. `RunLock` holds an exclusive `flock` on
`<log_dir>/.lock` for the whole compile and writes who holds it (pid, host, command, since) into that file; a
second compile is refused at once with a `RunLockedError` that names the holder. The kernel drops a flock when
its process dies, however it dies, so a lock left by a killed run is simply taken over by the next one.

The lock is re-entrant within one thread (the CLI holds it around the whole command, the optimizer again around
its compile); any other thread or process is refused. Where `fcntl` is missing (Windows) nothing is locked.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".lock"
_held: dict[str, list] = {}  # resolved lock path -> [owning thread id, depth, open file]
_held_lock = threading.Lock()


class RunLockedError(RuntimeError):
    """The run directory is in use by another compile (`holder`: what its lock file says of it)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class RunLock:
    """`with RunLock(log_dir):` holds the run directory's lock, or raises `RunLockedError` naming the holder.
    `log_dir=None` locks nothing."""

    def __init__(self, log_dir: str | Path | None):
        self.path = Path(log_dir) / LOCK_FILE if log_dir is not None else None

    def __enter__(self) -> "RunLock":
        if self.path is None or fcntl is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        with _held_lock:
            if key in _held and _held[key][0] == threading.get_ident():
                _held[key][1] += 1
                return self
            f = open(self.path, "a+", encoding="utf-8")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process (it has not written its name yet)"
                f.close()
                raise RunLockedError(
                    f"{self.path.parent} is in use by another compile ({holder}); two runs in one folder would mix "
                    "their work. Wait for it to end (or stop it), or use another log_dir/run_dir", holder) from None
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                    f"{' '.join(sys.argv) or sys.executable}\n")
            f.flush()
            _held[key] = [threading.get_ident(), 1, f]
        return self

    def __exit__(self, *exc) -> None:
        if self.path is None or fcntl is None:
            return
        key = str(self.path.resolve())
        with _held_lock:
            entry = _held.get(key)
            if entry is None or entry[0] != threading.get_ident():
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                f = entry[2]
                f.truncate(0)  # the file stays (removing it would race a process about to lock it); it says nobody
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                f.close()
