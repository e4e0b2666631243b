"""Two small helpers every part of the package uses: cutting text to size, and writing a file atomically."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


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
    Missing parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # "x": a new file, with the usual permissions (umask)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
