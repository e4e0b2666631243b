"""Question sets as lists of ``dspy.Example``: the math sets (``load_math``), and the reader every task's
loader shares (``load_questions``: the math sets, Game of 24 puzzles, web questions).

Every example carries ``question`` (the only input field) and ``answer`` (a string), plus whatever
other fields the source row had (id, solution, level, ...). Three kinds of source are understood:

* a shipped set's name (for the math sets, a key of :data:`BUILTIN`: JSONL files in ``data/`` next to
  this module);
* a path to the user's own JSON Lines file whose rows have ``question`` and ``answer``;
* a Hugging Face hub id such as ``HuggingFaceH4/aime_2024`` (needs network); the usual hub schemas
  (``problem``, ``solution``, GSM8K's ``#### 42`` answers, DAPO's chat prompts) are mapped.

Local files go through ``datasets.load_dataset("json", ...)``, which never touches the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import dspy

from tfgrpo.base.util import read_jsonl_rows
from tfgrpo.tasks.math.metric import extract_answer

DATA_DIR = Path(__file__).resolve().parent / "data"

# Builtin sets: name -> shipped JSONL file (see data/README.md for where each one comes from).
BUILTIN: dict[str, Path] = {
    "dapo100": DATA_DIR / "dapo_math_17k" / "dapo100.jsonl",
    "aime24": DATA_DIR / "aime24" / "aime24.jsonl",
    "aime25": DATA_DIR / "aime25" / "aime25.jsonl",
    "gsm8k_train": DATA_DIR / "gsm8k" / "train.jsonl",
    "gsm8k_test": DATA_DIR / "gsm8k" / "test.jsonl",
    "math500": DATA_DIR / "math500" / "math500.jsonl",
}

# Hub datasets that need a config name to load.
HUB_CONFIGS: dict[str, str] = {"openai/gsm8k": "main"}

# Field names that hold the problem text / the final answer, in order of preference.
_QUESTION_KEYS = ("question", "problem", "Problem", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "ground_truth")

# DAPO-Math-17k wraps every problem in this instruction; we keep only the problem itself.
_DAPO_HEAD = re.compile(r"^Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.\s*$")


def _cache_dir() -> str | None:
    """Where ``datasets`` may write its arrow cache; None means its own default (HF_DATASETS_CACHE)."""
    return os.environ.get("TFGRPO_DATASETS_CACHE") or None


def _load_rows(path_or_id: str, *, local: bool, split: str) -> Any:
    """Read a JSON file or a hub dataset with Hugging Face ``datasets``, quietly."""
    import datasets  # imported lazily: it is slow to import and only needed here

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if local:
            # The packaged "json" builder reads the file directly: no hub lookup, works offline.
            return datasets.load_dataset(
                "json", data_files=path_or_id, split="train", cache_dir=_cache_dir()
            )
        return datasets.load_dataset(
            path_or_id, HUB_CONFIGS.get(path_or_id), split=split, cache_dir=_cache_dir()
        )
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _line_number(path: Path, row_index: int) -> int:
    """1-based line of the ``row_index``-th record of a JSONL file (blank lines hold no record)."""
    seen = -1
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                seen += 1
                if seen == row_index:
                    return number
    return row_index + 1  # not found (e.g. a JSON array file): fall back to the record number


def _as_text(value: Any) -> str | None:
    """A field value as a stripped string; None when it is missing or empty."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 18.0 from a numeric column should read "18"
    text = str(value).strip()
    return text or None


def _hub_question(row: dict) -> Any:
    """Problem text of a hub row, unwrapping chat-style prompts (DAPO) and their instructions."""
    for key in _QUESTION_KEYS:
        value = row.get(key)
        if isinstance(value, list) and value:  # a list of chat messages: use the last user turn
            users = [m for m in value if isinstance(m, dict) and m.get("role", "user") == "user"]
            value = users[-1].get("content") if users else None
        if isinstance(value, str) and value.strip():
            return _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", value.strip()))
    return None


def _hub_answer(row: dict) -> Any:
    """Final answer of a hub row: an answer field, a nested ground truth, or a GSM8K '####' tail."""
    value = None
    for key in _ANSWER_KEYS:
        if row.get(key) not in (None, ""):
            value = row[key]
            break
    if value is None and isinstance(row.get("reward_model"), dict):  # DAPO-Math-17k layout
        value = row["reward_model"].get("ground_truth")
    if value is None and isinstance(row.get("solution"), str):  # MATH-style: the last \boxed{}
        value = extract_answer(row["solution"])
    if isinstance(value, str) and "####" in value:  # GSM8K: rationale, then "#### 1,234"
        value = value.rsplit("####", 1)[1].strip().replace(",", "")
    return value


