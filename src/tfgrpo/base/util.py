"""Small helpers every part of the package uses: cutting text to size, writing a file atomically, clearing the
temporary files of atomic writes that a killed process left behind, and values as JSON (a stable hash of one, or
a JSON-safe copy), and the bootstrap CI of a mean."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import statistics
import uuid
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from pydantic_core import to_jsonable_python

USER_MODULE_PREFIX = "tfgrpo_user_"  # the name of a module imported from a file path (tfgrpo.user_task.import_file)
TMP_NAME = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")  # write_atomic's temporary files: .<name>.<uuid4 hex>.tmp


def clip(text: str, limit: int, *, keep_tail: bool = True) -> str:
    """`text` unchanged if it has at most `limit` characters; else `limit` characters of it and a marker
    that says how many were cut.

    keep_tail=True keeps the start and the end (an attempt, a program's output, an error: what went wrong
    is often last); keep_tail=False keeps the start only, ended at a word boundary (a page, a snippet).
    """
    if limit < 0:
        raise ValueError(f"clip: limit must be >= 0, not {limit}")
    if len(text) <= limit:
        return text
    if keep_tail:
        head, tail = text[: (limit + 1) // 2], text[len(text) - limit // 2:]
        return f"{head}\n[... {len(text) - limit} characters cut ...]\n{tail}"
    head = text[:limit]
    if not text[limit].isspace() and " " in head:  # the cut falls inside a word: end at the word before it
        head = head.rsplit(" ", 1)[0]
    head = head.rstrip()
    return f"{head} [... {len(text) - len(head)} characters cut ...]"


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` so that a crash at any moment leaves the old file or the new one, never a
    torn one: written to a unique temporary name in the same folder, synced, then renamed over `path`.
    Missing parent folders are created. An error names `path` (a full disk's `[Errno 28]` says none itself)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # "x": a new file, with the usual permissions (umask)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # (read-only storage: the file was never made, and cannot be removed)
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)) and exc.errno is not None:
            # "[Errno 28] No space left on device: 'path'": the file asked for, not the temporary one
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise
    return path


def remove_stale_tmp(folder: str | Path, *, recursive: bool = True) -> int:
    """Delete the temporary files `write_atomic` leaves when its process is killed mid-write (SIGTERM, SIGKILL)
    under `folder`; returns how many. Call it only while no other process writes there (under the run's lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    removed = 0
    for p in folder.rglob(".*.tmp") if recursive else folder.glob(".*.tmp"):
        if TMP_NAME.match(p.name) and p.is_file():
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def jsonable(value: Any) -> Any:
    """`value` made JSON-safe (records, demos, the text the learning calls read) as pydantic dumps it: a model as its
    fields, an Enum as its value, a date as ISO text, a tuple or set as a list; anything pydantic cannot dump, as
    text. What reading would consume or fail on (an open file, a generator, any other iterator) is shown by its type
    and never read: the program's own value stays as it was for the metric."""
    return json.loads(json.dumps(to_jsonable_python(_unread(value), fallback=str), ensure_ascii=False, default=str))


def _unread(value: Any) -> Any:
    """`value` with every file and iterator in it (inside dicts, lists, tuples and sets) replaced by a short text."""
    if isinstance(value, dict):
        return {k: _unread(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_unread(v) for v in value]
    if isinstance(value, (io.IOBase, Iterator)):
        return f"<{type(value).__name__}, not read>"
    return value


def bootstrap_ci(values: list[float], *, seed: int = 0, resamples: int = 10_000) -> tuple[float, float]:
    """95% bootstrap CI of the mean of `values`."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def read_jsonl_rows(path: Path) -> list[tuple[int, dict]]:
    """Parse a JSONL file with the json module: (1-based line, row) pairs, blank lines skipped."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object")
            rows.append((number, row))
    return rows
