"""Whether a paced run stays under a provider's requests-a-minute limit, in one process and in several on one key.

Against `tfgrpo.testing.FakeLMServer` (a simulator, not a real API) taking `--rpm` requests in any sliding minute and
answering the rest 429 with the wait as Retry-After: for each count N of `--processes`, N compiles at once, each in a
process of its own with its LM paced by a `RequestPacer` at `--rpm // N` (`max_requests_per_minute`), the default
construction (the `paper` preset), `--train` training sums each, on `--threads` threads. A request refused and
retried (DSPy's `num_retries`) reaches the provider again: every request the provider saw counts.

    python -m benchmarks.rate_limit --rpm 30 --processes 1,2 --train 2
    python -m benchmarks.rate_limit --rpm 300 --processes 1,2 --train 12

One line per process count: `rate_limit: rpm=R processes=N pacer=P engine=E requests=Q answered=A refused=F
share_429=S minutes=M floor=L`, where `floor` is the least such a run takes (the first minute's R at once, then R a
minute).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy
from benchmarks.api_run import MODEL, metric, trainset
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.spend import RequestPacer
from tfgrpo.testing import FakeLMServer, dspy_prices
# isort: on


def child(args) -> None:
    """One compile against the server at `--api-base`, paced at `--pacer` requests a minute."""
    lm = dspy.LM(MODEL, api_base=args.api_base, api_key="x", cache=False, num_retries=8, max_tokens=512,
                 callbacks=[RequestPacer(args.pacer)], engine=args.engine)
    with dspy.context(lm=lm):
        TrainingFreeGRPO(metric, num_threads=args.threads, log_dir=args.log_dir, progress=lambda *_: None).compile(
            dspy.Predict("question -> answer"), trainset=trainset(args.train, start=args.start))


def measure(rpm: int, processes: int, args, root: Path) -> str:
    """`processes` compiles at once against one server taking `rpm` requests a sliding minute."""
    pacer = rpm // processes
    with FakeLMServer(prices={MODEL: dspy_prices(MODEL)}, token_chars=4, rate_limit_rpm=rpm) as server:
        started = time.time()
        names = [root / f"rpm{rpm}-n{processes}-{i}" for i in range(processes)]
        runs = [subprocess.Popen([sys.executable, "-m", "benchmarks.rate_limit", "--child", "--api-base",
                                  server.api_base, "--pacer", str(pacer), "--train", str(args.train), "--start",
                                  str(i * args.train), "--threads", str(args.threads), "--engine", args.engine,
                                  "--log-dir", str(name)],
                                 cwd=Path(__file__).parent.parent, stdout=subprocess.DEVNULL,
                                 stderr=open(f"{name}.log", "w"))
                for i, name in enumerate(names)]
        codes = [run.wait() for run in runs]
        minutes, stats = (time.time() - started) / 60, server.stats()
    for code, name in zip(codes, names):
        if code:
            raise SystemExit(f"a compile exited {code}:\n{Path(f'{name}.log').read_text()[-3000:]}")
    answered, refused = stats["statuses"].get("200", 0), stats["statuses"].get("429", 0)
    return (f"rate_limit: rpm={rpm} processes={processes} pacer={pacer} engine={args.engine} requests={stats['calls']} "
            f"answered={answered} refused={refused} share_429={refused / max(stats['calls'], 1):.3f} "
            f"minutes={minutes:.2f} floor={max(answered - rpm, 0) / rpm:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rpm", type=int, default=30, help="the provider's requests in any sliding minute")
    ap.add_argument("--processes", default="1,2", help="process counts, each run on a fresh server")
    ap.add_argument("--train", type=int, default=2, help="training sums per compile")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--engine", default="auto", choices=["auto", "litellm"], help="DSPy's way to the provider: its "
                    "own client where it can (auto), or LiteLLM's, whose first call sets itself up first")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--api-base", help=argparse.SUPPRESS)
    ap.add_argument("--pacer", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        for processes in [int(n) for n in args.processes.split(",")]:
            print(measure(args.rpm, processes, args, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
