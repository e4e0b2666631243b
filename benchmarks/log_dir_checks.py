"""Checks of a run's log_dir for benchmarks/faults.py and its tests: a saved library's invariants, checkpoint files
that do not parse, and which files a resume wrote again."""

from __future__ import annotations

import json
from pathlib import Path

from tfgrpo.optimizers.checkpoint import TALLY
from tfgrpo.testing import KINDS

UNIT_KIND = {"rollouts": "student", "summaries": "summary", "advantages": "advantage", "plan": "consolidation"}


def library_problems(state: dict, max_words: int = 32, max_experiences: int | None = None) -> list[str]:
    """What is wrong with a saved library state (empty: nothing)."""
    from tfgrpo.programs.library import ExperienceLibrary

    try:
        lib = ExperienceLibrary.from_state(state)
    except ValueError as exc:
        return [f"does not load: {exc}"]
    problems = []
    ids = list(lib.active) + list(lib.retired)
    if len(ids) != len(set(ids)):
        problems.append("an ID is used twice")
    problems += [f"{e.id} has {len(e.text.split())} words" for e in lib if len(e.text.split()) > max_words]
    if max_experiences is not None and len(lib) > max_experiences:
        problems.append(f"{len(lib)} experiences, over the cap {max_experiences}")
    if any(int(i[1:]) >= lib.next_id for i in ids):
        problems.append("next_id would reuse an ID")
    return problems


def signature(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns  # a checkpoint write (temporary file + rename) changes both


def unit_files(log_dir: Path) -> dict[str, tuple[int, int]]:
    """Finished units on disk: relative path -> signature (a step's running tally of what it spent is not a unit)."""
    return {str(p.relative_to(log_dir)): signature(p) for p in log_dir.rglob("*.json") if p.stem != TALLY}


def torn_files(log_dir: Path) -> list[str]:
    """Checkpoint files that do not parse (a write cut by the kill would show here)."""
    torn = []
    for p in log_dir.rglob("*.json"):
        try:
            json.loads(p.read_text())
        except ValueError:
            torn.append(str(p))
    return torn


def units_per_kind(files) -> dict[str, int]:
    counts = {k: 0 for k in KINDS}
    for rel in files:
        parts = Path(rel).parts
        if len(parts) >= 3 and parts[0] == "steps":
            kind = UNIT_KIND.get(parts[2] if len(parts) > 3 else Path(parts[2]).stem)
            if kind:
                counts[kind] += 1
    return counts
