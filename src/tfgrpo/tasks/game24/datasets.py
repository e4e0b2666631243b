"""Game of 24 puzzles as `dspy.Example`s with `numbers` as their only input.

The 1,362 puzzles of the Tree-of-Thoughts repository are ranked by how long people took to solve them
(easiest first). `train` holds ranks 1-900, `test` ranks 901-1000 (the standard test slice); see
data/README.md for provenance. Every puzzle has at least one solution.
"""

from __future__ import annotations

from pathlib import Path

import dspy

from tfgrpo.tasks.math.datasets import load_questions

DATA_DIR = Path(__file__).resolve().parent / "data"
SPLITS = {"game24_train": DATA_DIR / "train.jsonl", "game24_test": DATA_DIR / "test.jsonl"}


def load_game24(name_or_path: str = "game24_train", *, limit: int | None = None, offset: int = 0) -> list[dspy.Example]:
    """Puzzles from a shipped split (`game24_train`, `game24_test`) or a JSONL file of `question` rows."""
    path = SPLITS.get(name_or_path, name_or_path)
    if not Path(path).is_file():
        raise ValueError(f"unknown Game of 24 set {name_or_path!r}: use {sorted(SPLITS)} or a JSONL path")
    rows = load_questions(str(path), limit=limit, offset=offset)  # the same JSONL reader and checks as every set
    return [dspy.Example(numbers=r.question, id=r.get("id"), rank=r.get("rank")).with_inputs("numbers") for r in rows]
