"""The paper's learning path vs the small-reflector ("contrast") path, on the same saved rollouts.

    .venv/bin/python -m benchmarks.learning_paths configs/local.toml --step 0

Reads one step's rollouts and rewards from a finished run's log_dir (`run_dir/checkpoint/steps/NNNN.attempts.jsonl`),
then runs
both learning paths of `TrainingFreeGRPO` on exactly those attempts, against the library the step started
with, with the run's reflection LM (the embedded model for `configs/local.toml`). Nothing is cached or
written to the run. Prints, per path: LM calls, seconds, operations proposed, how many passed validation
(typed reply, known IDs, limits, generality), and the resulting library; the last lines are
  learning_paths: path=paper calls=N seconds=S proposed=P valid=V valid_ops=0.xx library=K
  learning_paths: path=contrast ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from tfgrpo.config import Config
from tfgrpo.lms import open_lms
from tfgrpo.task import task_parts
from tfgrpo.optimizers.records import Attempt, Group, Scored
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.contrast_path import ContrastPath
from tfgrpo.optimizers.step import PaperPath
from tfgrpo.optimizers.step import learn_from_groups
from tfgrpo.programs.render import query_key
from tfgrpo.programs import ExperienceLibrary
from tfgrpo.programs.generality import parroted_phrases, specific_terms


def _groups(attempts_file: Path, trainset: list) -> list[Group]:
    """The step's scored rollouts, as its attempts file holds them, as the groups the learning paths read."""
    attempts: dict[int, dict[int, Scored]] = {}
    rows = [json.loads(line) for line in attempts_file.read_text().splitlines()] if attempts_file.exists() else []
    for row in rows:
        if row["stage"] == "rollout":
            attempt = Attempt(outputs=row["outputs"], error=row["error"], trace=row["trace"],
                              tool_calls=row["tool_calls"], text=row["text"])
            attempts.setdefault(row["query"], {})[row["program"]] = Scored.of(attempt, row, row["program"])
    return [Group(index=qi, key=query_key(trainset[qi], qi), example=trainset[qi],
                  attempts=tuple(by_g[g] for g in sorted(by_g))) for qi, by_g in sorted(attempts.items())]


def _valid(start: ExperienceLibrary, op, query: str, allowed: str) -> bool:
    scratch = start.copy()
    general = not specific_terms(op.text, query, allowed=allowed) and not parroted_phrases(op.text)
    return scratch.apply([op], step=0).num_applied == 1 and (op.action == "delete" or general)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--paths", default="paper,contrast", help="which learning paths to run, comma-separated")
    args = ap.parse_args()
    cfg = Config.load(args.config)
    ckpt_dir = Path(cfg.run_dir) / "checkpoint"
    attempts_file = ckpt_dir / "steps" / f"{args.step:04d}.attempts.jsonl"
    stack = contextlib.ExitStack()  # the web task's local site, for as long as the programs are used
    parts = task_parts(cfg, stack)
    make, load = parts.make, parts.load
    trainset = load(cfg.task.trainset, limit=cfg.task.train_limit, offset=cfg.task.train_offset)
    groups = _groups(attempts_file, trainset)
    if not groups:
        sys.exit(f"no rollouts in {attempts_file}: run `tfgrpo compile {args.config}` first")
    kept = [g for g in groups if g.informative]
    prev = ckpt_dir / "steps" / f"{args.step - 1:04d}.json"
    start = ExperienceLibrary.from_state(json.loads(prev.read_text())["library"]) if prev.exists() else \
        ExperienceLibrary(max_words=cfg.optimizer.max_words_per_experience)
    print(f"step {args.step}: {len(groups)} queries, {len(kept)} with reward contrast, library of {len(start)}")
    queries = {g.key: str(g.example.inputs().toDict()) for g in groups}
    program = make()
    lines = []
    with stack, open_lms(cfg) as (policy, reflection, _):
        dspy.configure(lm=policy)
        for path in args.paths.split(","):
            knobs = {**cfg.optimizer_knobs(), "learning_path": path}
            t0 = time.time()
            allowed = " ".join(p.signature.instructions for _, p in program.named_predictors())
            lessons, usage = learn_from_groups(  # the learning path alone, on the groups scored by the compile
                ContrastPath() if path == "contrast" else PaperPath(), kept, settings=Knobs(**knobs), reflection_lm=reflection,
                library=start, instructions=allowed)
            plan, proposals = lessons.plan, lessons.proposals
            seconds = time.time() - t0
            library = start.copy()
            report = library.apply(plan, step=args.step, sources=sorted({q for q, _ in proposals}))
            calls = sum(u.get("calls", 0) for u in usage.values())
            # the same test for both paths: each proposal alone against the starting library, plus generality
            proposed = lessons.operations_proposed  # contrast: includes refused rules
            valid = sum(_valid(start, op, queries[key], allowed) for key, op in proposals)
            print(f"\n{path}: {calls} calls in {seconds:.0f} s; {proposed} proposed, {valid} valid, plan of "
                  f"{len(plan)}, {len(report.rejected)} refused when applied; library:")
            for text in library.texts():
                print(f"  - {text}")
            lines.append(f"learning_paths: path={path} calls={calls} seconds={seconds:.0f} proposed={proposed} "
                         f"valid={valid} valid_ops={valid / proposed if proposed else 0:.2f} library={len(library)}")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
