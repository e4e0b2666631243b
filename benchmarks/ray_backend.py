"""`backend="ray"` against `backend="threads"`, on a Ray cluster of nodes on this machine (each its own `ray start`
process: `tfgrpo.testing.LocalRayCluster`), with the fake LM server (`benchmarks.fault_child`'s compile). Three lines:

    ray_same: nodes=2 calls_threads=.. calls_ray=.. library_equal=.. program_equal=.. steps_equal=..
        the same compile on threads and on the cluster, each on a fresh fake server: the LM calls each sent, and
        whether the library, the program's JSON (its provenance aside: it names the backend) and the step records
        (their timings aside) are the same.
    ray_faults: killed=K crashes=.. corrupted=.. charged_twice=.. library_equal=.. resent=..
        the compile on the cluster while its worker node is killed (its raylet and every process below it, SIGKILL)
        when the `--kill-at`-th attempt reaches the server: whether the run ends (crashes), saved states and
        checkpoint files that fail their checks (corrupted), the attempts charged beyond the undisturbed run's
        (charged_twice), the library against the undisturbed one's, and the LM calls the lost tasks sent again.
    ray_overhead: units=.. work_s=.. threads_s=.. ray_s=.. unit_ms=..
        a program whose every attempt runs a fixed piece of Python in the sandbox (`work_s` alone, measured first)
        and then one LM call, `--units` attempts at `--threads` in flight: wall time on threads and on the cluster,
        and what Ray adds per attempt (ms), from the attempts of a program with no work (one LM call), one at a time.

With `--main-job RUN_DIR CACHE` it also runs the README's main job (`configs/local.toml`) through the cluster on the
DSPy cache `CACHE` of a thread-pool run whose folder is RUN_DIR (the nodes read the same cache), and prints
`ray_same: job=main nodes=2 new_calls=.. library_equal=.. program_equal=.. steps_equal=..` (benchmarks.same_run's
comparison, with the fields of the mechanisms removed since that run left out).

    python -m benchmarks.ray_backend [--queries 6] [--units 12] [--threads 2] [--kill-at 10]
    python -m benchmarks.ray_backend --main-job /tmp/before/runs/local-game24 /tmp/mjcache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fault_child import DEFAULTS, compile_once, corrupted, server
from benchmarks.same_run import saved
from benchmarks.same_run import steps as step_records

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("seconds", "wall_s")


def _compile(srv, log_dir: Path | None, **opts) -> dict:
    """One compile of fault_child's program: what it learned, its program's JSON (without its provenance, which names
    the backend) and step records, and its calls."""
    compiled = compile_once(srv.api_base, None if log_dir is None else str(log_dir), **opts)
    with tempfile.TemporaryDirectory() as tmp:
        compiled.save(f"{tmp}/program.json")
        program = saved(Path(tmp) / "program.json")
    steps = [{k: v for k, v in s.to_dict().items() if k not in TIMING} for s in compiled.detailed_results.steps]
    return {"library": compiled.experience_library.dump_state(), "program": program, "steps": steps,
            "calls": srv.stats()["calls"], "metric_calls": sum(s["metric_calls"] for s in steps)}


def same_row(queries: int, nodes: int) -> tuple[dict, dict]:
    with server() as a:
        threads = _compile(a, None, queries=queries)
    with server() as b:
        ray = _compile(b, None, queries=queries, backend="ray")
    row = {"nodes": nodes, "calls_threads": threads["calls"], "calls_ray": ray["calls"],
           "library_equal": threads["library"] == ray["library"], "program_equal": threads["program"] == ray["program"],
           "steps_equal": threads["steps"] == ray["steps"]}
    return row, ray


def faults_row(cluster, queries: int, kill_at: int, reference: dict) -> dict:
    killed, crashed = [], 0
    with tempfile.TemporaryDirectory() as tmp, server(latency=0.05) as srv:
        srv.on_call(kill_at, lambda: killed.extend(cluster.kill(1)), kind="student")
        try:
            got = _compile(srv, Path(tmp) / "run", queries=queries, backend="ray")
        except Exception as exc:  # noqa: BLE001 - the row counts it
            print(f"ray_faults: the compile raised {type(exc).__name__}: {exc}", file=sys.stderr)
            crashed, got = 1, None
        broken = corrupted({**DEFAULTS, "queries": queries}, [got], [Path(tmp) / "run"])
    return {"killed": int(bool(killed)), "processes_killed": len(killed), "crashes": crashed, "corrupted": broken,
            "charged_twice": None if got is None else got["metric_calls"] - reference["metric_calls"],
            "library_equal": got is not None and got["library"] == reference["library"],
            "resent": None if got is None else got["calls"] - reference["calls"]}


def work_program(loops: int):
    """A program whose every attempt runs `loops` iterations of Python in the sandbox, then one LM call."""
    import dspy

    class SandboxedWork(dspy.Module):
        def __init__(self):
            super().__init__()
            self.solve = dspy.Predict("question, sample, work -> answer")

        def forward(self, question):
            from tfgrpo.tasks.sandbox import run_python

            out = run_python(f"print(sum(i * i for i in range({loops})))", wall_timeout_s=60, cpu_time_s=60)
            rid = (getattr(self.solve.lm, "kwargs", None) or {}).get("rollout_id")
            return self.solve(question=question, sample=str(rid), work=out.stdout.strip())

    return SandboxedWork()


def _attempts(srv, program, units: int, threads: int, backend: str) -> float:
    """Seconds for `units` scored attempts of `program` within a run on `backend`."""
    import dspy

    from benchmarks.fault_child import make_trainset, metric
    from tfgrpo.optimizers.knobs import Knobs
    from tfgrpo.optimizers.runner import Run, Scope
    from tfgrpo.optimizers.workers import with_own_lms

    examples = make_trainset(units)
    with dspy.context(lm=srv.lm()), Run(knobs=Knobs(num_threads=threads, backend=backend, progress=lambda *_: None),
                                        metric=metric) as run:
        programs = [with_own_lms(program, rollout_id=i) for i in range(units)]
        t0 = time.perf_counter()
        with Scope(run, "overhead") as scope:
            scope.scored("validation", list(zip(programs, examples)))
        return time.perf_counter() - t0


def overhead_row(units: int, threads: int, loops: int) -> dict:
    from tfgrpo.tasks.sandbox import run_python

    t0 = time.perf_counter()
    run_python(f"print(sum(i * i for i in range({loops})))", wall_timeout_s=60, cpu_time_s=60)
    work_s = time.perf_counter() - t0
    from benchmarks.fault_child import make_program

    with server() as srv:
        _attempts(srv, work_program(0), 4, threads, "ray")  # the workers' first imports, outside the figures
        bare_threads = _attempts(srv, make_program(), units, 1, "threads")
        bare_ray = _attempts(srv, make_program(), units, 1, "ray")
        threads_s = _attempts(srv, work_program(loops), units, threads, "threads")
        ray_s = _attempts(srv, work_program(loops), units, threads, "ray")
    return {"units": units, "threads": threads, "work_s": round(work_s, 3), "threads_s": round(threads_s, 2),
            "ray_s": round(ray_s, 2), "unit_ms": round((bare_ray - bare_threads) / units * 1000, 1)}


def main_job_row(run_dir: Path, cache: Path, nodes: int) -> dict:
    """The README's main job through the cluster (backend from the environment) on a thread-pool run's cache."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "local-ray.toml"
        text = (ROOT / "configs/local.toml").read_text()
        config.write_text(text.replace('run_dir = "runs/local-game24"', f'run_dir = "{tmp}/run"')
                          .replace("[optimizer]\n", '[optimizer]\nbackend = "ray"\n', 1))
        env = {**os.environ, "DSPY_CACHEDIR": str(cache)}
        subprocess.run([sys.executable, "-m", "tfgrpo.cli", "compile", str(config)], env=env, cwd=ROOT, check=True)
        run = Path(tmp) / "run"
        ignore = ["evidence", "details.excerpts", "details.excerpts_refused"]  # the removed mechanisms' own fields
        records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines() if line]
        return {"job": "main", "nodes": nodes,
                "new_calls": sum(u.get("calls", 0) for s in records for u in s.get("usage", {}).values()),
                **{f"{name}_equal": saved(run_dir / f"{name}.json") == saved(run / f"{name}.json")
                   for name in ("library", "program")},
                "steps_equal": step_records(run_dir, ignore) == step_records(run, ignore)}


