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
