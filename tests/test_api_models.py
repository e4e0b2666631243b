"""Models behind an API, tried as their users run them, against the provider simulator (`tfgrpo.testing`; there is no
network here): a failed call is no answer, a budget holds inside a step and a resume goes on from it, a reasoning
model keeps the temperature it requires, `plan()` makes no call and foresees the calls, and the docs' API example
runs."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import dspy
import pytest

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.testing import FakeLMServer, dspy_prices

ROOT = Path(__file__).resolve().parent.parent
MODEL = "deepseek/deepseek-chat"


def trainset(n=8):
    return [dspy.Example(question=f"What is {3 * i + 7} + {5 * i + 11}?", answer=str(8 * i + 18)).with_inputs("question")
            for i in range(n)]


def exact(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def always(example, pred, trace=None):
    return 1.0  # every real answer is worth the same: no group has contrast


def lm_for(server, model=MODEL, **kw):
    return dspy.LM(model, api_base=server.api_base, api_key="x", cache=False, **{"num_retries": 3, **kw})


def compile_on(server, metric, log_dir=None, *, lm=None, **knobs):
    opts = dict(num_generations=4, batch_size=4, num_train_epochs=1, num_threads=4, learning_path="paper",
                log_dir=str(log_dir) if log_dir else None, progress=lambda *_: None, **knobs)
    with dspy.context(lm=lm or lm_for(server)):
        return TrainingFreeGRPO(metric, **opts).compile(dspy.Predict("question -> answer"), trainset=trainset())


def learning_calls(server) -> int:
    return sum(server.stats()["kinds"][k]["calls"] for k in ("summary", "advantage", "consolidation"))


def test_a_failed_call_is_no_answer_so_equal_answers_and_429s_make_no_learning_call(tmp_path):
    """30% of requests answered 429 and no retry left: the attempts that got no answer are left out of their groups,
    never scored; with every real answer equal no group has contrast, so no learning call is made, as in a run with no
    failure at all."""
    with FakeLMServer(faults={"http429": 0.3}, fault_kinds=("student",), retry_after=0.001) as server:
        compiled = compile_on(server, always, tmp_path, lm=lm_for(server, num_retries=0))
        assert learning_calls(server) == 0
    steps = compiled.detailed_results.steps
    assert steps[0].failed_calls > 0 and steps[0].groups_kept == 0
    with FakeLMServer() as server:
        compile_on(server, always)
        assert learning_calls(server) == 0


def test_an_attempt_without_an_answer_leaves_its_group_smaller_and_is_counted(tmp_path):
    with FakeLMServer(faults={"http429": 0.3}, fault_kinds=("student",), retry_after=0.001) as server:
        compiled = compile_on(server, exact, tmp_path, lm=lm_for(server, num_retries=0))
    step = compiled.detailed_results.steps[0]
    assert step.failed_calls > 0 and step.metric_calls == 4 * 4 - step.failed_calls  # only the answered were scored


def test_a_cost_budget_holds_inside_a_step_and_a_resume_goes_on_from_it(tmp_path):
    """max_cost at half of what the run costs: the bill ends within the budget plus the calls in flight (4 threads),
    and the same call with a larger budget finishes without sending any call the record holds again."""
    def server():
        return FakeLMServer(prices={MODEL: dspy_prices(MODEL)}, log_requests=True)

    with server() as full:
        compile_on(full, exact, tmp_path / "full")
        cost = full.stats()["billed_usd"]
    with server() as cut:
        stopped = compile_on(cut, exact, tmp_path / "cut", max_cost=cost / 2)
        bills = [r["billed_usd"] for r in cut.stats()["requests"] if r["status"] == 200]
    assert "max_cost" in stopped.detailed_results.stopped_early and sum(bills) >= cost / 2 * 0.5
    assert sum(bills[:-4]) <= cost / 2  # what is over the budget is at most the last 4 calls, those in flight
    sent = len(bills)
    with server() as rest:
        resumed = compile_on(rest, exact, tmp_path / "cut", max_cost=cost * 10)
        resent = sum(r["status"] == 200 for r in rest.stats()["requests"])
    assert resumed.detailed_results.stopped_early is None
    with server() as whole:
        compile_on(whole, exact)
        assert resent + sent == sum(r["status"] == 200 for r in whole.stats()["requests"])  # nothing asked twice


def test_a_reasoning_model_keeps_the_temperature_it_requires(caplog):
    """OpenAI's o-series take temperature 1 only (any other is a 400): the default knob leaves it alone, and one passed
    explicitly is refused before any call."""
    with FakeLMServer(reasoning=True, log_requests=True) as server:
        o3 = lm_for(server, "openai/o3-mini", temperature=1.0, max_tokens=16000)
        with caplog.at_level(logging.WARNING, logger="tfgrpo"):
            compiled = compile_on(server, exact, lm=o3)
        requests = server.stats()["requests"]
        assert compiled.detailed_results.steps and server.stats()["statuses"] == {"200": len(requests)}
        assert {r["temperature"] for r in requests if r["kind"] == "student"} == {1.0}
        assert "takes only temperature=1" in caplog.text
        with pytest.raises(ValueError, match="takes only temperature=1"):
            compile_on(server, exact, lm=o3, temperature=0.7)
        assert len(server.stats()["requests"]) == len(requests)  # refused before any call


def test_plan_makes_no_call_and_foresees_the_calls_within_a_quarter():
    with FakeLMServer(prices={MODEL: dspy_prices(MODEL)}) as server:
        with dspy.context(lm=lm_for(server)):
            optimizer = TrainingFreeGRPO(exact, num_threads=4, progress=lambda *_: None)  # auto: the paper preset
            plan = optimizer.plan(dspy.Predict("question -> answer"), trainset())
            assert server.stats()["calls"] == 0
            compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=trainset())
        made = sum(u["calls"] for u in compiled.detailed_results.usage.values())
    assert plan.preset == "paper" and plan.budget["max_metric_calls"] == 2000 and plan.expected["total"]["cost"] > 0
    assert abs(plan.expected["total"]["calls"] - made) <= 0.25 * made
    assert plan.bound["total"]["calls"] >= made


def test_the_api_example_runs_against_the_simulator_and_the_docs_show_its_lines(tmp_path):
    prices = {m: dspy_prices(m) for m in (MODEL, "deepseek/deepseek-reasoner")}
    with FakeLMServer(prefix_cache=True, reasoning=True, prices=prices, token_chars=4) as server:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "api_model.py"), "--api-base", server.api_base],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan: preset 'paper'" in run.stdout and (tmp_path / "program.json").exists()
    example = (ROOT / "examples" / "api_model.py").read_text()
    ran = {line.split("#")[0].strip() for line in example.replace(", **endpoint", "").splitlines()}
    for doc in ("README.md", "docs/usage.md", "docs/api.md"):
        after = (ROOT / doc).read_text().split("behind an API", 1)[1]
        shown = re.search(r"```python\n(.*?)```", after, re.S).group(1)
        code = [line.split("#")[0].strip() for line in shown.splitlines()]
        missing = [c for c in code if c and not c.startswith(("import ", "from ")) and c not in ran]
        assert not missing, f"{doc}: lines of the API quick start that examples/api_model.py does not run: {missing}"
