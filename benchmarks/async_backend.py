"""Threads against the asyncio backend on a provider with latency and a rate limit: one compile's wall time against
its floor.

The provider is `tfgrpo.testing.FakeLMServer` in a process of its own (a simulator on this machine, not a real API):
each reply waits a latency drawn from a lognormal (median `--median` s, `--sigma`), the same for the same request in
every run, and with `--rpm` it takes that many requests a sliding minute and answers the rest 429 with the wait as
Retry-After. The compile is `benchmarks.step_latency`'s: one step of the paper's path (batch `--batch`, G `--group`,
dspy.Predict), paced with `RequestPacer(--rpm)` where a limit is set. It runs once per configuration
(`--configs`, backend:in_flight), each on a fresh server:

    floor_s    the least any backend could take: the longest chain of dependent calls in the latencies the server drew
               (step_latency's critical path), or, where the limit binds, the time the limit lets the requests through
               (the first minute's `--rpm` at once, then `--rpm` a minute), whichever is longer
    wall_s     the compile's wall time; ratio = wall_s / floor_s
    share_429  requests the provider refused for the rate limit, of all it received
    rss_mib    the peak resident memory of this process during that compile
    calls_equal / lost   whether every configuration sent the same answered calls and learned the same library, and
               the attempts that got no answer (left out of their groups)

The last line: `async: in_flight=.. wall_s=.. threads_wall_s=T1:W1,T2:W2 floor_s=.. share_429=.. calls_equal=..`.

    python -m benchmarks.async_backend                                  # B=50, G=5, median 1 s, sigma 0.5, 6000 rpm
    python -m benchmarks.async_backend --rpm 300                        # a limit that binds: paced by RequestPacer
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

# isort: off
import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy
from benchmarks.step_latency import critical_path, make_program, metric, trainset
from tfgrpo.optimizers import RequestPacer, TrainingFreeGRPO
from tfgrpo.testing import FakeLMServer
# isort: on


def peak_rss_mib() -> float:
    """This process's peak resident memory since the last `reset_peak_rss()` (Linux's VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def one(backend: str, in_flight: int, args) -> dict:
    """One compile on `backend` with `in_flight` units at once, on a fresh server: its figures."""
    with FakeLMServer(latency=args.median, latency_dist="lognormal", latency_sigma=args.sigma, seed=0,
                      rate_limit_rpm=args.rpm, retry_after=1, process=True) as server:
        lm = server.lm(timeout=120, num_retries=10, callbacks=[RequestPacer(args.rpm)] if args.rpm else [])
        optimizer = TrainingFreeGRPO(metric, num_generations=args.group, num_train_epochs=1,
                                     batch_size=args.batch, num_threads=in_flight, backend=backend, seed=0,
                                     progress=lambda *_: None)
        reset_peak_rss()
        t0 = time.perf_counter()
        with dspy.context(lm=lm):
            compiled = optimizer.compile(make_program(1), trainset=trainset(args.batch))
        wall = time.perf_counter() - t0
        stats = server.stats()
    answered = stats["statuses"].get("200", 0)
    step = compiled.detailed_results.to_dict()["steps"][0]
    rate_floor = 60 * max(answered - args.rpm, 0) / args.rpm if args.rpm else 0.0
    floor = max(critical_path([x for x in stats["log"]]), rate_floor)
    return {"backend": backend, "in_flight": in_flight, "wall_s": wall, "floor_s": floor, "answered": answered,
            "share_429": stats["statuses"].get("429", 0) / max(stats["calls"], 1), "rss_mib": peak_rss_mib(),
            "lost": step["failed_calls"], "library": compiled.experience_library.dump_state(),
            "max_in_flight": stats["max_in_flight"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--group", "-G", type=int, default=5)
    ap.add_argument("--median", type=float, default=1.0, help="median seconds of a reply")
    ap.add_argument("--sigma", type=float, default=0.5, help="sigma of the lognormal latency")
    ap.add_argument("--rpm", type=int, default=6000, help="the provider's requests a sliding minute (0: no limit)")
    ap.add_argument("--configs", default="threads:16,threads:64,async:256",
                    help="backend:in_flight, comma-separated; the last async one is the line's")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for config in args.configs.split(","):
        backend, in_flight = config.split(":")
        rows.append(one(backend, int(in_flight), args))
        r = rows[-1]
        print(f"{backend}:{in_flight}: wall_s={r['wall_s']:.2f} floor_s={r['floor_s']:.2f} "
              f"ratio={r['wall_s'] / r['floor_s']:.2f} answered={r['answered']} share_429={r['share_429']:.3f} "
              f"rss_mib={r['rss_mib']:.0f} lost={r['lost']} server_max_in_flight={r['max_in_flight']}", flush=True)
    equal = all(r["answered"] == rows[0]["answered"] and r["library"] == rows[0]["library"] for r in rows)
    last = next(r for r in reversed(rows) if r["backend"] == "async")
    threads = ",".join(f"{r['in_flight']}:{r['wall_s']:.2f}" for r in rows if r["backend"] == "threads")
    print(f"async: in_flight={last['in_flight']} wall_s={last['wall_s']:.2f} threads_wall_s={threads or '-'} "
          f"floor_s={last['floor_s']:.2f} share_429={last['share_429']:.3f} "
          f"calls_equal={'true' if equal else 'false'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
