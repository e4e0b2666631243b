"""A program learned on one model, carried to another: what it is worth there unchanged, refit, refit and learned on,
against a fresh compile on the new model. Paired on the same held-out problems, several seeds.

    .venv/bin/python -m benchmarks.carry --task game24 --model qwen2.5-coder-0.5b --seeds 0,1,2
    .venv/bin/python -m benchmarks.carry --task gsm8k --program runs/x/program.json --from qwen2.5-coder-0.5b \
        --model qwen2.5-coder-1.5b

The carried program is `--program` (default: the task's shipped program, `tfgrpo show TASK`, learned by the embedded
1.5B). On `--model` (the model it is carried to), per seed, the arms (`--arms`, all by default):
  baseline     the uncompiled program;
  carried      the carried program, unchanged;
  refit        `refit=True, num_train_epochs=0`: each carried item measured on the new model on `--refit-queries`
               training queries outside the trainset (no held-out problem), what does not help left out;
  refit_steps  the refit, then the default's steps on the trainset (the main job's 12 puzzles for game24);
  fresh        the default construction compiled from the uncompiled program on the same trainset.
Each is evaluated on `--problems` problems of the held-out split the shipped program was scored on, sampled as
`benchmarks.peers` samples (temperature 0.3, rollout_id = seed). Everything is saved under --out/<task>/<from>-to-<to>/
<arm>/seed<s>/ as it finishes, so an interrupted run resumes. The last line:
  carry: task=T from=A to=B seeds=N problems=M baseline=.. carried=.. refit=.. refit_steps=.. fresh=.. calls_refit=..
  calls_fresh=.. ci_low_refit_vs_fresh=..
(scores: the mean over seeds of the share solved; calls: the LM calls of a compile, mean over seeds; an arm not run
prints `-`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.common import add_endpoint_args, endpoint
from benchmarks.peers import Counted, task_parts
from tfgrpo.evaluate import heldout_rows, paired_difference, read_rows, write_rows
from tfgrpo.learned import find
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.spend import metered
from tfgrpo.programs import load_program, save_program

ARMS = ("baseline", "carried", "refit", "refit_steps", "fresh")
HELD_OUT = {"game24": 52, "gsm8k": 1319 - 48}  # where each task's shipped program was scored (its held-out split)


def compiled(arm: str, args, make, reward, lm: dspy.LM, seed: int, where: Path) -> dspy.Module:
    """The arm's program on the new model: compiled (and saved, with what the compile spent) unless saved before."""
    if (where / "program.json").exists():
        return load_program(make(), where / "program.json")
    _, _, _, load_train, _ = task_parts(args.task)
    start = make() if arm == "fresh" else load_program(make(), args.program)
    knobs = {"refit": True, "num_train_epochs": 0} if arm == "refit" else {"refit": True} if arm == "refit_steps" \
        else {}
    counted, t0 = Counted(reward), time.time()
    with metered() as used, dspy.context(lm=lm):
        optimizer = TrainingFreeGRPO(counted, seed=seed, num_threads=args.threads, log_dir=str(where / "checkpoint"),
                                     constrained_decoding="json_object", **knobs)
        program = optimizer.compile(start, trainset=load_train(args.train, args.train_offset),
                                    valset=load_train(args.refit_queries, args.refit_offset) if arm != "fresh" else None)
    save_program(program, where / "program.json")
    refit = program.detailed_results.refit
    (where / "compile.json").write_text(json.dumps({
        "wall_s": round(time.time() - t0, 1), **used.totals(), "metric_calls": counted.calls,
        "pruned": refit.pruned if refit else None,
        "worth": {item.id: item.worth for item in refit.items} if refit else None}))
    return program


def run_arm(arm: str, seed: int, args, lm: dspy.LM) -> None:
    make, reward, metric, _, load_eval = task_parts(args.task)
    where = Path(args.out) / args.task / f"{args.source}-to-{args.model}" / arm / f"seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    if (where / "eval.jsonl").exists():
        return
    program = make() if arm == "baseline" else load_program(make(), args.program) if arm == "carried" else \
        compiled(arm, args, make, reward, lm, seed, where)
    rows = heldout_rows(program, load_eval(args.problems, HELD_OUT[args.task]), metric, lm=lm, seed=seed,
                        num_threads=args.threads, name=arm)
    write_rows(rows, where / "eval.jsonl")
    print(json.dumps({"arm": arm, "seed": seed, "score": statistics.fmean(r["score"] for r in rows)}), flush=True)


def report(args, seeds: list[int]) -> str:
    root = Path(args.out) / args.task / f"{args.source}-to-{args.model}"
    rows = {arm: [dict(r, run=s) for s in seeds if (p := root / arm / f"seed{s}" / "eval.jsonl").exists()
                  for r in read_rows(p)] for arm in ARMS}
    calls = {arm: [json.loads(p.read_text())["calls"] for s in seeds
                   if (p := root / arm / f"seed{s}" / "compile.json").exists()] for arm in ("refit", "fresh")}
    score = {arm: f"{statistics.fmean(r['score'] for r in rs):.3f}" if rs else "-" for arm, rs in rows.items()}
    ci_low = f"{paired_difference(rows['fresh'], rows['refit'])['ci95'][0]:+.3f}" if rows["refit"] and rows["fresh"] \
        else "-"
    spent = {arm: f"{statistics.fmean(c):.0f}" if c else "-" for arm, c in calls.items()}
    return (f"carry: task={args.task} from={args.source} to={args.model} seeds={len(seeds)} problems={args.problems} "
            + " ".join(f"{arm}={score[arm]}" for arm in ARMS)
            + f" calls_refit={spent['refit']} calls_fresh={spent['fresh']} ci_low_refit_vs_fresh={ci_low}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="game24", choices=["game24", "gsm8k"])
    ap.add_argument("--program", default=None, help="the carried program.json (default: the task's shipped one)")
    ap.add_argument("--from", dest="source", default=None, help="the model the program was learned on (default: the "
                    "shipped program's)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--problems", type=int, default=24, help="held-out problems")
    ap.add_argument("--train", type=int, default=12)
    ap.add_argument("--train-offset", type=int, default=100)
    ap.add_argument("--refit-queries", type=int, default=8, help="training queries outside the trainset for the refit")
    ap.add_argument("--refit-offset", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default="runs/bench-carry")
    add_endpoint_args(ap)
    args = ap.parse_args()
    shipped = find(args.task)
    args.program = args.program or str(shipped.program_path)
    args.source = args.source or (shipped.provenance["model"] if args.program == str(shipped.program_path) else "?")
    arms = [a for a in args.arms.split(",") if a]
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"unknown arm(s) {unknown}: the arms are {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    with endpoint(args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=args.max_tokens, timeout=300,
                           num_retries=2, cache=False)
        dspy.configure(lm=lm)
        for seed in seeds:
            for arm in arms:
                run_arm(arm, seed, args, lm)
    print(report(args, seeds))


if __name__ == "__main__":
    main()
