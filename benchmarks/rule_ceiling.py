"""How far can a library move the Game of 24 student? Baseline vs fixed libraries, paired, on training puzzles.

    .venv/bin/python -m benchmarks.rule_ceiling --problems 8 --runs 2                       # ~15 min on 2 cores
    .venv/bin/python -m benchmarks.rule_ceiling --learned runs/local-game24/library.json    # add learned arms
    .venv/bin/python -m benchmarks.rule_ceiling --learned runs/local-game24/program.json    # (rules and demos)

This separates the two halves of learning on the embedded model: can the student use an experience at all,
and does the reflector write experiences worth using? Arms, each evaluated on the same training puzzles
(ranks --offset.., never the test puzzles) with the same sampling runs (rollout_id = run, temperature 0.3):
  baseline        no library
  learned:FILE    each --learned given: a library.json (the learned rules alone) or a program.json (everything
                  the compiled program carries: rules and demos), both written by `tfgrpo compile`
  oracle:*        reference rules written by a person, NOT learned: the whole search procedure, and its two
                  halves (search coverage alone, robustness alone). They measure the ceiling, nothing more.
Last lines, one per arm (lift and its 95% paired bootstrap CI over puzzles are against the baseline):
  rule_ceiling: arm=NAME problems=M runs=R solved=k/n rate=0.xxx lift=+0.xxx ci_low=+0.xxx ci_high=+0.xxx
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)

from benchmarks.common import add_endpoint_args, endpoint
from tfgrpo.evaluate import evaluate_program, paired_difference
from tfgrpo.lms import local_dspy_lm
from tfgrpo.programs import ExperienceLibrary, load_program
from tfgrpo.programs.inject import apply_library
from tfgrpo.signatures.operations import Operation
from tfgrpo.tasks.game24 import Game24Solver, game24_metric, load_game24

ORACLE = {  # written by hand for this benchmark; never used by the optimizer
    "oracle:full": "Start the program with numbers = [the four given numbers]. Loop over itertools.permutations(numbers) "
                   "and itertools.product('+-*/', repeat=3); for each, build the five parenthesizations as f-strings, "
                   "eval each inside try/except ZeroDivisionError, and print the first expression whose value is "
                   "within 1e-6 of 24.",
    "oracle:search": "Loop over itertools.permutations(numbers) and itertools.product('+-*/', repeat=3) to try every "
                     "order of the numbers with every choice of operators.",
    "oracle:robust": "Start the program with numbers = [the four given numbers], wrap each eval in try/except, and "
                     "print the first expression whose value is within 1e-6 of 24.",
}


def _oracle(text: str):
    library = ExperienceLibrary(max_words=80)
    report = library.apply([Operation(action="add", text=text)], step=0)
    if report.rejected:  # an arm without its rule would pass for a measurement of it
        raise ValueError(f"oracle rule refused: {report.rejected[0][1]}")
    return apply_library(Game24Solver(), library)


def _learned(path: Path):
    if path.name == "library.json":
        return apply_library(Game24Solver(), ExperienceLibrary.from_state(json.loads(path.read_text())))
    return load_program(Game24Solver(), path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--offset", type=int, default=300, help="first training puzzle (rank - 1)")
    ap.add_argument("--runs", type=int, default=2, help="sampling runs per puzzle")
    ap.add_argument("--learned", action="append", default=[], help="a library.json or program.json of a run")
    ap.add_argument("--no-oracle", action="store_true", help="skip the hand-written reference rules")
    ap.add_argument("--threads", type=int, default=2)
    add_endpoint_args(ap)
    args = ap.parse_args()

    puzzles = load_game24("game24_train", limit=args.problems, offset=args.offset)
    arms = {f"learned:{Path(p).parent.name}/{Path(p).name}": _learned(Path(p)) for p in args.learned}
    if not args.no_oracle:
        arms.update({name: _oracle(text) for name, text in ORACLE.items()})
    with endpoint(args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=512, timeout=300, num_retries=2,
                           cache=False)
        base = evaluate_program(Game24Solver(), puzzles, game24_metric, lm=lm, num_runs=args.runs,
                                num_threads=args.threads, name="baseline")
        results = {"baseline": base}
        for name, program in arms.items():
            results[name] = evaluate_program(program, puzzles, game24_metric, lm=lm, num_runs=args.runs,
                                             num_threads=args.threads, name=name)
    for name, rows in results.items():
        solved = sum(r["score"] >= 1 for r in rows)
        paired = paired_difference(base, rows)
        lo, hi = paired["ci95"]
        print(f"rule_ceiling: arm={name} problems={len(puzzles)} runs={args.runs} solved={solved}/{len(rows)} "
              f"rate={solved / len(rows):.3f} lift={paired['difference']:+.3f} ci_low={lo:+.3f} ci_high={hi:+.3f}")


if __name__ == "__main__":
    main()
