"""TrainingFreeGRPO under injected LM faults, and after kill -9 and resume.

For each fault type (at `--rate`) this runs an uninterrupted compile, then the same compile killed with
SIGKILL after a share of its LM calls and resumed from its log_dir, all in child processes against one fake
LM server per run. It reports faults injected, crashes (a child dying of anything but the kill or the
documented failure-rate stop), corrupted libraries (a saved state that fails the library's invariants),
finished units redone after the resume (checkpoint files present at the kill and written again), and
whether the resumed library equals the uninterrupted one. The last line is
`faults: injected=<n> crashes=<n> corrupted=<n> redone=<n> resumed_equal=<true|false>`.

The helpers here are shared with tests/test_faults.py. The student program puts its sample number
(`rollout_id`) in the prompt, so every rollout is a distinct request and the fake's answers depend on the
request alone: a resumed run sees the same answers as an uninterrupted one.

    python -m benchmarks.faults [--rate 0.2] [--faults http429,hang]
    python -m benchmarks.faults child --api-base URL --log-dir DIR --out FILE [--opts JSON]   (one compile)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fake_lm_server import FAULTS, KINDS, FakeLMServer

STOPPED = 3  # exit code of a child stopped by max_failure_rate (the documented TooManyFailuresError)
UNIT_KIND = {"rollouts": "student", "summaries": "summary", "advantages": "advantage", "plan": "consolidation"}
DEFAULTS = dict(queries=6, num_generations=4, num_train_epochs=2, batch_size=3, num_threads=8, max_experiences=5,
                max_failure_rate=0.5, seed=0, lm_timeout=10.0, num_retries=3)


# -- the compile that runs in children (and in tests) --------------------------------------------------------
def make_trainset(n: int):
    import dspy

    return [dspy.Example(question=f"What is {i + 3} + {2 * i + 9}?", answer=str(3 * i + 12)).with_inputs("question")
            for i in range(n)]


def metric(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def make_program():
    import dspy

    class SampledSolver(dspy.Module):
        """Predict with the sample number in its prompt: distinct rollouts are distinct requests."""

        def __init__(self):
            super().__init__()
            self.solve = dspy.Predict("question, sample -> answer")

        def forward(self, question):
            lm = self.solve.lm or dspy.settings.lm
            rid = (getattr(lm, "kwargs", None) or {}).get("rollout_id")
            return self.solve(question=question, sample="final" if rid is None else str(rid))

    return SampledSolver()


def compile_once(api_base: str, log_dir: str | None, *, child: bool = False, **overrides):
    """One compile against the fake server at `api_base`; returns the compiled program. The LM never caches;
    in a child process DSPy's caches are switched off altogether (the server's counters are the truth)."""
    # isort: off
    import tfgrpo  # noqa: F401  (first, before dspy: keeps litellm from fetching its cost map over the network)
    import dspy
    from tfgrpo.optimizers import TrainingFreeGRPO
    # isort: on

    o = {**DEFAULTS, **overrides}
    if child:  # global DSPy state: only in a process of its own
        dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    dspy.configure(lm=dspy.LM("openai/fake", api_base=api_base, api_key="x", cache=False,
                              num_retries=o["num_retries"], timeout=o["lm_timeout"]))
    knobs = {k: o[k] for k in ("num_generations", "num_train_epochs", "batch_size", "num_threads", "max_experiences",
                               "max_failure_rate", "seed")}
    opt = TrainingFreeGRPO(metric, log_dir=log_dir, **knobs)
    return opt.compile(make_program(), trainset=make_trainset(o["queries"]))


def child_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.faults child")
    ap.add_argument("--api-base", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--opts", default="{}")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    from tfgrpo.optimizers import TooManyFailuresError

    try:
        compiled = compile_once(args.api_base, args.log_dir, child=True, **json.loads(args.opts))
    except TooManyFailuresError as exc:
        Path(args.out).write_text(json.dumps({"status": "stopped", "error": str(exc)}))
        return STOPPED
    steps = compiled.detailed_results["steps"]
    Path(args.out).write_text(json.dumps({"status": "ok", "library": compiled.experience_library.dump_state(),
                                          "steps": steps}, default=str))
    return 0


def spawn(api_base: str, log_dir: Path, out: Path, opts: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.faults", "child", "--api-base", api_base, "--log-dir", str(log_dir),
           "--out", str(out), "--opts", json.dumps(opts)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# -- checks ------------------------------------------------------------------------------------------------
def library_problems(state: dict, max_words: int = 32, max_experiences: int | None = None) -> list[str]:
    """What is wrong with a saved library state (empty: nothing)."""
    from tfgrpo.programs.library import ExperienceLibrary

    try:
        lib = ExperienceLibrary.from_state(state)
    except ValueError as exc:
        return [f"does not load: {exc}"]
    problems = []
    ids = list(lib.active) + list(lib.retired)
    if len(ids) != len(set(ids)):
        problems.append("an ID is used twice")
    problems += [f"{e.id} has {len(e.text.split())} words" for e in lib if len(e.text.split()) > max_words]
    if max_experiences is not None and len(lib) > max_experiences:
        problems.append(f"{len(lib)} experiences, over the cap {max_experiences}")
    if any(int(i[1:]) >= lib.next_id for i in ids):
        problems.append("next_id would reuse an ID")
    return problems


def signature(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns  # a checkpoint write (temporary file + rename) changes both


def unit_files(log_dir: Path) -> dict[str, tuple[int, int]]:
    """Finished units on disk: relative path -> signature."""
    return {str(p.relative_to(log_dir)): signature(p) for p in log_dir.rglob("*.json")}


def torn_files(log_dir: Path) -> list[str]:
    """Checkpoint files that do not parse (a write cut by the kill would show here)."""
    torn = []
    for p in log_dir.rglob("*.json"):
        try:
            json.loads(p.read_text())
        except ValueError:
            torn.append(str(p))
    return torn


def units_per_kind(files) -> dict[str, int]:
    counts = {k: 0 for k in KINDS}
    for rel in files:
        parts = Path(rel).parts
        if len(parts) >= 3 and parts[0] == "steps":
            kind = UNIT_KIND.get(parts[2] if len(parts) > 3 else Path(parts[2]).stem)
            if kind:
                counts[kind] += 1
    return counts


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


def kill_and_resume(make_server, root: Path, opts: dict, kill_after: int, kill_kind: str | None = None) -> dict:
    """Kill a compile at its `kill_after`-th call (of `kill_kind`), resume it in a new process, and account for
    the calls: per kind, those of the killed run, those of the resumed run, and the units finished at the kill."""
    log_dir = root / f"run_kill{kill_after}{kill_kind or ''}"
    with make_server() as server:
        code, _, text, killed = run_child(server, log_dir, opts, kill_after=kill_after, kill_kind=kill_kind)
        time.sleep(0.05)  # requests the dead process had already sent still arrive and count as its calls
        at_kill = server.stats()
        files = unit_files(log_dir)
        code2, result, text2, _ = run_child(server, log_dir, opts)
        after = server.stats()
    resumed = {k: after["kinds"][k]["calls"] - at_kill["kinds"][k]["calls"] for k in KINDS}
    rewritten = [f for f, sig in files.items() if (log_dir / f).exists() and signature(log_dir / f) != sig]
    return {"log_dir": log_dir, "killed": killed, "kill_exit": code, "exit": code2, "result": result, "output": text + text2,
            "killed_calls": calls(at_kill), "resumed_calls": resumed, "done_units": units_per_kind(files),
            "rewritten": rewritten, "faults": {k: after["faults"][k] for k in FAULTS}}


# -- the benchmark -----------------------------------------------------------------------------------------
def bench(rate: float, names: list[str], share: float) -> int:
    opts = dict(DEFAULTS, queries=12, batch_size=6, lm_timeout=0.5, num_retries=3)
    totals = dict(injected=0, crashes=0, corrupted=0, redone=0)
    all_equal = True
    print(f"compile: {opts['queries']} queries, G={opts['num_generations']}, {opts['num_train_epochs']} epochs, batch "
          f"{opts['batch_size']}, {opts['num_threads']} threads; fault rate {rate:.0%}; kill -9 after "
          f"{share:.0%} of the uninterrupted run's LM calls")
    print(f"{'fault':<13}{'injected':>9}{'crashes':>8}{'corrupt':>8}{'redone':>7}{'extra calls':>12}{'library':>8}  "
          f"{'equal':<6}status")
    with tempfile.TemporaryDirectory(prefix="tfgrpo-faults-") as tmp:
        for name in names:
            root = Path(tmp) / name
            root.mkdir()

            def server(name=name):
                return FakeLMServer(latency=0.005, seed=0, vary_identical=False, faults={name: rate},
                                    hang_seconds=1.5, retry_after=0.01)

            with server() as srv:
                code, ref, text, _ = run_child(srv, root / "reference", opts)
                ref_stats = srv.stats()
            run = kill_and_resume(server, root, opts, kill_after=max(1, int(share * ref_stats["calls"])))
            injected = sum(ref_stats["faults"].values()) + sum(run["faults"].values())
            crashes = sum(c not in (0, STOPPED) for c in (code, run["exit"])) + (run["kill_exit"] not in (0, STOPPED, -9))
            states = [r["library"] for r in (ref, run["result"]) if r and r.get("library")]
            states += [json.loads(p.read_text())["library"] for d in (root / "reference", run["log_dir"])
                       for p in d.glob("steps/*/done.json")]
            corrupted = sum(bool(library_problems(s, max_experiences=opts["max_experiences"])) for s in states) + \
                len(torn_files(root / "reference")) + len(torn_files(run["log_dir"]))
            equal = bool(ref and run["result"]) and ref.get("status") == run["result"].get("status") and \
                ref.get("library") == run["result"].get("library")
            extra = sum(run["killed_calls"].values()) + sum(run["resumed_calls"].values()) - \
                sum(calls(ref_stats).values())
            status = ref.get("status") if ref else "no result"
            if crashes:
                print((text + run["output"])[-2000:])
            size = len(ref["library"]["experiences"]) if ref and ref.get("library") else "-"
            print(f"{name:<13}{injected:>9}{crashes:>8}{corrupted:>8}{len(run['rewritten']):>7}{extra:>12}{size:>8}  "
                  f"{str(equal).lower():<6}{status}{'' if run['killed'] else ' (finished before the kill)'}")
            totals["injected"] += injected
            totals["crashes"] += crashes
            totals["corrupted"] += corrupted
            totals["redone"] += len(run["rewritten"])
            all_equal &= equal
    print("extra calls: LM calls of the killed + resumed runs beyond the uninterrupted run's (calls in flight at "
          "the kill and, with transient faults, different retries); redone: finished units written again; "
          "library: experiences learned by the uninterrupted run")
    print(f"faults: injected={totals['injected']} crashes={totals['crashes']} corrupted={totals['corrupted']} "
          f"redone={totals['redone']} resumed_equal={str(all_equal).lower()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description="TrainingFreeGRPO under injected LM faults and kill -9")
    ap.add_argument("--rate", type=float, default=0.2)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the uninterrupted run's calls")
    args = ap.parse_args(argv)
    return bench(args.rate, [f for f in args.faults.split(",") if f], args.kill_at)


if __name__ == "__main__":
    sys.exit(main())