def _to_example(row: dict, *, hub: bool) -> dspy.Example:
    """Build one example; raises ValueError (without location, the caller adds it) on a bad row."""
    question = _as_text(_hub_question(row) if hub else row.get("question"))
    answer = _as_text(_hub_answer(row) if hub else row.get("answer"))
    for field, value in (("question", question), ("answer", answer)):
        if value is None:
            raise ValueError(f"missing or empty '{field}' field")
    # Everything else rides along as plain (non-input) fields; hub problem text is not repeated.
    used = ("answer",) + (_QUESTION_KEYS if hub else ("question",))
    fields = {k: v for k, v in row.items() if v is not None and k not in used}
    if hub and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        fields.setdefault("solution", row["answer"])  # keep GSM8K's worked solution, as shipped
    return dspy.Example(question=question, answer=answer, **fields).with_inputs("question")


def _resolve(name_or_path: str, shipped: dict[str, Path]) -> tuple[str, bool]:
    """Turn the user's argument into (path or hub id, is_local)."""
    if name_or_path in shipped:
        return str(shipped[name_or_path]), True
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return str(path), True
    looks_local = path.suffix in (".jsonl", ".json") or name_or_path.startswith((".", "/", "~"))
    if looks_local or name_or_path.count("/") != 1:
        known = f"a shipped set ({', '.join(sorted(shipped))}), " if shipped else ""
        raise ValueError(
            f"unknown question set {name_or_path!r}: not {known}not an existing file, and not a hub id of the "
            "form 'owner/name'"
        )
    return name_or_path, False


def load_math(name_or_path: str, *, limit: int | None = None, offset: int = 0,
              split: str = "train") -> list[dspy.Example]:
    """A math set: a key of :data:`BUILTIN` (``"gsm8k"`` picks its split by ``split``), a JSONL file or a
    hub id, read by ``load_questions``."""
    if name_or_path == "gsm8k":
        name_or_path = "gsm8k_test" if split == "test" else "gsm8k_train"
    return load_questions(name_or_path, shipped=BUILTIN, limit=limit, offset=offset, split=split)


def load_questions(
    name_or_path: str,
    *,
    shipped: dict[str, Path] | None = None,
    limit: int | None = None,
    offset: int = 0,
    split: str = "train",
) -> list[dspy.Example]:
    """Load question/answer rows as ``dspy.Example`` objects with ``question`` as their only input.

    ``name_or_path`` is a key of ``shipped`` (the calling task's shipped sets), a JSONL file with
    ``question``/``answer`` fields, or a hub id (``split`` chooses the hub split; local files have a single
    one). ``offset`` skips that many rows and ``limit`` caps how many are returned. Only the returned rows
    are checked: a missing or empty ``question``/``answer`` raises ``ValueError`` naming the file and
    1-based line.
    """
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError("offset and limit must not be negative")
    source, local = _resolve(str(name_or_path), shipped or {})
    try:
        table = _load_rows(source, local=local, split=split)
    except Exception as exc:
        if not local:  # unreachable hub, unknown id, ... -> one clear error type
            raise ValueError(f"could not load question set {source!r}: {exc}") from exc
        # Arrow is strict (one type per column, no stray text): re-read the file line by line,
        # which either succeeds or names the exact line that is not a JSON object.
        rows = read_jsonl_rows(Path(source))
    else:
        rows = None

    total = len(table) if rows is None else len(rows)
    stop = total if limit is None else min(total, offset + limit)
    start = min(offset, stop)
    if rows is None:
        columns = table[start:stop]  # dict of column lists: only the requested slice is built
        names = list(columns)
        chosen = [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]
        if not names:
            chosen = [{} for _ in range(stop - start)]
    else:
        chosen = [row for _, row in rows[start:stop]]

    examples = []
    for index, row in enumerate(chosen, start=start):
        try:
            examples.append(_to_example(row, hub=not local))
        except ValueError as exc:
            # Only now pay for locating the row, so the common path never rescans the file.
            if not local:
                where = f"{source} (split {split!r}), row {index + 1}"
            elif rows is not None:
                where = f"{source}, line {rows[index][0]}"
            else:
                where = f"{source}, line {_line_number(Path(source), index)}"
            raise ValueError(f"{where}: {exc}") from None
    return examples
