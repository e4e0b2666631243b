"""`backend="async"`: a compile's attempts as coroutines on one event loop, against the fake LM server (a real HTTP
server on this machine), compared with the same compile on threads."""

import dspy
import pytest

from benchmarks.fault_child import compile_once, make_trainset, metric, server
from benchmarks.ray_backend import _compile
from tfgrpo.optimizers import TooManyFailuresError
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.runner import Run, Scope
from tfgrpo.optimizers.workers import with_own_lms
from tfgrpo.testing import FakeLMServer


def test_a_compile_on_the_event_loop_is_the_compile_on_threads():
    with server() as a:
        threads = _compile(a, None, queries=4)
    with server() as b:
        run = _compile(b, None, queries=4, backend="async", num_threads=64)
    assert run["calls"] == threads["calls"] > 0
    assert run["library"] == threads["library"] and run["program"] == threads["program"]
    assert run["steps"] == threads["steps"]
    assert run["library"]["experiences"], "the run learned something to compare"


@pytest.mark.parametrize("first, then", [("threads", "async"), ("async", "threads")])
def test_a_run_resumes_on_the_other_backend_with_no_new_call(tmp_path, first, then):
    with server() as a:
        done = _compile(a, tmp_path / "run", queries=4, backend=first)
    with server() as b:
        again = _compile(b, tmp_path / "run", queries=4, backend=then)
    assert again["calls"] == 0 and again["library"] == done["library"] and again["steps"] == done["steps"]


def test_the_attempts_go_through_the_programs_async_path(monkeypatch):
    """Predict's `aforward` for every rollout; the learning calls (sync modules) on the pool's threads."""
    seen = {"aforward": 0, "forward": 0}
    aforward, forward = dspy.Predict.aforward, dspy.Predict.forward

    async def counted_aforward(self, **kwargs):
        seen["aforward"] += 1
        return await aforward(self, **kwargs)

    def counted_forward(self, **kwargs):
        seen["forward"] += 1
        return forward(self, **kwargs)

    monkeypatch.setattr(dspy.Predict, "aforward", counted_aforward)
    monkeypatch.setattr(dspy.Predict, "forward", counted_forward)
    with server() as srv:
        run = _compile(srv, None, queries=4, backend="async")
    rollouts = sum(s["batch_size"] for s in run["steps"]) * 4
    assert seen["aforward"] == rollouts and seen["forward"] == run["calls"] - rollouts


class ForwardOnly(dspy.Module):
    """A program with no `aforward`: it runs on a thread under the async backend."""

    def __init__(self):
        super().__init__()
        self.solve = dspy.Predict("question -> answer")

    def forward(self, question):
        return self.solve(question=question)


def test_a_program_with_only_forward_still_runs():
    with server() as srv, dspy.context(lm=dspy.LM("openai/fake", api_base=srv.api_base, api_key="x", cache=False)), \
            Run(knobs=Knobs(backend="async", num_threads=16, progress=lambda *_: None), metric=metric) as run:
        examples = make_trainset(6)
        with Scope(run, "test") as scope:
            records = scope.scored("validation", [(with_own_lms(ForwardOnly(), rollout_id=i), x)
                                                  for i, x in enumerate(examples)])
        calls = run.record.usage()["validation"]["calls"]
    assert [r.error for r in records] == [None] * 6 and calls == 6
    assert all(r.reward in (0.0, 1.0) for r in records)


def test_an_outage_stops_the_step_as_on_threads(tmp_path):
    """Every rollout's LM call fails (HTTP 500 after the retries): the failure rule stops the run, work kept."""
    with FakeLMServer(latency=0.002, faults={"http500": 1.0}, fault_kinds=("student",), retry_after=0.001) as srv:
        with pytest.raises(TooManyFailuresError, match="attempts failed"):
            compile_once(srv.api_base, str(tmp_path), queries=4, backend="async", num_retries=0)
    assert (tmp_path / "run.json").exists()


def test_the_budget_is_charged_before_each_call_is_sent():
    """max_total_tokens stops the run before a call that would pass it is sent: what the server counted stays within
    the budget but for what the calls in flight spend beyond their expected share (one attempt's on the loop, one
    learning call's on a thread, at num_threads=1)."""
    budget = 3000
    with server() as srv:
        compiled = compile_once(srv.api_base, None, queries=4, backend="async", num_threads=1, max_total_tokens=budget)
        kinds = srv.stats()["kinds"].values()
    tokens = sum(k["prompt_tokens"] + k["completion_tokens"] for k in kinds)
    largest = max((k["prompt_tokens"] + k["completion_tokens"]) / k["calls"] for k in kinds if k["calls"])
    assert "max_total_tokens" in compiled.detailed_results.stopped_early
    assert budget - largest < tokens <= budget + 2 * largest


def test_a_paced_attempt_waits_for_its_start_without_holding_the_loop(monkeypatch):
    """RequestPacer on the async backend: at most `per_minute` starts in any window (a 1 s window here), and the event
    loop goes on meanwhile (a heartbeat on it never stalls)."""
    import asyncio
    import time

    from tfgrpo.optimizers.spend import RequestPacer

    monkeypatch.setattr(RequestPacer, "window_s", 1.0)
    monkeypatch.setattr(RequestPacer, "margin_s", 0.0)
    pacer, beats = RequestPacer(4), []
    with server() as srv:
        lm = srv.lm(callbacks=[pacer])
        run = Run(knobs=Knobs(backend="async", num_threads=16, progress=lambda *_: None), metric=metric)
        with run, dspy.context(lm=lm), Scope(run, "test") as scope:
            async def beat():
                while len(beats) < 200:
                    beats.append(time.monotonic())
                    await asyncio.sleep(0.02)

            heart = asyncio.run_coroutine_threadsafe(beat(), run.backend.loop)
            t0 = time.monotonic()
            records = scope.scored("validation", [(with_own_lms(dspy.Predict("question -> answer"), rollout_id=i), x)
                                                  for i, x in enumerate(make_trainset(12))])
            elapsed = time.monotonic() - t0
            heart.cancel()
        starts = srv.stats()["calls"]
    assert starts == 12 and all(r.error is None for r in records)
    assert elapsed >= 2.0  # 12 starts at 4 a window: the last four wait two windows
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert max(gaps) < 0.5, f"the loop stalled for {max(gaps):.2f} s"


@pytest.mark.parametrize("fault", ["malformed", "truncated", "empty", "invented_ids", "http429", "http500"])
def test_under_each_fault_the_event_loop_learns_what_threads_learn(fault):
    """The fake server injects each fault by the request (the same requests meet the same faults): the compile on
    the event loop ends as on threads, with the same library and step records, or stops as threads stop."""
    ends = {}
    for backend in ("threads", "async"):
        with FakeLMServer(latency=0.002, faults={fault: 0.2}, seed=0, vary_identical=False, retry_after=0.001) as srv:
            try:
                ends[backend] = _compile(srv, None, queries=4, backend=backend, num_threads=16)
            except TooManyFailuresError as exc:
                ends[backend] = {"stopped": str(exc).split(";")[0]}
            assert srv.stats()["faults"][fault] > 0, "the fault was never injected"
    threads, run = ends["threads"], ends["async"]
    assert {k: run.get(k) for k in ("library", "steps", "stopped")} == \
        {k: threads.get(k) for k in ("library", "steps", "stopped")}
