"""Does the embedded model learn? Baseline vs compiled on held-out Game of 24 puzzles, paired, several seeds,
with the 1.5B model as both the policy and the reflection LM; and DSPy's SIMBA on the same split.

    .venv/bin/python -m benchmarks.local_learning --seeds 2 --train 8 --eval 50      # ~1 h on 2 cores

Per seed s: Training-Free GRPO compiles the Game of 24 program on training puzzles (ranks from
--train-offset + s * --train; partial-credit reward; contrast path; --max-demos winning attempts kept as
demos, 0 for experiences alone), then the baseline and the compiled program are
evaluated on the same held-out test puzzles with the same sampling run (rollout_id = s, temperature 0.3),
scored by the strict verifier (solved or not). SIMBA (dspy.SIMBA, same training puzzles, same reward, a
comparable number of LM calls) is evaluated the same way against the same baseline rows. Differences are
taken per puzzle (mean over seeds) with a 95% paired bootstrap CI over puzzles. Every evaluation is written
to --out as it finishes, and compiles resume from their checkpoints, so an interrupted run continues.

Last lines, one per optimizer:
  local_learning: optimizer=tfgrpo task=game24 seeds=N problems=M valid_ops=0.xx library=K baseline=... ...
valid_ops = operations that passed validation / operations proposed (all seeds); library = the smallest final
library over the seeds; for SIMBA, library counts the rules and demos it added.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.common import add_endpoint_args, endpoint
from tfgrpo.evaluate import evaluate_program, paired_difference, read_rows, summarize, write_rows
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import load_program, save_program
from tfgrpo.programs.generality import specific_terms
from tfgrpo.tasks.game24 import Game24Solver, game24_metric, game24_reward, load_game24


def _evaluate(program, evalset, lm, threads: int, path: Path) -> list[dict]:
    """Evaluate, or reuse the rows an interrupted run already wrote."""
    if path.exists():
        return read_rows(path)
    rows = evaluate_program(program, evalset, game24_metric, lm=lm, num_threads=threads, name=path.stem)
    write_rows(rows, path)
    return rows


def _simba(trainset, args, seed: int, path: Path) -> tuple[dspy.Module, int]:
    """SIMBA on the same puzzles and reward; returns the program and how many rules/demos it added."""
    if path.exists():
        program = Game24Solver()
        program.load(str(path))
    else:
        reward = lambda example, pred, trace=None: float(game24_reward(example, pred).score)  # noqa: E731
        simba = dspy.SIMBA(metric=reward, bsize=len(trainset), num_candidates=args.simba_candidates,
                           max_steps=args.simba_steps, max_demos=2, num_threads=args.threads)
        program = simba.compile(Game24Solver(), trainset=trainset, seed=seed)
        program.save(str(path))
    base = Game24Solver().write_program.signature.instructions
    p = program.write_program
    added = int(p.signature.instructions.strip() != base.strip()) + len(p.demos)
    return program, added


def _line(name, seeds, base_rows, rows, valid_ops, library) -> str:
    paired = paired_difference(base_rows, rows)
    lo, hi = paired["ci95"]
    return (f"local_learning: optimizer={name} task=game24 seeds={seeds} problems={paired['problems']} "
            f"valid_ops={valid_ops} library={library} baseline={summarize(base_rows)['mean_at_k']:.3f} "
            f"compiled={summarize(rows)['mean_at_k']:.3f} lift={paired['difference']:+.3f} ci_low={lo:+.3f} "
            f"ci_high={hi:+.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--train", type=int, default=8, help="training puzzles per seed")
    ap.add_argument("--train-offset", type=int, default=200)
    ap.add_argument("--eval", type=int, default=50, help="held-out test puzzles")
    ap.add_argument("--eval-offset", type=int, default=24, help="skip the test puzzles the main job evaluates on")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-demos", type=int, default=2, help="winning attempts kept as demos (0: experiences only)")
    ap.add_argument("--simba-seeds", type=int, default=1, help="0 skips SIMBA")
    ap.add_argument("--simba-steps", type=int, default=1)
    ap.add_argument("--simba-candidates", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default="runs/bench-local-learning")
    add_endpoint_args(ap)
    args = ap.parse_args()

    out = Path(args.out)
    evalset = load_game24("game24_test", limit=args.eval, offset=args.eval_offset)
    started = time.time()
    with endpoint(args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=args.max_tokens, timeout=300,
                           num_retries=2, cache=False)
        dspy.configure(lm=lm)
        rows = {"baseline": [], "tfgrpo": [], "simba": []}
        proposed = valid = 0
        libraries, specific, simba_added = [], 0, []
        for seed in range(args.seeds):
            d = out / f"seed{seed}"
            trainset = load_game24("game24_train", limit=args.train, offset=args.train_offset + seed * args.train)
            t0 = time.time()
            optimizer = TrainingFreeGRPO(game24_reward, num_generations=args.generations,
                                         num_train_epochs=args.epochs, batch_size=args.batch,
                                         max_operations_per_group=1, num_threads=args.threads, seed=seed,
                                         learning_path="contrast", constrained_decoding="json_object",
                                         max_demos=args.max_demos,
                                         log_dir=str(d / "checkpoint"))
            compiled = optimizer.compile(Game24Solver(), trainset=trainset)
            save_program(compiled, d / "program.json")
            for s in compiled.detailed_results.to_dict()["steps"]:
                proposed += s.get("operations_proposed", 0)
                valid += s.get("operations_proposed", 0) - s["details"].get("refused_specific", 0) - s.get("operations_rejected", 0)
            texts = compiled.experience_library.texts()
            libraries.append(len(texts))
            specific += sum(bool(specific_terms(t, ex.numbers)) for t in texts for ex in trainset)
            compile_s = time.time() - t0
            run_lm = lm.copy(rollout_id=seed)  # the same sampling run for every program of this seed
            b = _evaluate(Game24Solver(), evalset, run_lm, args.threads, d / "baseline.jsonl")
            c = _evaluate(load_program(Game24Solver(), d / "program.json"), evalset, run_lm, args.threads,
                          d / "compiled.jsonl")
            rows["baseline"] += b
            rows["tfgrpo"] += c
            print(json.dumps({"seed": seed, "compile_s": round(compile_s), "library": texts,
                              "demos": len(compiled.write_program.demos),
                              "baseline": summarize(b)["mean_at_k"], "compiled": summarize(c)["mean_at_k"]}),
                  flush=True)
            if seed < args.simba_seeds:
                program, added = _simba(trainset, args, seed, d / "simba.json")
                simba_added.append(added)
                rows["simba"] += _evaluate(program, evalset, run_lm, args.threads, d / "simba.jsonl")
                print(json.dumps({"seed": seed, "simba_added": added,
                                  "simba": summarize(rows["simba"][-len(evalset):])["mean_at_k"]}), flush=True)
    print(f"wall time {(time.time() - started) / 60:.1f} min; experiences repeating a training puzzle's numbers: "
          f"{specific}")
    print(_line("tfgrpo", args.seeds, rows["baseline"], rows["tfgrpo"],
                f"{valid / proposed:.2f}" if proposed else "na", min(libraries)))
    if rows["simba"]:  # against the baseline rows of the same seeds
        seeds = min(args.simba_seeds, args.seeds)
        print(_line("simba", seeds, rows["baseline"][: len(evalset) * seeds], rows["simba"], "na", min(simba_added)))


if __name__ == "__main__":
    main()
