"""`backend="ray"` when something is wrong before any task runs: a dead cluster address fails at once naming it and
the fix, and a program that does not pickle is named by its part and type."""

import threading
import time

import dspy
import pytest

ray = pytest.importorskip("ray")

from tfgrpo.optimizers.workers import RayAttempts, unpicklable  # noqa: E402
from tfgrpo.testing.ray_cluster import free_port  # noqa: E402


class HoldsALock(dspy.Module):
    def __init__(self):
        super().__init__()
        self.ask = dspy.Predict("question -> answer")
        self.cache = {"lock": threading.Lock()}

    def forward(self, question):
        return self.ask(question=question)


def test_a_part_that_does_not_pickle_is_named_with_its_type():
    assert unpicklable(HoldsALock(), "program", ray.cloudpickle.dumps) == "program.cache['lock'] (_thread.lock)"
    assert unpicklable(dspy.Predict("question -> answer"), "program", ray.cloudpickle.dumps) is None


def test_a_dead_address_fails_at_once_naming_it(monkeypatch):
    if ray.is_initialized():
        ray.shutdown()
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.time()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at {address} \\(from RAY_ADDRESS\\)"):
        RayAttempts()
    assert time.time() - started < 10 and not ray.is_initialized()


def test_a_node_with_another_tfgrpo_is_refused_before_any_task_unless_asked(tmp_path, caplog):
    """A one-node cluster whose task processes find another tfgrpo first on their path (a dist-info of version 9.9.9,
    as a node with an older install would): the driver refuses it, naming the node's versions and the flag, before
    any attempt runs; with `ray_other_versions=True` the run goes on and says so."""
    from tfgrpo.optimizers.knobs import Knobs
    from tfgrpo.optimizers.runner import Runner
    from tfgrpo.testing.ray_cluster import LocalRayCluster

    other = tmp_path / "other" / "tfgrpo-9.9.9.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: tfgrpo\nVersion: 9.9.9\n")
    if ray.is_initialized():
        ray.shutdown()
    with LocalRayCluster(nodes=1, env={"PYTHONPATH": str(other.parent)}) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            with pytest.raises(RuntimeError, match=r"'tfgrpo': '9\.9\.9'.*ray_other_versions=True"):
                Runner(Knobs(backend="ray"), lambda *_: 0.0)
            with caplog.at_level("WARNING"):
                Runner(Knobs(backend="ray", ray_other_versions=True), lambda *_: 0.0)
            assert "9.9.9" in caplog.text and "ray_other_versions=True" in caplog.text
        finally:
            ray.shutdown()
