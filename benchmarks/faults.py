"""TrainingFreeGRPO under injected LM faults, and after kill -9 and resume.

For each fault type (at `--rate`) this runs an uninterrupted compile, then the same compile killed with
SIGKILL after a share of its LM calls and resumed from its log_dir, all in child processes against one fake
LM server per run. It reports faults injected, crashes (a child dying of anything but the kill or the
documented failure-rate stop), corrupted libraries (a saved state that fails the library's invariants),
work redone after the resume (a finished step's file written again, or an LM call the record held sent again), and
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
import sys
import tempfile
from pathlib import Path

from benchmarks.fault_child import (DEFAULTS, LEARNING, STOPPED, calls, corrupted, kill_and_resume, run_child, server,
                                    size)
from benchmarks.log_dir_checks import record_keys, resent, signature, unit_files
from benchmarks.stop_rows import stop_rows
from benchmarks.trust_rows import trust_rows
from tfgrpo.testing import FAULTS


def fault_row(name: str, rate: float, share: float, root: Path, opts: dict, between=None) -> dict:
    """An uninterrupted compile under one fault, then the same compile killed after `share` of its calls and
    resumed (`between`: see kill_and_resume)."""
    def faulty():
        return server(faults={name: rate} if name in FAULTS else {})

    with faulty() as srv:
        code, ref, text, _ = run_child(srv, root / "reference", opts)
        ref_stats = srv.stats()
    run = kill_and_resume(faulty, root, opts, kill_after=max(1, int(share * ref_stats["calls"])), between=between,
                          reference=root / "reference")
    equal = bool(ref and run["result"]) and ref.get("status") == run["result"].get("status") and \
        ref.get("library") == run["result"].get("library")
    return dict(name=name, injected=sum(ref_stats["faults"].values()) + sum(run["faults"].values()),
                crashes=sum(c not in (0, STOPPED) for c in (code, run["exit"])) + (run["kill_exit"] not in (0, STOPPED, -9)),
                corrupted=corrupted(opts, [ref, run["result"]], [root / "reference", run["log_dir"]]),
                redone=len(run["rewritten"]), size=size(ref), equal=equal, output=text + run["output"],
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
    """A compile whose metric has a typo (it raises on every attempt): it must stop in its first step with an error
    naming the metric (TooManyFailuresError: each attempt it raised on scores 0, as dspy.Evaluate scores it, and more
    than max_failure_rate of them stop the step), not learn from 0s."""
    with server() as srv:
        code, result, text, _ = run_child(srv, root / "log", {**opts, "metric": "misspelled"})
        learning = sum(srv.stats()["kinds"][k]["calls"] for k in LEARNING)
    result = result or {}
    raised = code == STOPPED and result.get("status") in ("metric_error", "stopped") and \
        "misspelled_metric" in result["error"]
    return dict(name="metric_error", injected=1, crashes=int(code not in (0, STOPPED)), redone=0, extra=learning,
                corrupted=corrupted(opts, [result], [root / "log"]), size=size(result), equal=None, output=text,
                status="raised: the metric's error" if raised else f"silent ({result.get('status', 'no result')})")


def outage_row(root: Path, opts: dict) -> dict:
    """A reflection LM that fails on every call (HTTP 500 after the client's retries): the step must not be
    done; a resume on a healthy server reuses the rollouts and ends as a run that never had the outage."""
    with server() as srv:
        code_ref, ref, text, _ = run_child(srv, root / "reference", opts)
        ref_calls = sum(calls(srv.stats()).values())
    log = root / "outage"
    with server(faults={"http500": 1.0}, fault_kinds=LEARNING) as srv:
        code_out, out, text_out, _ = run_child(srv, log, opts)
        out_stats = srv.stats()
    not_done = code_out == STOPPED and (out or {}).get("status") == "stopped" and not list(log.glob("steps/*.json"))
    files, keys = unit_files(log), record_keys(log)
    with server() as srv:
        code_res, res, text_res, _ = run_child(srv, log, opts)
        res_calls = sum(calls(srv.stats()).values())
    rewritten = [f for f, sig in files.items() if (log / f).exists() and signature(log / f) != sig]
    rewritten += resent(log, keys, root / "reference")
    equal = bool(ref and res) and ref["status"] == res["status"] == "ok" and ref["library"] == res["library"]
    return dict(name="reflection_outage", injected=sum(out_stats["faults"].values()),
                crashes=sum(c not in (0, STOPPED) for c in (code_ref, code_out, code_res)),
                corrupted=corrupted(opts, [ref, res], [root / "reference", log]), redone=len(rewritten),
                extra=sum(calls(out_stats).values()) + res_calls - ref_calls, size=size(ref), equal=equal,
                output=text + text_out + text_res, not_done=not_done,
                status=("stopped, step not done" if not_done else "step marked done") + "; resumed on a healthy server")


def calls_per_bad_reply(root: Path, opts: dict) -> str:
    """LM calls per summary when every summary reply is unparseable (the run tolerates the failures)."""
    with server(faults={"malformed": 1.0}, fault_kinds=("summary",)) as srv:
        _, result, _, _ = run_child(srv, root / "log", {**opts, "max_failure_rate": 1.0})
        sent = srv.stats()["kinds"]["summary"]["calls"]
    units = sum(s["groups_kept"] for s in (result or {}).get("steps", [])) * opts["num_generations"]
    return f"{sent / units:g}" if units else "n/a"


def budget_without_history(root: Path, opts: dict) -> str:
    """max_total_tokens=1 under dspy.configure(disable_history=True): the run must stop inside its first step (each call
    is charged before it is sent)."""
    with server() as srv:
        _, result, _, _ = run_child(srv, root / "log", {**opts, "disable_history": True, "max_total_tokens": 1})
    result = result or {}
    stopped = result.get("steps") == [] and "max_total_tokens" in (result.get("stopped_early") or "")
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
          "for metric_error, learning calls made); redone: finished steps written again and recorded calls sent "
          "again; library: experiences "
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
    ap = argparse.ArgumentParser(description="TrainingFreeGRPO under injected LM faults and kill -9")
    ap.add_argument("--rate", type=float, default=0.2)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the uninterrupted run's calls")
    args = ap.parse_args(argv)
    return bench(args.rate, [f for f in args.faults.split(",") if f], args.kill_at)


if __name__ == "__main__":
    sys.exit(main())
