"""The ceiling a Game of 24 program's kept demos set: what their own search solves when run directly.

A 1.5B student copies a demo's search program, so the held-out puzzles the demo's program itself solves (its puzzle's
numbers swapped for each held-out puzzle's, run in the sandbox) bound what the student can reach by copying it. The
peers report prints this ceiling beside the student's own score, per arm: a lead that is only a better template
shows as a higher ceiling, not as a student that does more than copy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tfgrpo.tasks.game24.program import last_line, strip_fences
from tfgrpo.tasks.game24.verify import check, puzzle_numbers
from tfgrpo.tasks.sandbox import run_python

_LIST = re.compile(r"[\[(]\s*\d+(?:\s*,\s*\d+){3}\s*[\])]")  # a literal of four numbers, as a list or a tuple


def demos_of(program_json: Path) -> list[dict]:
    """The demos (numbers and code) a saved program carries, over all its predictors."""
    state = json.loads(program_json.read_text())
    return [d for part in state.values() if isinstance(part, dict) for d in part.get("demos", [])
            if isinstance(d, dict) and d.get("code") and d.get("numbers")]


def swapped(code: str, demo_numbers, numbers: list[int]) -> str | None:
    """The demo's program with its puzzle's four numbers replaced by `numbers`; None if it names them nowhere."""
    own = sorted(puzzle_numbers(demo_numbers))
    for match in _LIST.finditer(code):
        if sorted(puzzle_numbers(match.group())) == own:
            return code[: match.start()] + repr(list(numbers)) + code[match.end():]
    return None


def solves(code: str, demo_numbers, numbers: list[int]) -> bool:
    program = swapped(strip_fences(code), demo_numbers, numbers)
    if program is None:
        return False
    result = run_python(program, wall_timeout_s=10.0, cpu_time_s=10, memory_mb=512)
    return check(numbers, last_line(result.stdout))[0]


def ceiling(seed_dir: Path, puzzles: list) -> list[bool] | None:
    """Per held-out puzzle: does any kept demo's own program solve it? Cached in seed_dir/ceiling.json; None for a
    program without demos."""
    cache = seed_dir / "ceiling.json"
    if cache.exists():
        return json.loads(cache.read_text())
    program = seed_dir / "program.json"
    demos = demos_of(program) if program.exists() else []
    if not demos:
        return None
    solved = [any(solves(d["code"], d["numbers"], puzzle_numbers(p.numbers)) for d in demos) for p in puzzles]
    cache.write_text(json.dumps(solved))
    return solved
