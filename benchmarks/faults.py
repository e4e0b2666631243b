"""TrainingFreeGRPO under injected LM faults, and after kill -9 and resume.

For each fault type (at `--rate`) this runs an uninterrupted compile, then the same compile killed with
SIGKILL after a share of its LM calls and resumed from its log_dir, all in child processes against one fake
LM server per run. It reports faults injected, crashes (a child dying of anything but the kill or the
documented failure-rate stop), corrupted libraries (a saved state that fails the library's invariants),
finished units redone after the resume (checkpoint files present at the kill and written again), and
whether the resumed library equals the uninterrupted one, ending with the line
`faults: injected=<n> crashes=<n> corrupted=<n> redone=<n> resumed_equal=<true|false>`.

Row `corrupt_run_json` (issue 18): after the kill, run.json is emptied and a resume with other settings must be
refused with no call sent; with run.json back, the resume must end as the uninterrupted run.

Then the failures that must never pass in silence (issue 11), each measured by a run: a metric that raises
(row `metric_error`: the run must stop with a MetricError), a reflection LM that fails on every call (row
`reflection_outage`: the step must not be done, and a resume on a healthy server must reuse the rollouts and
end with the library of a run that never had the outage), the LM calls one unparseable learning reply costs,
and a token budget under `dspy.configure(disable_history=True)`. The last line is
`silent_failures: metric_error=<raised|silent> reflection_outage=<not_done|done> calls_per_bad_reply=<n>
budget_without_history=<stopped|ignored>`.

Rows `non_latin_rules`, `other_program_json`, `valset_input_keys`, `same_file_name` and `hand_edited_json` (issue 37,
benchmarks/trust_rows.py) each try one input a run must not trust in silence; their status says refused, recovered
or nothing lost.

Rows `locked_log_dir` and `hung_metric` (issue 37, items 1 and 3, benchmarks/stop_rows.py): a second compile on a
log_dir in use is refused at once, naming the holder, and a killed holder's lock is taken over; Ctrl-C stops a compile
whose metric hangs at once, and `metric_timeout_s` turns the hung calls into counted failures.

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

from tfgrpo.testing import FAULTS, KINDS, FakeLMServer
from benchmarks.log_dir_checks import library_problems, signature, torn_files, unit_files, units_per_kind
from benchmarks.stop_rows import stop_rows
from benchmarks.trust_rows import trust_rows

STOPPED = 3  # exit code of a child stopped by a documented error (TooManyFailuresError, MetricError)
LEARNING = ("summary", "advantage", "consolidation")
DEFAULTS = dict(queries=6, num_generations=4, num_train_epochs=2, batch_size=3, num_threads=8, max_experiences=5,
                max_failure_rate=0.5, seed=0, lm_timeout=10.0, num_retries=3, metric="exact", disable_history=False,
                max_total_tokens=None, metric_timeout_s=None)


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
            lm = self.solve.lm or dspy.settings.lm
            rid = (getattr(lm, "kwargs", None) or {}).get("rollout_id")
            return self.solve(question=question, sample="final" if rid is None else str(rid))

    return SampledSolver()


def compile_once(api_base: str, log_dir: str | None, *, child: bool = False, **overrides):
    """One compile against the fake server at `api_base`; returns the compiled program. The LM never caches;
    in a child process DSPy's caches are switched off altogether (the server's counters are the truth)."""
    # isort: off
    import benchmarks  # noqa: E402,F401  (before dspy: LiteLLM's bundled price map, no fetch)
    import dspy
    from tfgrpo.optimizers import TrainingFreeGRPO
    # isort: on

    o = {**DEFAULTS, **overrides}
    if child:  # global DSPy state: only in a process of its own
        dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    dspy.configure(lm=dspy.LM("openai/fake", api_base=api_base, api_key="x", cache=False,
                              num_retries=o["num_retries"], timeout=o["lm_timeout"]))
    knobs = {k: o[k] for k in ("num_generations", "num_train_epochs", "batch_size", "num_threads", "max_experiences",
                               "max_failure_rate", "seed", "max_total_tokens", "metric_timeout_s")}
    opt = TrainingFreeGRPO(METRICS[o["metric"]], log_dir=log_dir, progress=lambda *_: None, **knobs)
    with dspy.context(disable_history=o["disable_history"]):
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
    from tfgrpo.optimizers import MetricError, TooManyFailuresError
    from tfgrpo.optimizers.checkpoint import RunMismatchError

    try:
        compiled = compile_once(args.api_base, args.log_dir, child=True, **json.loads(args.opts))
    except (TooManyFailuresError, MetricError, RunMismatchError) as exc:
        status = {MetricError: "metric_error", RunMismatchError: "refused"}.get(type(exc), "stopped")
        Path(args.out).write_text(json.dumps({"status": status, "error": str(exc)}))
        return STOPPED
    results = compiled.detailed_results
    Path(args.out).write_text(json.dumps({"status": "ok", "library": compiled.experience_library.dump_state(),
                                          "steps": results["steps"], "stopped_early": results["stopped_early"]},
                                         default=str))
    return 0


def spawn(api_base: str, log_dir: Path, out: Path, opts: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.faults", "child", "--api-base", api_base, "--log-dir", str(log_dir),
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
                    between=None) -> dict:
    """Kill a compile at its `kill_after`-th call (of `kill_kind`), resume it in a new process, and account for
    the calls: per kind, those of the killed run, those of the resumed run, and the units finished at the kill.
    `between(server, log_dir)` runs after the kill, before the resume (its result is under "between")."""
    log_dir = root / f"run_kill{kill_after}{kill_kind or ''}"
    with make_server() as server:
        code, _, text, killed = run_child(server, log_dir, opts, kill_after=kill_after, kill_kind=kill_kind)
        time.sleep(0.05)  # requests the dead process had already sent still arrive and count as its calls
        at_kill = server.stats()
        files = unit_files(log_dir)
        meanwhile = between(server, log_dir) if between else None
        code2, result, text2, _ = run_child(server, log_dir, opts)
        after = server.stats()
    resumed = {k: after["kinds"][k]["calls"] - at_kill["kinds"][k]["calls"] for k in KINDS}
    rewritten = [f for f, sig in files.items()
                 if f != "run.json" and (log_dir / f).exists() and signature(log_dir / f) != sig]
    return {"between": meanwhile, "log_dir": log_dir, "killed": killed, "kill_exit": code, "exit": code2, "result": result, "output": text + text2,
            "killed_calls": calls(at_kill), "resumed_calls": resumed, "done_units": units_per_kind(files),
            "rewritten": rewritten, "faults": {k: after["faults"][k] for k in FAULTS}}


# -- the benchmark -----------------------------------------------------------------------------------------
def _server(**faults_kw) -> FakeLMServer:
    return FakeLMServer(latency=0.005, seed=0, vary_identical=False, hang_seconds=1.5, retry_after=0.01, **faults_kw)


def _corrupted(opts: dict, results: list, log_dirs: list[Path]) -> int:
    states = [r["library"] for r in results if r and r.get("library")]
    states += [json.loads(p.read_text())["library"] for d in log_dirs for p in d.glob("steps/*/done.json")]
    return sum(bool(library_problems(s, max_experiences=opts["max_experiences"])) for s in states) + \
        sum(len(torn_files(d)) for d in log_dirs if d.exists())


def _size(result: dict | None):
    return len(result["library"]["experiences"]) if result and result.get("library") else "-"


def fault_row(name: str, rate: float, share: float, root: Path, opts: dict, between=None) -> dict:
    """An uninterrupted compile under one fault, then the same compile killed after `share` of its calls and
    resumed (`between`: see kill_and_resume)."""
    def server():
        return _server(faults={name: rate} if name in FAULTS else {})

    with server() as srv:
        code, ref, text, _ = run_child(srv, root / "reference", opts)
        ref_stats = srv.stats()
    run = kill_and_resume(server, root, opts, kill_after=max(1, int(share * ref_stats["calls"])), between=between)
    equal = bool(ref and run["result"]) and ref.get("status") == run["result"].get("status") and \
        ref.get("library") == run["result"].get("library")
    return dict(name=name, injected=sum(ref_stats["faults"].values()) + sum(run["faults"].values()),
                crashes=sum(c not in (0, STOPPED) for c in (code, run["exit"])) + (run["kill_exit"] not in (0, STOPPED, -9)),
                corrupted=_corrupted(opts, [ref, run["result"]], [root / "reference", run["log_dir"]]),
                redone=len(run["rewritten"]), size=_size(ref), equal=equal, output=text + run["output"],
                extra=sum(run["killed_calls"].values()) + sum(run["resumed_calls"].values()) - sum(calls(ref_stats).values()),
                status=(ref.get("status") if ref else "no result") + ("" if run["killed"] else " (finished before the kill)"),
                between=run["between"])


def run_json_row(root: Path, opts: dict, share: float) -> dict:
    """Killed, then `: > run.json` and a resume with num_generations=2: refused, sending nothing and leaving run.json
    as it is? Then run.json is put back and the resume goes on (the row's other columns)."""
    def corrupt_and_resume_changed(server, log: Path):
        record, sent = (log / "run.json").read_text(), server.stats()["calls"]
        (log / "run.json").write_text("")
        code, result, text, _ = run_child(server, log, {**opts, "num_generations": 2})
        refused = code == STOPPED and (result or {}).get("status") == "refused" and \
            server.stats()["calls"] == sent and (log / "run.json").read_text() == ""
        (log / "run.json").write_text(record)
        return {"refused": refused, "crashed": code not in (0, STOPPED), "output": text}

    row = fault_row("corrupt_run_json", 0.0, share, root, opts, between=corrupt_and_resume_changed)
    tried = row["between"]
    return {**row, "injected": 1, "crashes": row["crashes"] + tried["crashed"], "output": row["output"] + tried["output"],
            "refused": tried["refused"], "status": ("refused, nothing sent" if tried["refused"] else "NOT refused") +
            f"; restored and resumed: {row['status']}"}


def metric_error_row(root: Path, opts: dict) -> dict:
    """A compile whose metric has a typo: it must stop with a MetricError naming the metric, not learn from 0s."""
    with _server() as srv:
        code, result, text, _ = run_child(srv, root / "log", {**opts, "metric": "misspelled"})
        learning = sum(srv.stats()["kinds"][k]["calls"] for k in LEARNING)
    result = result or {}
    raised = code == STOPPED and result.get("status") == "metric_error" and "misspelled_metric" in result["error"]
    return dict(name="metric_error", injected=1, crashes=int(code not in (0, STOPPED)), redone=0, extra=learning,
                corrupted=_corrupted(opts, [result], [root / "log"]), size=_size(result), equal=None, output=text,
                status="raised: MetricError" if raised else f"silent ({result.get('status', 'no result')})")


def outage_row(root: Path, opts: dict) -> dict:
    """A reflection LM that fails on every call (HTTP 500 after the client's retries): the step must not be
    done; a resume on a healthy server reuses the rollouts and ends as a run that never had the outage."""
    with _server() as srv:
        code_ref, ref, text, _ = run_child(srv, root / "reference", opts)
        ref_calls = sum(calls(srv.stats()).values())
    log = root / "outage"
    with _server(faults={"http500": 1.0}, fault_kinds=LEARNING) as srv:
        code_out, out, text_out, _ = run_child(srv, log, opts)
        out_stats = srv.stats()
    not_done = code_out == STOPPED and (out or {}).get("status") == "stopped" and not list(log.glob("steps/*/done.json"))
    files = unit_files(log)
    with _server() as srv:
        code_res, res, text_res, _ = run_child(srv, log, opts)
        res_calls = sum(calls(srv.stats()).values())
    rewritten = [f for f, sig in files.items() if (log / f).exists() and signature(log / f) != sig]
    equal = bool(ref and res) and ref["status"] == res["status"] == "ok" and ref["library"] == res["library"]
    return dict(name="reflection_outage", injected=sum(out_stats["faults"].values()),
                crashes=sum(c not in (0, STOPPED) for c in (code_ref, code_out, code_res)),
                corrupted=_corrupted(opts, [ref, res], [root / "reference", log]), redone=len(rewritten),
                extra=sum(calls(out_stats).values()) + res_calls - ref_calls, size=_size(ref), equal=equal,
                output=text + text_out + text_res, not_done=not_done,
                status=("stopped, step not done" if not_done else "step marked done") + "; resumed on a healthy server")


def calls_per_bad_reply(root: Path, opts: dict) -> str:
    """LM calls per summary when every summary reply is unparseable (the run tolerates the failures)."""
    with _server(faults={"malformed": 1.0}, fault_kinds=("summary",)) as srv:
        _, result, _, _ = run_child(srv, root / "log", {**opts, "max_failure_rate": 1.0})
        sent = srv.stats()["kinds"]["summary"]["calls"]
    units = sum(s["groups_kept"] for s in (result or {}).get("steps", [])) * opts["num_generations"]
    return f"{sent / units:g}" if units else "n/a"


def budget_without_history(root: Path, opts: dict) -> str:
    """max_total_tokens=1 under dspy.configure(disable_history=True): the run must stop after its first step."""
    with _server() as srv:
        _, result, _, _ = run_child(srv, root / "log", {**opts, "disable_history": True, "max_total_tokens": 1})
    result = result or {}
    stopped = len(result.get("steps", [])) == 1 and "max_total_tokens" in (result.get("stopped_early") or "")
    return "stopped" if stopped else "ignored"


def _shown(row: dict) -> dict:
    if row["crashes"]:
        print(row["output"][-2000:])
    equal = "-" if row["equal"] is None else str(row["equal"]).lower()
    print(f"{row['name']:<18}{row['injected']:>9}{row['crashes']:>8}{row['corrupted']:>8}{row['redone']:>7}"
          f"{row['extra']:>12}{row['size']:>8}  {equal:<6}{row['status']}")
    return row


def bench(rate: float, names: list[str], share: float) -> int:
    opts = dict(DEFAULTS, queries=12, batch_size=6, lm_timeout=0.5, num_retries=3)
    print(f"compile: {opts['queries']} queries, G={opts['num_generations']}, {opts['num_train_epochs']} epochs, batch "
          f"{opts['batch_size']}, {opts['num_threads']} threads; fault rate {rate:.0%}; kill -9 after "
          f"{share:.0%} of the uninterrupted run's LM calls")
    print(f"{'fault':<18}{'injected':>9}{'crashes':>8}{'corrupt':>8}{'redone':>7}{'extra calls':>12}{'library':>8}  "
          f"{'equal':<6}status")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfgrpo-faults-") as tmp:
        def folder(name: str) -> Path:
            (Path(tmp) / name).mkdir()
            return Path(tmp) / name

        for name in names:
            rows.append(_shown(fault_row(name, rate, share, folder(name), opts)))
        rows.append(_shown(run_json_row(folder("run_json"), opts, share)))
        rows.append(_shown(metric_error_row(folder("metric_error"), opts)))
        rows.append(_shown(outage_row(folder("outage"), opts)))
        rows += [_shown(row) for row in trust_rows(folder)]  # issue 37: inputs not to be trusted in silence
        rows += [_shown(row) for row in stop_rows(folder("stop"), opts)]  # issue 37: a lock, and Ctrl-C on a hung metric
        per_reply = calls_per_bad_reply(folder("bad_replies"), opts)
        budget = budget_without_history(folder("no_history"), opts)
    print("extra calls: LM calls of the killed + resumed runs beyond the uninterrupted run's (calls in flight at "
          "the kill and, with transient faults, different retries; for reflection_outage, the outage run's calls; "
          "for metric_error, learning calls made); redone: finished units written again; library: experiences "
          "learned by the uninterrupted run")
    total = {k: sum(r[k] for r in rows) for k in ("injected", "crashes", "corrupted", "redone")}
    all_equal = all(r["equal"] for r in rows if r["equal"] is not None)
    print(f"faults: injected={total['injected']} crashes={total['crashes']} corrupted={total['corrupted']} "
          f"redone={total['redone']} resumed_equal={str(all_equal).lower()}")
    outage = next(r for r in rows if r["name"] == "reflection_outage")
    metric_row = next(r for r in rows if r["name"] == "metric_error")
    run_json = next(r for r in rows if r["name"] == "corrupt_run_json")
    print(f"silent_failures: metric_error={'raised' if metric_row['status'].startswith('raised') else 'silent'} "
          f"reflection_outage={'not_done' if outage['not_done'] else 'done'} calls_per_bad_reply={per_reply} "
          f"budget_without_history={budget} corrupt_run_json={'refused' if run_json['refused'] else 'reused'}")
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
