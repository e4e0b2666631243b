"""Baseline vs Training-Free GRPO on the embedded model, on held-out GSM8K test problems, paired, several seeds.

    .venv/bin/python -m benchmarks.local_math --train 8 --eval 50 --seeds 2     # ~50 min on 2 cores (1.5B)

For each seed s: compile a ChainOfThought program on GSM8K *train* problems (seed s shuffles and samples the
rollouts), then evaluate the baseline and the compiled program on the same GSM8K *test* problems with the
same sampling run (rollout_id = s, temperature 0.3). The difference is taken per problem (mean over seeds)
and a 95% bootstrap CI is computed over problems. Everything is written to --out so the figures can be
rebuilt; the last line is `local_math: baseline=<acc> compiled=<acc> diff=<d> ci95=[<lo>, <hi>] n=<problems>`.
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
from tfgrpo.programs import save_program
from tfgrpo.tasks.math.datasets import load_math
from tfgrpo.tasks.math.metric import math_metric
from tfgrpo.tasks.math.programs import direct_program


def _evaluate(program, evalset, lm, args, path: Path, seed: int) -> list[dict]:
    """Evaluate, or reuse the rows a previous (interrupted) run already wrote for this seed and program."""
    if path.exists():
        return read_rows(path)
    rows = evaluate_program(program, evalset, math_metric, lm=lm, num_threads=args.threads, name=path.stem)
    for r in rows:
        r["seed"] = seed
    write_rows(rows, path)  # written at once: an interrupted benchmark keeps every finished evaluation
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=8, help="GSM8K train problems per compile")
    ap.add_argument("--eval", type=int, default=50, help="GSM8K test problems (held out)")
    ap.add_argument("--eval-offset", type=int, default=100, help="skip the first test problems (the main job uses them)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--out", default="runs/bench-local-math")
    add_endpoint_args(ap)
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    evalset = load_math("gsm8k_test", limit=args.eval, offset=args.eval_offset)
    started = time.time()
    with endpoint(args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=args.max_tokens,
                           timeout=300, num_retries=2, cache=False)
        dspy.configure(lm=lm)
        base_rows, comp_rows, per_seed = [], [], []
        for seed in range(args.seeds):
            trainset = load_math("gsm8k_train", limit=args.train, offset=seed * args.train)
            t0 = time.time()
            compiled = TrainingFreeGRPO(math_metric, num_generations=args.generations, num_train_epochs=1,
                                        batch_size=args.train, num_threads=args.threads, seed=seed,
                                        log_dir=str(out / f"seed{seed}" / "checkpoint")).compile(
                direct_program(), trainset=trainset)
            compile_s = time.time() - t0
            save_program(compiled, out / f"seed{seed}" / "program.json")
            run_lm = lm.copy(rollout_id=seed)  # the same sampling run for both programs
            t0 = time.time()
            b = _evaluate(direct_program(), evalset, run_lm, args, out / f"seed{seed}" / "baseline.jsonl", seed)
            c = _evaluate(compiled, evalset, run_lm, args, out / f"seed{seed}" / "compiled.jsonl", seed)
            base_rows += b
            comp_rows += c
            per_seed.append({"seed": seed, "library_size": len(compiled.experience_library),
                             "experiences": compiled.experience_library.texts(), "compile_s": round(compile_s),
                             "eval_s": round(time.time() - t0), "baseline": summarize(b)["mean_at_k"],
                             "compiled": summarize(c)["mean_at_k"]})
            print(json.dumps(per_seed[-1]), flush=True)

    paired = paired_difference(base_rows, comp_rows)
    result = {"model": args.model, "train_per_seed": args.train, "eval_problems": len(evalset),
              "eval_offset": args.eval_offset, "seeds": args.seeds, "per_seed": per_seed,
              "baseline": summarize(base_rows)["mean_at_k"], "compiled": summarize(comp_rows)["mean_at_k"],
              "paired": paired, "wall_s": round(time.time() - started)}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"wall time {result['wall_s'] / 60:.1f} min; per-problem wins {paired['wins']}, losses {paired['losses']}")
    print(f"local_math: baseline={result['baseline']:.3f} compiled={result['compiled']:.3f} "
          f"diff={paired['difference']:+.3f} ci95=[{paired['ci95'][0]:+.3f}, {paired['ci95'][1]:+.3f}] "
          f"n={paired['problems']}")


if __name__ == "__main__":
    main()
