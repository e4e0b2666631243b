"""`backend="ray"`: the attempts of a compile as tasks on a real Ray cluster of two nodes on this machine (a head and a
worker, each its own `ray start` process, started here), against the fake LM server."""

import json
import os
import threading
import time
from pathlib import Path

import dspy
import pytest

ray = pytest.importorskip("ray")

from benchmarks.fault_child import make_trainset, metric, server  # noqa: E402
from benchmarks.ray_backend import ROOT, _compile, faults_row, same_row  # noqa: E402
from tfgrpo.optimizers.knobs import Knobs  # noqa: E402
from tfgrpo.optimizers.runner import Run, Scope  # noqa: E402
from tfgrpo.optimizers.workers import Ray, with_own_lms  # noqa: E402
from tfgrpo.testing.ray_cluster import LocalRayCluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    # the nodes import this module (its programs) and the benchmarks as a user's nodes import their own code
    with LocalRayCluster(nodes=2, env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}) as c:
        os.environ["RAY_ADDRESS"] = c.address
        ray.init(address=c.address, logging_level="ERROR")
        try:
            yield c
        finally:
            ray.shutdown()
            os.environ.pop("RAY_ADDRESS", None)


def test_a_compile_on_the_cluster_is_the_compile_on_threads(cluster, tmp_path):
    row, ray_run = same_row(queries=4, nodes=2)
    assert row["calls_threads"] == row["calls_ray"] > 0
    assert row["library_equal"] and row["program_equal"] and row["steps_equal"], row
    assert ray_run["library"]["experiences"], "the run learned something to compare"
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2


def test_a_run_on_the_cluster_resumes_on_threads_with_no_call(cluster, tmp_path):
    with server() as a:
        first = _compile(a, tmp_path / "run", queries=4, backend="ray")
    for step in (tmp_path / "run" / "steps").glob("*.json"):
        step.unlink()  # every step run again: its calls, made on the nodes, answered from the record
    with server() as b:
        again = _compile(b, tmp_path / "run", queries=4)
    assert again["calls"] == 0 and again["library"] == first["library"]


def test_a_run_on_threads_resumes_on_the_cluster_with_no_call(cluster, tmp_path):
    """The record's replies travel to the nodes: a step run again there asks the provider nothing."""
    with server() as a:
        first = _compile(a, tmp_path / "run", queries=4)
    for step in (tmp_path / "run" / "steps").glob("*.json"):
        step.unlink()
    with server() as b:
        again = _compile(b, tmp_path / "run", queries=4, backend="ray")
    assert again["calls"] == 0 and again["library"] == first["library"]


def _attempt(program, example, backend="ray", threads=1):
    with Run(knobs=Knobs(backend=backend, num_threads=threads, progress=lambda *_: None), metric=metric) as run, \
            Scope(run, "test") as scope:
        return scope.scored("validation", [(program, example)])[0], run, scope


class Exits(dspy.Module):
    """A program whose process dies in the middle of its attempt, as a node does."""

    def forward(self, question):
        os._exit(1)


class Sleeps(dspy.Module):
    """A program whose attempt outlasts the test unless it is cancelled."""

    def forward(self, question):
        time.sleep(120)


def test_a_task_lost_for_good_is_an_attempt_with_no_answer_not_a_zero(cluster, monkeypatch):
    monkeypatch.setattr(Ray, "max_retries", 1)
    with server() as srv, dspy.context(lm=srv.lm()):
        attempt, run, scope = _attempt(Exits(), make_trainset(1)[0])
    assert attempt.failed and attempt.reward is None and "RayTaskLost" in attempt.error
    assert scope.failures["validation"].errors[0].startswith("RayTaskLost")  # counted, as a failed LM call is
    assert run.record.spent["metric_calls"] == 0  # an attempt that got no answer is not charged as a metric call


def test_the_calls_of_a_remote_attempt_are_recorded_here(cluster):
    with server() as srv, dspy.context(lm=srv.lm()):
        program = with_own_lms(dspy.Predict("question -> answer"), rollout_id=3)
        remote, remote_run, _ = _attempt(program, make_trainset(1)[0])
        local, local_run, _ = _attempt(program, make_trainset(1)[0], "threads")
    assert remote.outputs == local.outputs and remote.reward == local.reward
    there, here = remote_run.record.usage()["validation"], local_run.record.usage()["validation"]
    assert there["calls"] == here["calls"] == 1 and there["prompt_tokens"] == here["prompt_tokens"] > 0


