"""Question sets of the web task as `dspy.Example`s with `question` as their only input (and `answer`).

Shipped (see data/README.md for provenance): `hotpotqa_train` (292) and `hotpotqa_dev` (300), answerable
offline by searching the shipped HotpotQA corpus, and `webwalkerqa` (680, needs the live web). From the hub:
`callanwu/WebWalkerQA` (split `main`) and the paper's training set `PersonalAILab/AFM-WebAgent-RL-Dataset`,
whose hub schemas (`Question`/`Answer`, chat prompts, ...) are mapped by the same rules as the math sets.
"""

from __future__ import annotations

import os
from pathlib import Path

import dspy

from tfgrpo.tasks.math.datasets import load_questions

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN: dict[str, Path] = {
    "hotpotqa_train": DATA_DIR / "hotpotqa" / "train.jsonl",
    "hotpotqa_dev": DATA_DIR / "hotpotqa" / "dev.jsonl",
    "webwalkerqa": DATA_DIR / "webwalkerqa" / "test.jsonl",
}
HUB_SPLITS = {"callanwu/WebWalkerQA": "main", "PersonalAILab/AFM-WebAgent-RL-Dataset": "train"}
KEPT = ("id", "type", "level", "root_url", "difficulty_level", "domain", "lang")  # small fields that ride along


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_web(name_or_path: str, *, limit: int | None = None, offset: int = 0,
             split: str | None = None) -> list[dspy.Example]:
    """Questions from a shipped set, a JSONL file of `question`/`answer` rows, or a hub id."""
    source = str(BUILTIN.get(name_or_path, name_or_path))
    hub = not Path(source).expanduser().is_file() and name_or_path.count("/") == 1 and not name_or_path.endswith((".jsonl", ".json"))
    if hub and _offline():
        raise ValueError(f"{name_or_path!r} is on the Hugging Face hub only, and the hub is switched off here "
                         "(HF_HUB_OFFLINE); offline, use the shipped sets: " + ", ".join(BUILTIN))
    try:
        rows = load_questions(source, limit=limit, offset=offset, split=split or HUB_SPLITS.get(name_or_path, "train"))
    except ValueError as exc:
        if hub:
            raise ValueError(f"could not load {name_or_path!r} from the Hugging Face hub (it needs network access; "
                             f"offline, use the shipped sets: {', '.join(BUILTIN)}): {exc}") from None
        if not Path(source).expanduser().is_file():
            raise ValueError(f"unknown web question set {name_or_path!r}: use {', '.join(BUILTIN)}, a JSONL file or "
                             "a hub id such as callanwu/WebWalkerQA") from None
        raise
    return [dspy.Example(question=r.question, answer=r.answer, **{k: r[k] for k in KEPT if k in r})
            .with_inputs("question") for r in rows]
