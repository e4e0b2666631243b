"""`backend="ray"` when something is wrong before any task runs: a dead cluster address fails at once naming it and
the fix, and a program that does not pickle is named by its part and type."""

import shutil
import threading
import time
from pathlib import Path

import dspy
import pytest

ray = pytest.importorskip("ray")

import tfgrpo  # noqa: E402
from tfgrpo.optimizers.workers import Ray, unpicklable  # noqa: E402
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
        Ray(1)
    assert time.time() - started < 10 and not ray.is_initialized()


def test_a_node_that_imports_another_tfgrpo_is_refused_before_any_task_unless_asked(tmp_path, caplog):
    """A one-node cluster whose task processes import another tfgrpo first (a copy of the package with another
    `__version__`, as `ray.init(runtime_env={"py_modules": [...]})` ships one, while the installed one is the same):
    the driver refuses it before any attempt runs, naming the node's version and the flag; with
    `ray_other_versions=True` the run goes on, says so, and keeps every node's versions."""
    from tfgrpo.testing.ray_cluster import LocalRayCluster

    other = tmp_path / "other" / "tfgrpo"
    shutil.copytree(Path(tfgrpo.__file__).parent, other, ignore=shutil.ignore_patterns("__pycache__", "data"))
    init = other / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{tfgrpo.__version__}"', '__version__ = "0.0.9-other"'))
    if ray.is_initialized():
        ray.shutdown()
    with LocalRayCluster(nodes=1, env={"PYTHONPATH": str(other.parent)}) as cluster:
        ray.init(address=cluster.address, logging_level="ERROR")
        try:
            with pytest.raises(RuntimeError, match=r"'tfgrpo': '0\.0\.9-other'.*ray_other_versions=True"):
                Ray(1, other_versions=False)
            with caplog.at_level("WARNING"):
                backend = Ray(1, other_versions=True)
            assert "0.0.9-other" in caplog.text and "ray_other_versions=True" in caplog.text
            assert [v["tfgrpo"] for v in backend.nodes.values()] == ["0.0.9-other"]
            backend.close()
        finally:
            ray.shutdown()
