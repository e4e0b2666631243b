"""Checks of a run's log_dir for benchmarks/faults.py and its tests: a saved library's invariants, saved files and
record lines that do not parse, which files a resume wrote again and which recorded calls it sent again."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from tfgrpo.optimizers.record import FILE
from tfgrpo.testing import KINDS

# the fake server's kind of call (tfgrpo.testing.prompts) of each stage the record holds; a learning path's stage is
# its kind (a contrast call's rewrite is recorded as a contrast call)
KIND_OF_STAGE = {"rollout": "student", "probe": "student", "validation": "student", "attribution": "student"}


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
    """The files a run saves whole (run.json, a finished step, a validation, the attribution): relative path ->
    signature. The record of calls (calls.jsonl) is only ever appended to: see `record_keys`."""
    return {str(p.relative_to(log_dir)): signature(p) for p in log_dir.rglob("*.json")}


def record_entries(log_dir: Path) -> list[dict]:
    """The record's entries that parse, in order (a line torn by a kill does not)."""
    path, entries = Path(log_dir) / FILE, []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


def record_keys(log_dir: Path) -> list[str]:
    """The keys of the LM calls the record holds, in order."""
    return [e["key"] for e in record_entries(log_dir) if "key" in e]


def resent(log_dir: Path, before: list[str], reference: Path) -> list[str]:
    """The calls the record held at a kill (`before`: their keys) that the killed and resumed runs together asked more
    often than an uninterrupted run did (`reference`: its log_dir): sent again though their replies were kept."""
    now, once = collections.Counter(record_keys(log_dir)), collections.Counter(record_keys(reference))
    return sorted(key for key in set(before) if now[key] > once[key])


def torn_files(log_dir: Path) -> list[str]:
    """Saved files that do not parse, and lines of the record that do not, but for its last line (a write cut by a kill
    would show here; the next start drops a torn last line)."""
    torn = []
    for p in log_dir.rglob("*.json"):
        try:
            json.loads(p.read_text())
        except ValueError:
            torn.append(str(p))
    path = Path(log_dir) / FILE
    lines = path.read_bytes().splitlines() if path.exists() else []
    for number, line in enumerate(lines[:-1], start=1):
        try:
            json.loads(line)
        except ValueError:
            torn.append(f"{path}:{number}")
    return torn


def units_per_kind(log_dir: Path) -> dict[str, int]:
    """The LM calls the record holds, by the fake server's kind of call."""
    counts = {k: 0 for k in KINDS}
    for entry in record_entries(log_dir):
        if "key" in entry and not entry.get("free"):
            counts[KIND_OF_STAGE.get(entry["stage"], entry["stage"])] += 1
    return counts