def line(name: str, row: dict) -> str:
    return f"{name}: " + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in row.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.ray_backend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--queries", type=int, default=6, help="trainset of the same/faults compiles")
    ap.add_argument("--kill-at", type=int, default=10, help="the attempt (LM call) at which the worker node dies")
    ap.add_argument("--units", type=int, default=12, help="attempts of the overhead row")
    ap.add_argument("--threads", type=int, default=2, help="attempts in flight in the overhead row")
    ap.add_argument("--loops", type=int, default=3_000_000, help="Python loop iterations of each attempt's work")
    ap.add_argument("--main-job", nargs=2, metavar=("RUN_DIR", "CACHE"), help="also the main job on this cache")
    args = ap.parse_args(argv)
    import ray

    from tfgrpo.testing.ray_cluster import LocalRayCluster

    extra = {"DSPY_CACHEDIR": str(Path(args.main_job[1]).resolve())} if args.main_job else {}
    with LocalRayCluster(nodes=args.nodes, env={"PYTHONPATH": str(ROOT), **extra}) as cluster:
        os.environ["RAY_ADDRESS"] = cluster.address
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            if args.main_job:
                print(line("ray_same", main_job_row(Path(args.main_job[0]), Path(args.main_job[1]), args.nodes)))
            same, reference = same_row(args.queries, args.nodes)
            print(line("ray_same", same), flush=True)
            print(line("ray_overhead", overhead_row(args.units, args.threads, args.loops)), flush=True)
            print(line("ray_faults", faults_row(cluster, args.queries, args.kill_at, reference)), flush=True)
        finally:
            ray.shutdown()
            os.environ.pop("RAY_ADDRESS", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
