"""TrainingFreeGRPO against a misbehaving LM server, and killed with SIGKILL mid-run.

Every fault type of the fake server, at 20% of the calls: the compile finishes (or stops with the documented
RuntimeError and keeps its record of calls) and every library it produced or saved keeps its invariants.
Kill -9 at several points and resume in a new process: the result equals an uninterrupted run's, and no LM
call whose reply the record held at the kill is sent again.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import fault_child as C
from benchmarks import faults as F
from tfgrpo.testing import FAULTS, KINDS, FakeLMServer

FAST = dict(queries=6, num_generations=4, num_train_epochs=2, batch_size=6, num_threads=8, max_experiences=5,
            lm_timeout=5.0, num_retries=3)


def saved_libraries(log_dir: Path) -> list[dict]:
    return [json.loads(p.read_text())["library"] for p in sorted(log_dir.glob("steps/*.json"))]


def recorded(log_dir: Path, stage: str) -> list[dict]:
    """The LM calls of `stage` log_dir's record holds."""
    path = log_dir / "calls.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in entries if "key" in e and e["stage"] == stage]


def assert_sound(state: dict, max_experiences=FAST["max_experiences"]):
    assert C.library_problems(state, max_experiences=max_experiences) == []


@pytest.mark.parametrize("fault", FAULTS)
def test_a_compile_survives_each_fault(tmp_path, fault):
    opts = dict(FAST)
    if fault == "hang":  # each hang costs the client timeout plus DSPy's 1 s backoff: keep it to one step
        opts.update(num_train_epochs=1, lm_timeout=0.3)
    with FakeLMServer(latency=0.005, faults={fault: 0.2}, hang_seconds=1.0) as server:
        try:
            compiled = C.compile_once(server.api_base, str(tmp_path), **opts)
        except RuntimeError as exc:  # allowed only as the documented stop, with the calls kept
            assert "attempts failed" in str(exc) and str(tmp_path) in str(exc)
            assert (tmp_path / "run.json").exists() and recorded(tmp_path, "rollout")
            compiled = None
        stats = server.stats()
    assert stats["faults"][fault] > 0, "the fault was never injected"
    for state in saved_libraries(tmp_path):
        assert_sound(state)
    if compiled is None:
        return
    steps = compiled.detailed_results.to_dict()["steps"]
    assert len(steps) == opts["num_train_epochs"] * -(-opts["queries"] // opts["batch_size"])
    final = compiled.experience_library.dump_state()
    assert_sound(final)
    assert final["experiences"], "learning went on despite the faults"
    assert final == saved_libraries(tmp_path)[-1]  # what was returned is what the checkpoint holds
    rollouts = sum(s["batch_size"] for s in steps) * opts["num_generations"]
    if fault in ("http429", "http500"):
        assert sum(v["errors"] for v in stats["kinds"].values()) > 0
        assert sum(s["rollout_failures"] for s in steps) <= 0.05 * rollouts  # retries absorb transient errors
    if fault == "invented_ids":
        assert sum(s["operations_rejected"] for s in steps) > 0
        assert all(i.startswith("E") and int(i[1:]) < 50 for i in compiled.experience_library.active)


def test_too_many_failed_attempts_stop_the_run_and_keep_the_checkpoint(tmp_path):
    # most student replies are empty, in chat and in JSON: most attempts got no answer (a reply with content that does
    # not parse is the program's own 0, no failure: test_own_program)
    with FakeLMServer(latency=0.002, faults={"empty": 0.8}, fault_kinds=("student",)) as server:
        with pytest.raises(RuntimeError, match="attempts failed") as info:
            C.compile_once(server.api_base, str(tmp_path), **dict(FAST, max_failure_rate=0.5))
        learning = sum(server.stats()["kinds"][k]["calls"] for k in KINDS if k != "student")
    assert "log_dir" in str(info.value)
    assert learning == 0, "no learning call after a failed rollout stage"
    assert (tmp_path / "run.json").exists() and not list(tmp_path.glob("steps/*.json"))
    assert recorded(tmp_path, "rollout"), "the calls that were answered are kept for the resume"


def test_a_resume_after_the_failure_stop_retries_the_failed_attempts(tmp_path):
    with FakeLMServer(latency=0.002, faults={"empty": 1.0}, fault_kinds=("student",)) as server, \
            pytest.raises(RuntimeError):
        C.compile_once(server.api_base, str(tmp_path), **FAST)
    assert not recorded(tmp_path, "rollout"), "an empty reply is never kept: a resume asks again"
    with FakeLMServer(latency=0.002) as healthy:  # the outage is over
        compiled = C.compile_once(healthy.api_base, str(tmp_path), **FAST)
        sent = healthy.stats()["kinds"]["student"]["calls"]
    assert all(s["rollout_failures"] == 0 for s in compiled.detailed_results.to_dict()["steps"])
    assert sent == sum(s["batch_size"] for s in compiled.detailed_results.to_dict()["steps"]) * FAST["num_generations"]


def _server():
    # every request is distinct (the sample number is in the prompt), answers depend on the request alone
    return FakeLMServer(latency=0.005, seed=3, vary_identical=False)


KILL_OPTS = dict(FAST, batch_size=3, num_threads=4)  # 4 steps of ~30 calls


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    with _server() as server:
        code, result, output, _ = C.run_child(server, root / "log", KILL_OPTS)
        per_kind = C.calls(server.stats())
    assert code == 0, output[-3000:]
    assert len(result["library"]["experiences"]) > 0 and len(result["steps"]) == 4
    return result, per_kind, root / "log"


@pytest.mark.parametrize("share, kind", [(0.15, None), (0.5, None), (0.85, None), (2, "consolidation")],
                         ids=["early", "middle", "late", "2nd-consolidation"])
def test_kill_9_and_resume_equals_an_uninterrupted_run_and_redoes_nothing(tmp_path, reference, share, kind):
    ref, ref_calls, ref_dir = reference
    kill_after = share if kind else max(1, int(share * sum(ref_calls.values())))
    run = C.kill_and_resume(_server, tmp_path, KILL_OPTS, kill_after=kill_after, kill_kind=kind, reference=ref_dir)
    assert run["killed"] and run["kill_exit"] == -9, run["output"][-3000:]
    assert run["exit"] == 0, run["output"][-3000:]
    # (a) the same library as without the kill
    assert run["result"]["library"] == ref["library"]
    # (b) finished units are neither recomputed (no file written again) nor re-sent: per kind of call, the
    # resumed run makes exactly the calls of the units not finished at the kill (a call in flight is redone)
    assert run["rewritten"] == []
    assert run["resumed_calls"] == {k: ref_calls[k] - run["done_units"][k] for k in KINDS}
    assert all(run["killed_calls"][k] >= run["done_units"][k] for k in KINDS)
    for state in saved_libraries(run["log_dir"]):
        assert_sound(state)
    assert C.torn_files(run["log_dir"]) == []


def test_kill_9_and_resume_under_reply_faults(tmp_path, reference):
    def server():
        return FakeLMServer(latency=0.005, seed=3, vary_identical=False, faults={"malformed": 0.2})

    root = tmp_path / "ref"
    with server() as srv:
        code, ref, output, _ = C.run_child(srv, root, KILL_OPTS)
        total = srv.stats()["calls"]
    assert code == 0, output[-3000:]
    run = C.kill_and_resume(server, tmp_path, KILL_OPTS, kill_after=total // 2, reference=root)
    assert run["killed"] and run["exit"] == 0, run["output"][-3000:]
    assert run["result"]["library"] == ref["library"] and run["rewritten"] == []


def test_the_benchmark_measures_each_silent_failure_as_caught(tmp_path):
    opts = dict(F.DEFAULTS, queries=6, batch_size=3)
    folders = {name: tmp_path / name for name in ("metric", "outage", "replies", "history")}
    for folder in folders.values():
        folder.mkdir()
    metric_row, outage = F.metric_error_row(folders["metric"], opts), F.outage_row(folders["outage"], opts)
    assert metric_row["status"] == "raised: the metric's error" and metric_row["extra"] == 0, "no learning call"
    assert outage["not_done"] and outage["equal"] and outage["redone"] == outage["crashes"] == 0
    assert F.calls_per_bad_reply(folders["replies"], opts) == "2"
    assert F.budget_without_history(folders["history"], opts) == "stopped"


def test_the_benchmark_refuses_a_killed_run_whose_run_json_was_emptied(tmp_path):
    """Issue 18: `: > run.json` after a kill, then a resume with other settings: refused with nothing sent; once
    run.json is back, the resume ends as the uninterrupted run."""
    row = F.run_json_row(tmp_path, dict(F.DEFAULTS, queries=6, batch_size=3), share=0.5)
    assert row["refused"], row["output"][-3000:]
    assert row["crashes"] == row["corrupted"] == row["redone"] == 0 and row["equal"], row["output"][-3000:]
