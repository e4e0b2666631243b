"""What each item a compile kept is worth: the attribution of `attribution=True` (src/tfgrpo/optimizers/worth.py), run on programs
a benchmark saved, on held-out problems that neither their compile nor any evaluation of this project uses.

    .venv/bin/python -m benchmarks.worth --task game24 --runs benchmarks/results/peers/game24/tfgrpo-probed-wide+demos --prune
    .venv/bin/python -m benchmarks.worth --task gsm8k --runs benchmarks/results/peers/gsm8k/tfgrpo-probed-wide+demos --seeds 2

Each seed folder's program.json is loaded into a fresh student; its items are the experiences in its instructions and
its demos. Each is left out in turn (Shapley above 8 items), paired per problem with a 95% bootstrap CI, beside two
controls: nothing learned, and an irrelevant text of the same length. --prune also drops items worth <= 0, one at a
time, chosen on half the problems and checked on the other half. The held-out problems: Game of 24 test ranks 925-948 (the main
job evaluates on 901-924, the peers benchmark on 953-1000); GSM8K the --queries test problems before the peers
benchmark's last 48. Every run is saved in the seed folder (worth-checkpoint/), so an interrupted measurement goes
on where it stopped; the result is the seed folder's worth.json. The LM samples at temperature 0.3, with the seed as
its rollout ID, as the peers benchmark evaluates. One line per seed:
  worth: task=T seed=S items=K library=+X ci_low=L control=+C ci_low_vs_control=LC pruned=P
after `#` lines with each item's worth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy

from benchmarks.common import add_endpoint_args, endpoint
from benchmarks.peers import task_parts
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.record import Record
from tfgrpo.optimizers.runner import Run
from tfgrpo.optimizers.judge import carried_demos
from tfgrpo.optimizers.worth import Attribution, Learned
from tfgrpo.programs.inject import library_from_instructions
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.report import worth_markdown

HELD_OUT = {"game24": 24, "gsm8k": 1319 - 48}  # game24: test offset of rank 925; gsm8k: where the peers' 48 start


def learned_items(program: dspy.Module) -> Learned:
    """The library in a loaded program's instructions and its demos, each demo a one-call trace of its predictor."""
    targets = [name for name, _ in program.named_predictors()]
    library = library_from_instructions(program, targets) or ExperienceLibrary()
    return Learned(library, carried_demos(program, targets))


def measure(where: Path, args, lm: dspy.LM) -> str:
    make_student, _, metric, _, load_eval = task_parts(args.task)
    program = make_student()
    program.load(str(where / "program.json"))
    start = HELD_OUT[args.task] - (args.queries if args.task == "gsm8k" else 0)
    seed = int(where.name.removeprefix("seed"))
    knobs = Knobs(attribution=True, prune=args.prune, num_threads=args.threads, seed=seed, progress=lambda *_: None)
    store = Checkpoint(where / "worth-checkpoint")  # a measurement stopped part way goes on from its record of calls
    with store.locked(), dspy.context(lm=lm.copy(rollout_id=seed)), \
            Run(knobs=knobs, metric=metric, record=Record(store.root), store=store) as run:
        base = make_student()
        worth, _ = Attribution(run).measure(base, [n for n, _ in base.named_predictors()], learned_items(program),
                                            load_eval(args.queries, start))
    (where / "worth.json").write_text(json.dumps(worth.to_dict(), indent=2, ensure_ascii=False))
    for line in worth_markdown(worth.to_dict()).splitlines():
        print(f"# {line}")
    return worth.line(args.task, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="game24", choices=sorted(HELD_OUT))
    ap.add_argument("--runs", required=True, help="an arm's folder: its seed*/program.json are measured")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: every seed folder)")
    ap.add_argument("--queries", type=int, default=24, help="held-out problems")
    ap.add_argument("--prune", action="store_true", help="also prune, choosing on half the problems")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=512)
    add_endpoint_args(ap)
    args = ap.parse_args()
    folders = sorted(Path(args.runs).glob("seed*/program.json"))
    if args.seeds is not None:
        folders = [f for f in folders if f.parent.name.removeprefix("seed") in args.seeds.split(",")]
    if not folders:
        raise SystemExit(f"no seed*/program.json under {args.runs}")
    with endpoint(args, n_ctx=8192) as api_base:
        lm = local_dspy_lm(args.model, api_base, temperature=0.3, max_tokens=args.max_tokens, timeout=300,
                           num_retries=2, cache=False)
        lines = [measure(f.parent, args, lm) for f in folders]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
