"""The ceiling a Game of 24 program's kept demos set: what their own search solves when run directly.

A 1.5B student copies a demo's search program, so the held-out puzzles the demo's program itself solves (its puzzle's
numbers swapped for each held-out puzzle's, run in the sandbox) bound what the student can reach by copying it. The
peers report prints this ceiling beside the student's own score, per arm: a lead that is only a better template
shows as a higher ceiling, not as a student that does more than copy.

`python -m benchmarks.ceiling RUN_DIR` does the same for every distinct program a run's rollouts and probes wrote
(the attempts files of its log_dir's finished steps) and prints the best one's count beside the kept demos': whether a run was limited by
what its rollouts wrote or by what it chose. Last line: `written: programs=N best_written=X kept=Y of=24`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tfgrpo.tasks.game24.datasets import load_game24
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


def any_solves(demos: list[dict], numbers: list[int]) -> bool:
    """Does any of these demos' own program solve the puzzle with these numbers?"""
    return any(solves(d["code"], d["numbers"], numbers) for d in demos)


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
    solved = [any_solves(demos, puzzle_numbers(p.numbers)) for p in puzzles]
    cache.write_text(json.dumps(solved))
    return solved


def written(log_dir: Path) -> dict[str, list[int]]:
    """Every distinct program a run's attempts wrote (rollouts, probes: its finished steps' attempts files), with the
    numbers of its puzzle."""
    found = {}
    for path in sorted(log_dir.rglob("*.attempts.jsonl")):
        for line in path.read_text().splitlines():
            try:
                attempt = json.loads(line)
                code, numbers = attempt["outputs"]["code"], attempt["trace"][0]["inputs"]["numbers"]
            except (ValueError, KeyError, IndexError, TypeError):  # an attempt that wrote no program
                continue
            if isinstance(code, str) and code.strip():
                found.setdefault(strip_fences(code), numbers)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run's folder: its log_dir (checkpoint) and program.json")
    ap.add_argument("--eval", default="game24_test")
    ap.add_argument("--limit", type=int, default=24)
    args = ap.parse_args()
    puzzles = [puzzle_numbers(p.numbers) for p in load_game24(args.eval, limit=args.limit)]
    programs = written(args.run_dir)
    counts = sorted((sum(solves(code, numbers, p) for p in puzzles) for code, numbers in programs.items()), reverse=True)
    program = next(iter(args.run_dir.rglob("program.json")), None)
    demos = demos_of(program) if program else []
    kept = sum(any_solves(demos, p) for p in puzzles)
    print(f"# the {len(programs)} distinct programs written solve {counts[:10]}... of {len(puzzles)} run directly")
    print(f"written: programs={len(programs)} best_written={counts[0] if counts else 0} kept={kept} of={len(puzzles)}")


if __name__ == "__main__":
    main()
