"""Rows of benchmarks/faults.py for issue 37, items 1 and 3: a run you can stop and a log_dir two runs cannot share.

Row `locked_log_dir`: a compile hangs in its metric while holding its log_dir; a second compile on the same folder
must be refused at once, naming the holder, with no LM call sent; the holder is then killed with SIGKILL and a
resume takes its lock over and ends with the library of an uninterrupted run (nothing lost).

Row `hung_metric`: a compile whose metric hangs on one query is stopped with Ctrl-C (SIGINT): it must end at once,
keeping the LM calls it made; a resume ends as the uninterrupted run; and the same compile with
`metric_timeout_s=0.5` finishes by itself, the hung calls counted as failures.

    python -m benchmarks.stop_rows child ...   (one compile whose metric may hang: see fault_child.py)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import fault_child as F
from benchmarks.log_dir_checks import record_keys, resent, signature, unit_files

HANG = "TFGRPO_HANG_MARKER"  # the environment variable naming the file the hanging metric touches


def hang_once(example, pred, trace=None):
    """The exact metric, except that, while $HANG names a file, it never returns on the trainset's first question
    (after touching that file). The same code hangs or not: a resume of its run is the same run (same fingerprint)."""
    if os.environ.get(HANG) and example.question == F.make_trainset(1)[0].question:
        Path(os.environ[HANG]).touch()
        threading.Event().wait()
    return F.metric(example, pred)


def child(argv) -> int:
    """fault_child.py's compile, with the hanging metric and a `locked` status for a refused compile."""
    from tfgrpo.optimizers.checkpoint import RunLockedError

    F.METRICS["hang_once"] = hang_once
    try:
        return F.child_main(argv)
    except RunLockedError as exc:
        Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"status": "locked", "error": str(exc)}))
        return F.STOPPED


def _spawn(api_base: str, log_dir: Path, opts: dict, marker: Path | None) -> tuple[subprocess.Popen, Path]:
    """A child compile with the hanging metric; it hangs only with a `marker` file to touch."""
    out = log_dir.with_suffix(f".out{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "benchmarks.stop_rows", "child", "--api-base", api_base, "--log-dir", str(log_dir),
           "--out", str(out), "--opts", json.dumps(opts)]
    env = {k: v for k, v in os.environ.items() if k != HANG}
    env.update({**({HANG: str(marker)} if marker else {}),
                "PYTHONPATH": str(F.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    # SIGINT must reach the child as from a terminal: a shell's background job (a CI runner's) starts with it ignored
    return subprocess.Popen(cmd, cwd=F.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)), out


def _result(proc: subprocess.Popen, out: Path, timeout: float = 120) -> tuple[int, dict, str]:
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
    result = json.loads(out.read_text()) if out.exists() else {}
    out.unlink(missing_ok=True)
    return proc.returncode, result, text


def _hanging(srv, log_dir: Path, opts: dict) -> subprocess.Popen:
    """A compile whose metric hangs, once it hangs (it holds its log_dir's lock by then)."""
    marker = log_dir.with_suffix(".hanging")
    proc, _ = _spawn(srv.api_base, log_dir, {**opts, "metric": "hang_once"}, marker)
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the stage's other units finish
    return proc


def _resumed(srv, log_dir: Path, opts: dict, ref: dict, reference: Path) -> tuple[int, dict, str, int, bool]:
    """Resume `log_dir` with the same metric, no longer hanging: exit code, result, output, work done again (a saved
    file written again, a recorded call sent again), library equal?"""
    files, keys = unit_files(log_dir), record_keys(log_dir)
    code, result, text = _result(*_spawn(srv.api_base, log_dir, {**opts, "metric": "hang_once"}, None))
    redone = sum(1 for f, sig in files.items() if f != "run.json" and (log_dir / f).exists()
                 and signature(log_dir / f) != sig) + len(resent(log_dir, keys, reference))
    return code, result or {}, text, redone, bool(result) and result.get("library") == ref.get("library")


def stop_rows(root: Path, opts: dict) -> list[dict]:
    """The two rows (see the module docstring), in faults.py's row format."""
    with F.server() as srv:
        _, ref, text, _ = F.run_child(srv, root / "reference", opts)
        ref, ref_calls = ref or {}, srv.stats()["calls"]

        # item 1: a second compile on a log_dir in use
        log = root / "locked"
        holder = _hanging(srv, log, opts)
        sent = srv.stats()["calls"]
        second, out = _spawn(srv.api_base, log, opts, log.with_suffix(".unused"))
        code2, res2, text2 = _result(second, out)
        refused = code2 == F.STOPPED and res2.get("status") == "locked" and f"pid {holder.pid} " in res2["error"] \
            and srv.stats()["calls"] == sent
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
        code3, res3, text3, redone, equal = _resumed(srv, log, opts, ref, root / "reference")
        locked = dict(name="locked_log_dir", injected=1, crashes=int(code2 not in (0, F.STOPPED)) + int(code3 != 0),
                      corrupted=F.corrupted(opts, [ref, res3], [root / "reference", log]), redone=redone,
                      extra=srv.stats()["calls"] - 2 * ref_calls, size=F.size(ref), equal=equal,
                      output=text + text2 + text3,
                      status=("refused at once, holder named, nothing sent" if refused else "NOT refused") +
                      "; holder killed, lock taken over, resumed")

        # item 3: Ctrl-C on a hung metric, then the timeout knob
        log, before = root / "hung", srv.stats()["calls"]
        proc = _hanging(srv, log, opts)
        started = time.time()
        proc.send_signal(signal.SIGINT)
        try:
            text4, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            text4, _ = proc.communicate()
        stopped_s, code4 = time.time() - started, proc.returncode
        kept = len(record_keys(log))
        code5, res5, text5, redone, equal = _resumed(srv, log, opts, ref, root / "reference")
        proc, out = _spawn(srv.api_base, root / "timeout", {**opts, "metric": "hang_once", "metric_timeout_s": 0.5},
                           root / "timeout.hanging")
        code6, res6, text6 = _result(proc, out)
        timeouts = sum(s.get("details", {}).get("metric_timeouts", 0) for s in res6.get("steps", []))
        hung = dict(name="hung_metric", injected=2, redone=redone, size=F.size(ref), equal=equal,
                    crashes=int(code4 not in (-signal.SIGINT, 130, 1)) + int(code5 != 0) + int(code6 != 0),
                    corrupted=F.corrupted(opts, [res5, res6], [log, root / "timeout"]),
                    extra=srv.stats()["calls"] - before - 2 * ref_calls, output=text4 + text5 + text6,
                    status=(f"Ctrl-C stopped it in {stopped_s:.1f} s, {kept} LM calls kept" if stopped_s < 10 else
                            f"Ctrl-C took {stopped_s:.0f} s") + "; resumed; metric_timeout_s=0.5: " +
                    (f"{timeouts} hung calls counted, run finished" if res6.get("status") == "ok" else
                     f"run {res6.get('status', 'did not finish')}"))
    return [locked, hung]


if __name__ == "__main__":
    sys.exit(child(sys.argv[2:]) if sys.argv[1:2] == ["child"] else 2)
