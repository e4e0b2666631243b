"""The compile that the fault benchmarks run in child processes (and tests/test_faults.py in-process), against the
fake LM server, and the accounting of what such a child did: shared by faults.py, stop_rows.py and trust_rows.py.

    python -m benchmarks.fault_child --api-base URL --log-dir DIR --out FILE [--opts JSON]   (one compile)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.log_dir_checks import (library_problems, record_keys, resent, signature, torn_files, unit_files,
                                       units_per_kind)
from tfgrpo.testing import FAULTS, KINDS, FakeLMServer

ROOT = Path(__file__).resolve().parent.parent


STOPPED = 3  # exit code of a child stopped by a documented error (TooManyFailuresError, MetricError)
LEARNING = ("summary", "advantage", "consolidation")
DEFAULTS = dict(queries=6, num_generations=4, num_train_epochs=2, batch_size=3, num_threads=8, max_experiences=5,
                max_failure_rate=0.5, seed=0, lm_timeout=10.0, num_retries=3, metric="exact", disable_history=False,
                max_total_tokens=None, metric_timeout_s=None, backend="threads")


# -- the compile that runs in children (and in tests) --------------------------------------------------------
def make_trainset(n: int):
    import dspy

    return [dspy.Example(question=f"What is {i + 3} + {2 * i + 9}?", answer=str(3 * i + 12)).with_inputs("question")
            for i in range(n)]


def metric(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def misspelled_metric(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.anwser)  # a typo: raises AttributeError


METRICS = {"exact": metric, "misspelled": misspelled_metric}


def make_program():
    import dspy

    class SampledSolver(dspy.Module):
        """Predict with the sample number in its prompt: distinct rollouts are distinct requests."""

        def __init__(self):
            super().__init__()
            self.solve = dspy.Predict("question, sample -> answer")

        def forward(self, question):
            return self.solve(question=question, sample=self._sample())

        async def aforward(self, question):  # backend="async" runs it through DSPy's async path to the LM
            return await self.solve.acall(question=question, sample=self._sample())

        def _sample(self) -> str:
            rid = (getattr(self.solve.lm or dspy.settings.lm, "kwargs", None) or {}).get("rollout_id")
            return "final" if rid is None else str(rid)

    return SampledSolver()


def compile_once(api_base: str, log_dir: str | None, *, child: bool = False, **overrides):
    """One compile against the fake server at `api_base`; returns the compiled program. The LM never caches;
    in a child process DSPy's caches are switched off altogether (the server's counters are the truth)."""
    # isort: off
    import benchmarks  # noqa: F401  (before dspy: LiteLLM's bundled price map, no fetch)
    import dspy
    from tfgrpo.optimizers import TrainingFreeGRPO
    # isort: on

    o = {**DEFAULTS, **overrides}
    if child:  # global DSPy state: only in a process of its own
        dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    dspy.configure(lm=dspy.LM("openai/fake", api_base=api_base, api_key="x", cache=False,
                              num_retries=o["num_retries"], timeout=o["lm_timeout"]))
    knobs = {k: o[k] for k in ("num_generations", "num_train_epochs", "batch_size", "num_threads", "max_experiences",
                               "max_failure_rate", "seed", "max_total_tokens", "metric_timeout_s", "backend")}
    opt = TrainingFreeGRPO(METRICS[o["metric"]], log_dir=log_dir, progress=lambda *_: None, **knobs)
    with dspy.context(disable_history=o["disable_history"]):
        return opt.compile(make_program(), trainset=make_trainset(o["queries"]))


def child_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.fault_child")
    ap.add_argument("--api-base", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--opts", default="{}")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    from tfgrpo.optimizers import MetricError, TooManyFailuresError
    from tfgrpo.optimizers.checkpoint import RunMismatchError

    try:
        compiled = compile_once(args.api_base, args.log_dir, child=True, **json.loads(args.opts))
    except (TooManyFailuresError, MetricError, RunMismatchError) as exc:
        status = {MetricError: "metric_error", RunMismatchError: "refused"}.get(type(exc), "stopped")
        Path(args.out).write_text(json.dumps({"status": status, "error": str(exc)}))
        return STOPPED
    results = compiled.detailed_results.to_dict()
    Path(args.out).write_text(json.dumps({"status": "ok", "library": compiled.experience_library.dump_state(),
                                          "steps": results["steps"], "stopped_early": results["stopped_early"]},
                                         default=str))
    return 0


def spawn(api_base: str, log_dir: Path, out: Path, opts: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.fault_child", "--api-base", api_base, "--log-dir", str(log_dir),
           "--out", str(out), "--opts", json.dumps(opts)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# -- accounting (the checks of a log_dir are in log_dir_checks.py) --------------------------------------------
def calls(stats: dict) -> dict[str, int]:
    return {k: v["calls"] for k, v in stats["kinds"].items()}


def run_child(server: FakeLMServer, log_dir: Path, opts: dict, kill_after: int | None = None,
              kill_kind: str | None = None, timeout: float = 120):
    """Run one compile in a child; with `kill_after`, SIGKILL it when the server sees that many more calls
    (of `kill_kind`, or of any kind), before that call is answered.

    Returns (exit code, result JSON or None, output text, killed?)."""
    out = log_dir.with_suffix(f".out{time.monotonic_ns()}.json")
    target: dict = {}
    killed = threading.Event()

    def kill():
        if "proc" in target and target["proc"].poll() is None:
            os.kill(target["proc"].pid, signal.SIGKILL)
            killed.set()

    if kill_after is not None:
        now = server.stats()
        server.on_call((now["kinds"][kill_kind]["calls"] if kill_kind else now["calls"]) + kill_after, kill, kill_kind)
    target["proc"] = proc = spawn(server.api_base, log_dir, out, opts)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
    result = json.loads(out.read_text()) if out.exists() else None
    out.unlink(missing_ok=True)
    return proc.returncode, result, text, killed.is_set()


def kill_and_resume(make_server, root: Path, opts: dict, kill_after: int, kill_kind: str | None = None,
                    between=None, reference: Path | None = None) -> dict:
    """Kill a compile at its `kill_after`-th call (of `kill_kind`), resume it in a new process, and account for
    the calls: per kind, those of the killed run, those of the resumed run, and those the record held at the kill;
    and what the resume did again (`rewritten`: a saved file written again, or, against the uninterrupted run whose
    log_dir is `reference`, a recorded call sent again). `between(server, log_dir)` runs after the kill, before the
    resume (its result is under "between")."""
    log_dir = root / f"run_kill{kill_after}{kill_kind or ''}"
    with make_server() as server:
        code, _, text, killed = run_child(server, log_dir, opts, kill_after=kill_after, kill_kind=kill_kind)
        time.sleep(0.05)  # requests the dead process had already sent still arrive and count as its calls
        at_kill = server.stats()
        files, keys, done = unit_files(log_dir), record_keys(log_dir), units_per_kind(log_dir)
        meanwhile = between(server, log_dir) if between else None
        code2, result, text2, _ = run_child(server, log_dir, opts)
        after = server.stats()
    resumed = {k: after["kinds"][k]["calls"] - at_kill["kinds"][k]["calls"] for k in KINDS}
    rewritten = [f for f, sig in files.items()
                 if f != "run.json" and (log_dir / f).exists() and signature(log_dir / f) != sig]
    rewritten += [f"calls.jsonl: {key}" for key in resent(log_dir, keys, reference)] if reference else []
    return {"between": meanwhile, "log_dir": log_dir, "killed": killed, "kill_exit": code, "exit": code2, "result": result, "output": text + text2,
            "killed_calls": calls(at_kill), "resumed_calls": resumed, "done_units": done,
            "rewritten": rewritten, "faults": {k: after["faults"][k] for k in FAULTS}}


def server(latency: float = 0.005, **faults_kw) -> FakeLMServer:
    return FakeLMServer(latency=latency, seed=0, vary_identical=False, hang_seconds=1.5, retry_after=0.01, **faults_kw)


def corrupted(opts: dict, results: list, log_dirs: list[Path]) -> int:
    states = [r["library"] for r in results if r and r.get("library")]
    states += [json.loads(p.read_text())["library"] for d in log_dirs for p in d.glob("steps/*.json")]
    return sum(bool(library_problems(s, max_experiences=opts["max_experiences"])) for s in states) + \
        sum(len(torn_files(d)) for d in log_dirs if d.exists())


def size(result: dict | None):
    return len(result["library"]["experiences"]) if result and result.get("library") else "-"


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
