"""How close one optimization step comes to its critical path, against a fake LM with fixed or heavy-tailed latency.

One step (batch B, group G, T LM calls per rollout) has at best this chain of dependent LM calls: for each group
with contrast, its slowest rollout -> its slowest summary -> its advantage; the longest such chain (a group without
contrast: its slowest rollout), then the consolidation. With a fixed latency L that is (T + 3) * L; with
heavy-tailed latency it is read off the latencies the server actually drew (per call, logged by the fake server).
Everything above it is orchestration: stage barriers, thread start-up, DSPy's per-call overhead, connection limits.
The fake server runs in its own process so that its threads neither share the orchestrator's GIL nor count in its
memory.

    python -m benchmarks.step_latency                       # B=50, G=5, Predict (T=1), 0.2 s/call, 256 threads
    python -m benchmarks.step_latency --latency lognormal   # median 0.2 s, sigma 1 (p99 ~2 s), seeded
    python -m benchmarks.step_latency --turns 2             # ReAct: finish + extract (T=2); --turns 3 adds a tool call

The last line is `step_latency: wall=<s> critical_path=<s> ratio=<x>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time


# isort: off
import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
import dspy
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.testing import FakeLMServer
# isort: on

STAGE_KIND = {"rollout": "student", "summary": "summary", "advantage": "advantage", "consolidation": "consolidation"}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def metric(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def make_program(turns: int) -> dspy.Module:
    if turns <= 1:
        return dspy.Predict("question -> answer")
    return dspy.ReAct("question -> answer", tools=[add], max_iters=turns)  # turns-2 tool calls, finish, extract


def trainset(n: int) -> list[dspy.Example]:
    return [dspy.Example(question=f"What is {3 * i + 7} + {5 * i + 11}?", answer=str(8 * i + 18)).with_inputs("question")
            for i in range(n)]


def critical_path(log: list) -> float:
    """The longest chain of dependent calls in the step's actual latencies: per question, its slowest rollout (with
    ReAct, the slowest call of each turn, summed: an upper bound of one rollout's chain), then, if it had contrast,
    its slowest summary and its advantage; the longest such chain, then the consolidation."""
    per: dict[str, dict] = {}
    for kind, question, turn, latency in log:
        if kind == "consolidation":
            continue
        slot = per.setdefault(question, {"turns": {}, "summary": 0.0, "advantage": 0.0})
        if kind == "student":
            slot["turns"][turn] = max(slot["turns"].get(turn, 0.0), latency)
        else:
            slot[kind] = max(slot[kind], latency)
    chains = [sum(s["turns"].values()) + s["summary"] + s["advantage"] for s in per.values()]
    return max(chains, default=0.0) + max((x[3] for x in log if x[0] == "consolidation"), default=0.0)


def dspy_floor(server: FakeLMServer, n: int, threads: int) -> tuple[int, float, float]:
    """(n, wall, CPU) of n plain Predict calls in parallel, no optimizer: what DSPy alone costs per call."""
    from dspy.utils.parallelizer import ParallelExecutor

    program, lm = dspy.Predict("question -> answer"), dspy.settings.lm
    copies = [lm.copy(rollout_id=i, temperature=0.7) for i in range(8)]

    def call(i):
        with dspy.context(lm=copies[i % len(copies)]):
            return program(question=f"What is {i} + {n}?")

    t0, cpu0 = time.perf_counter(), time.process_time()
    ParallelExecutor(num_threads=threads, disable_progress_bar=True, timeout=0).execute(call, list(range(n)))
    return n, time.perf_counter() - t0, time.process_time() - cpu0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--group", "-G", type=int, default=5)
    ap.add_argument("--turns", "-T", type=int, default=1, help="LM calls per rollout: 1 = Predict, >=2 = ReAct")
    ap.add_argument("--latency", default="0.2", help="seconds per call, or 'lognormal' (median --median, sigma 1)")
    ap.add_argument("--median", type=float, default=0.2, help="median seconds per call of --latency lognormal")
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--in-process-server", action="store_true", help="run the fake server in this process")
    ap.add_argument("--no-floor", action="store_true", help="skip the bare-DSPy comparison run")
    ap.add_argument("--model", default="openai/fake", help="model name sent (the fake answers any); DSPy prices each "
                    "reply from its model map, and a name missing from the map costs a full scan per call")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    B, G, T = args.batch, args.group, args.turns
    dist = "lognormal" if args.latency == "lognormal" else "fixed"
    L = args.median if dist == "lognormal" else float(args.latency)

    with FakeLMServer(latency=L, latency_dist=dist, tool_turns=max(0, T - 2),
                      process=not args.in_process_server) as server:
        dspy.configure(lm=server.lm(model=args.model, timeout=60, num_retries=2))
        opt = TrainingFreeGRPO(metric, num_generations=G, num_train_epochs=1, batch_size=B, num_threads=args.threads,
                               seed=0)
        t0, cpu0 = time.perf_counter(), time.process_time()
        compiled = opt.compile(make_program(T), trainset=trainset(B))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        served = server.stats()
        floor = None if args.no_floor else dspy_floor(server, B * G, args.threads)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN)  # the server process, once stopped (start-up included)
    server_cpu = child.ru_utime + child.ru_stime

    step = compiled.detailed_results.to_dict()["steps"][0]
    M = step["groups_kept"]
    critical = critical_path(served["log"])
    ratio = wall / critical
    usage = step["usage"]
    print(f"one step: batch {B}, G {G}, T {T} ({'ReAct' if T > 1 else 'Predict'}), latency {dist} {L:.3f} s, "
          f"threads {args.threads}, mixed groups M={M}")
    print(f"wall (compile): {wall:.3f} s; step wall_s: {step['wall_s']:.3f} s; stage seconds: "
          + ", ".join(f"{k}={v:.3f}" for k, v in step["seconds"].items()))
    lat = sorted(x[3] for x in served["log"])
    print(f"critical path: {critical:.3f} s from the drawn latencies (fixed latency: (T + 3) x L = {(T + 3) * L:.3f} s); "
          f"call latency median {lat[len(lat) // 2]:.3f} s, p99 {lat[int(len(lat) * 0.99)]:.3f} s, max {lat[-1]:.3f} s")
    print(f"{'stage':<14}{'server calls':>13}{'usage calls':>12}{'prompt tok':>12}{'compl tok':>11}  (server tokens)")
    for stage, kind in STAGE_KIND.items():
        k, u = served["kinds"][kind], usage.get(stage, {})
        print(f"{stage:<14}{k['calls']:>13}{u.get('calls', 0):>12}{u.get('prompt_tokens', 0):>12}"
              f"{u.get('completion_tokens', 0):>11}  ({k['prompt_tokens']}/{k['completion_tokens']})")
    calls = served["calls"]
    bound = B * G * T + G * M + M + 1
    print(f"LM calls: {calls}; bound B*G*T + G*M + M + 1 = {bound}: {'holds' if calls <= bound else 'VIOLATED'}")
    print(f"server max concurrent requests: {served['max_in_flight']}; request arrival spread per kind: "
          + ", ".join(f"{k}={v['last_at'] - v['first_at']:.3f}s" for k, v in served["kinds"].items() if v["first_at"]))
    print(f"orchestrator CPU during compile: {cpu:.3f} s ({cpu / wall:.0%} of wall; ~100% = bound by one GIL), "
          f"{cpu / max(calls, 1) * 1000:.2f} ms per LM call")
    if not args.in_process_server:
        print(f"fake server process CPU (whole life): {server_cpu:.3f} s; both processes share "
              f"{os.cpu_count()} CPUs")
    if floor:
        n, f_wall, f_cpu = floor
        print(f"DSPy floor: {n} bare dspy.Predict calls through ParallelExecutor({args.threads}) took {f_wall:.3f} s "
              f"({f_cpu / n * 1000:.2f} ms CPU per call) -> this step's {calls} calls need >= {calls * f_cpu / n:.3f} s "
              f"of orchestrator CPU, vs the 1.25 x critical path budget of {1.25 * critical:.3f} s")
    print(f"orchestrator peak RSS: {peak_mib:.1f} MiB (target <= 400 MiB)")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other processes skew timings)")
    print(f"step_latency: wall={wall:.3f} critical_path={critical:.3f} ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