def test_cancel_ends_the_tasks_in_flight(cluster):
    done = {}
    with server() as srv, dspy.context(lm=srv.lm()):
        run = Run(knobs=Knobs(backend="ray", num_threads=1, progress=lambda *_: None), metric=metric)
        program, example = with_own_lms(Sleeps()), make_trainset(1)[0]

        def attempt():
            with Scope(run, "test") as scope:
                done["attempt"] = scope.scored("validation", [(program, example)])[0]

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        while not run.backend._running:
            time.sleep(0.05)
        time.sleep(1.0)
        t0 = time.time()
        run.backend.close(interrupted=True)  # Ctrl-C's way out: the tasks on the cluster end too
        thread.join(60)
    assert not thread.is_alive() and time.time() - t0 < 30
    assert done["attempt"].failed and "TaskCancelled" in done["attempt"].error


def test_a_paced_lm_is_refused_on_the_cluster(cluster):
    """A RequestPacer paces one process: on the nodes each task would get a copy of its own, so it is refused."""
    from tfgrpo.optimizers.spend import RequestPacer

    with server() as srv, dspy.context(lm=srv.lm(callbacks=[RequestPacer(60)])):
        with pytest.raises(ValueError, match="RequestPacer"):
            _attempt(dspy.Predict("question -> answer"), make_trainset(1)[0])


def test_the_backend_knob_is_checked():
    with pytest.raises(ValueError, match="backend"):
        Knobs(backend="dask")
    assert Path(ROOT / "docs/ray.md").exists()


def test_tfgrpo_run_sends_its_compile_and_evaluation_to_the_cluster(cluster, tmp_path):
    """`tfgrpo run` with `backend = "ray"` in the config's [optimizer] section: the same library and scores as the run
    on threads (each against a fresh fake server)."""
    from typer.testing import CliRunner

    from test_cli import config
    from tfgrpo.cli import app
    from tfgrpo.testing import FakeLMServer

    found = {}
    for backend in ("threads", "ray"):
        folder = tmp_path / backend
        folder.mkdir()
        path = config(folder, "API_BASE")
        with FakeLMServer(latency=0.001) as srv:
            path.write_text(path.read_text().replace("API_BASE", srv.api_base)
                            .replace("[optimizer]\n", f'[optimizer]\nbackend = "{backend}"\n'))
            result = CliRunner().invoke(app, ["run", str(path)])
            assert result.exit_code == 0, result.output
        run = folder / "run"
        summary = json.loads((run / "eval" / "summary.json").read_text())
        found[backend] = (json.loads((run / "library.json").read_text()),
                          {k: summary[k]["mean_at_k"] for k in ("baseline", "compiled")})
        assert ("backend: ray" in result.output) == (backend == "ray")
    assert found["ray"] == found["threads"]


def test_a_worker_node_killed_mid_run_loses_nothing(cluster):
    # the last test of the module: the cluster has one node after it
    reference = same_row(queries=4, nodes=2)[1]
    row = faults_row(cluster, queries=4, kill_at=6, reference=reference)
    assert row["killed"] == 1 and row["processes_killed"] > 0, row
    assert row["crashes"] == 0 and row["corrupted"] == 0 and row["charged_twice"] == 0, row
    assert row["library_equal"], row


def test_a_program_that_does_not_pickle_is_named_by_its_part(cluster):
    from test_ray_errors import HoldsALock

    with server() as srv, dspy.context(lm=srv.lm()):
        started = time.time()
        with pytest.raises(TypeError, match=r"and program\.cache\['lock'\] \(_thread\.lock\) does not pickle"):
            _attempt(with_own_lms(HoldsALock()), make_trainset(1)[0])
    assert time.time() - started < 30


def test_the_metric_gets_what_the_program_returned_on_the_node(cluster):
    """What a task's program returned travels back as it is: every completion of `n=3`; a return value that does not
    pickle (an open file) is refused, naming the part, instead of reaching the metric as something else."""
    from user_programs import Several, WithFile

    seen = []

    def completions(example, pred, trace=None):
        seen.append(len(pred.completions))
        return 1.0

    with server() as srv, dspy.context(lm=srv.lm()):
        with Run(knobs=Knobs(backend="ray", num_threads=2, progress=lambda *_: None), metric=completions) as run, \
                Scope(run, "test") as scope:
            attempts = scope.scored("validation", [(with_own_lms(Several(), rollout_id=i), x)
                                                   for i, x in enumerate(make_trainset(2))])
        assert [a.reward for a in attempts] == [1.0, 1.0] and seen == [3, 3]
        with pytest.raises(TypeError, match=r"prediction\.log \(_io\.TextIOWrapper\) does not pickle"):
            _attempt(with_own_lms(WithFile()), make_trainset(1)[0])
