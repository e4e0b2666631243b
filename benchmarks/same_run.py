"""Whether two compiles wrote the same run: the same library, program and step records.

Made to check that a change of the code changes nothing it does not mean to: compile once at the code before and once
after, on one DSPy cache (the second compile then sends no LM call: its `policy: 0 new calls` line says so), and
compare the two run directories. A step record's timings and usage (calls that reached the provider: none from the
cache) are left out, and so is any field named with `--ignore` (a removed mechanism's own record); a program is
compared without its metadata (where it learned, the versions and types it was saved with).

    DSPY_CACHEDIR=/tmp/cache tfgrpo compile configs/local.toml      # at each commit, each into its own run_dir
    python -m benchmarks.same_run BEFORE_RUN_DIR AFTER_RUN_DIR [--ignore evidence,details.excerpts]

The last line is `same_run: library_equal=<bool> program_equal=<bool> steps_equal=<bool> steps=<n>,<n>`; each field
that differs is printed above it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TIMINGS = ("usage", "seconds", "wall_s", "usage_before_resume")


def saved(path: Path) -> dict:
    """A saved file's data; of a program, without its metadata (where it learned, the versions and field types it was
    saved with), which says how it was made and saved, not what it computes (its predictors' state holds that)."""
    data = json.loads(path.read_text())
    if isinstance(data.get("metadata"), dict):
        data.pop("metadata")
    return data


def steps(run_dir: Path, ignore: list[str]) -> list[dict]:
    """The run's step records without their timings, usage and the `ignore`d fields (`details.x`: a key of a dict)."""
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    for record in records:
        for name in (*TIMINGS, *ignore):
            outer, _, inner = name.partition(".")
            if inner:
                (record.get(outer) or {}).pop(inner, None)
            else:
                record.pop(outer, None)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--ignore", default="", help="comma-separated step fields to leave out (details.NAME for one count)")
    args = ap.parse_args(argv)
    ignore = [name for name in args.ignore.split(",") if name]
    same = {name: saved(args.before / name) == saved(args.after / name) for name in ("library.json", "program.json")}
    a, b = steps(args.before, ignore), steps(args.after, ignore)
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                print(f"step {i} {key}: {json.dumps(x.get(key))[:200]} != {json.dumps(y.get(key))[:200]}")
    print(f"same_run: library_equal={str(same['library.json']).lower()} program_equal="
          f"{str(same['program.json']).lower()} steps_equal={str(a == b).lower()} steps={len(a)},{len(b)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
