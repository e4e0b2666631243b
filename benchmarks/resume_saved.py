"""The current code's decisions over the rollouts a peers run saved, with no LM call.

Each seed's checkpoint of a saved `benchmarks.peers` arm is copied and the default construction (`tfgrpo-default`)
compiles again from it: every attempt, reward, learning call and probe attempt the saved run made is reused, so the
same draws meet the current rules. Where the current code stops sooner, the later steps are not run; a step whose
probe is skipped asks for no lesson (step.py, issue 66), so the learning calls the saved run made there are not
counted, nor (prorated) the rollout calls of attempts a step that ended at its first look no longer makes. Delete a
saved step's `done.json` to have the current code decide it again. An LM call the saved run does not cover stops the
script: the replay would no longer be the same draws.

The program each seed keeps is written beside its checkpoint; where it is the saved one, so is its held-out
`eval.jsonl`, and `python -m benchmarks.peers --out OUT --task T --arms tfgrpo-default` then evaluates only the
programs that changed, and reports.

    python -m benchmarks.resume_saved --task game24 \
        --source benchmarks/results/peers/game24/tfgrpo-default-first-stops --out runs/resume-saved

Last lines, one per seed:
  resumed: task=T seed=S steps=N calls=C metric_calls=M not_asked=K program=same|changed stopped=WHY
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.common import DEFAULT_MODEL
from benchmarks.peers import MAIN_ARM, Counted, compile_arm, task_parts
from benchmarks.same_run import saved as program_state
from tfgrpo.programs import save_program


class NoCalls(dspy.LM):
    """The saved run's LM by name, which answers nothing: a call means the replay left the saved draws."""

    def forward(self, *args, **kwargs):
        raise SystemExit("resume_saved: the current code asked the LM for something the saved run never asked; "
                         "the replay is no longer the same draws")


def not_asked(steps: list, checkpoint: Path) -> dict:
    """The calls (and their tokens) that the saved steps made and the current code does not ask for: the learning calls
    of a step whose probe was skipped, and the share of a step's rollout calls for the attempts it no longer makes (a
    step that ended at its first look: prorated by attempts, since the saved usage is per stage, not per attempt)."""
    cut = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for stats in steps:
        saved = len(list((checkpoint / "steps" / f"{stats.step:04d}" / "rollouts").glob("*.json")))
        made = stats.metric_calls - (stats.probe or {}).get("attempts_run", 0)
        share = {"rollout": 1 - made / saved if saved > made else 0.0}
        if (stats.probe or {}).get("skipped"):
            share.update({stage: 1.0 for stage in stats.usage if stage not in ("rollout", "probe")})
        for stage, used in stats.usage.items():
            for k in cut:
                cut[k] += round(used.get(k, 0) * share.get(stage, 0.0))
    return cut


def resume(task: str, seed: int, source: Path, out: Path, args) -> str:
    make_student, reward, _, load_train, _ = task_parts(task)
    saved, where = source / f"seed{seed}", out / task / MAIN_ARM / f"seed{seed}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    shutil.copytree(saved / "checkpoint", where / "checkpoint")
    lm = NoCalls(f"openai/{args.model}", api_base="http://127.0.0.1:9/v1", api_key="local", temperature=0.3,
                 max_tokens=512, extra_body={"max_tokens": 512}, timeout=300, num_retries=0, cache=False)  # as peers'
    with dspy.context(lm=lm):
        compiled = compile_arm(MAIN_ARM, make_student(), Counted(reward), load_train(args.train, args.train_offset),
                               lm, seed, args, where)
    result = compiled.detailed_results
    run = {k: sum(u.get(k, 0) for u in result.run_usage.values())
           for k in ("calls", "prompt_tokens", "completion_tokens", "cached_tokens")}
    cut = not_asked(result.steps, where / "checkpoint")
    save_program(compiled, where / "program.json")
    same = program_state(where / "program.json") == program_state(saved / "program.json")  # where it learned aside
    if same and (saved / "eval.jsonl").exists():
        shutil.copy(saved / "eval.jsonl", where / "eval.jsonl")
    info = {**{k: v - cut[k] for k, v in run.items()}, "metric_calls": sum(s.metric_calls for s in result.steps),
            "resumed": True, "replayed_from": str(saved), "not_asked": cut, "steps": len(result.steps),
            "stopped_early": result.stopped_early}
    (where / "compile.json").write_text(json.dumps(info))
    return (f"resumed: task={task} seed={seed} steps={info['steps']} calls={info['calls']} "
            f"metric_calls={info['metric_calls']} not_asked={cut['calls']} program={'same' if same else 'changed'} "
            f"stopped={result.stopped_early or 'no'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="game24", choices=["game24", "gsm8k"])
    ap.add_argument("--source", required=True, help="a saved peers arm: its seed*/checkpoint and program.json")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="runs/resume-saved")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model the saved run used (its runs are named by it)")
    ap.add_argument("--train", type=int, default=12)
    ap.add_argument("--train-offset", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.generations, args.match_calls = 4, None  # (what compile_arm reads; the default construction sets its own)
    for seed in [int(s) for s in args.seeds.split(",")]:
        print(resume(args.task, seed, Path(args.source), Path(args.out), args), flush=True)


if __name__ == "__main__":
    main()
