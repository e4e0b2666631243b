"""Every call a compile makes is charged, the metric's own included, and no failed reply is served back: a compile
whose metric asks an LLM judge, against a plain server of the test's own that bills each call at its model's price."""

from __future__ import annotations

import collections
import json
import logging

import dspy
import pytest
from dspy.clients import DISK_CACHE_DIR
from test_optimizer import learner
from user_programs import student

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.runner import TooManyFailuresError
from tfgrpo.testing.billing import BillingServer, asked_fields, chat_reply

PRICES = {"student": {"input": 1.0, "output": 2.0}, "judge": {"input": 10.0, "output": 20.0},
          "reflection": {"input": 3.0, "output": 6.0}}  # USD per million tokens; the judge 10x the student
LEARNER = learner()


class Verdict(dspy.Signature):
    """Say whether the answer to the question is right."""

    question: str = dspy.InputField()
    answer: str = dspy.InputField()
    right: bool = dspy.OutputField()


def serve(empty: collections.Counter | None = None):
    """The server's replies: the student right or wrong by how often it has seen the request (the G attempts of a
    query are one request on the wire), the judge by the answer, the learning calls as the scripted learner; with
    `empty`, the reflection model answers HTTP 200 with no choices while `empty["left"]` lasts."""
    seen = collections.Counter()

    def respond(body):
        model, fields = body["model"], asked_fields(body)
        if model == "reflection" and empty is not None and empty["left"] > 0:
            empty["left"] -= 1
            return {"id": "e", "object": "chat.completion", "created": 0, "model": model, "choices": [],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
        if model == "judge":
            return chat_reply({"right": str("yes" in body["messages"][-1]["content"].split("answer ## ]]")[-1])})
        if model == "student":
            key = json.dumps(body["messages"])
            seen[key] += 1
            return chat_reply(student(fields, key, {"rollout_id": seen[key]}))
        values = LEARNER(body["messages"], {})
        return chat_reply({k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()})

    return respond


def judged(server: BillingServer):
    judge = dspy.Predict(Verdict)
    judge.lm = server.lm("judge", cache=False)

    def metric(example, pred, trace=None):
        return float(judge(question=example.question, answer=pred.answer).right)

    return metric


def run(server: BillingServer, tmp_path=None, **kw):
    dspy.configure(lm=server.lm("student", cache=False))
    opts = dict(num_generations=4, batch_size=4, num_train_epochs=4, num_threads=4, learning_path="paper",
                reflection_lm=server.lm("reflection", cache=False), auto=None,
                prices={f"openai/{m}": p for m, p in PRICES.items()})
    opts.update(kw)
    trainset = [dspy.Example(question=f"Is thing {i} red?").with_inputs("question") for i in range(4)]
    valset = [dspy.Example(question=f"Is thing {i} red?").with_inputs("question") for i in range(4, 8)]
    return TrainingFreeGRPO(judged(server), **opts).compile(dspy.Predict("question -> answer"), trainset=trainset,
                                                            valset=valset)


def reported(compiled) -> float:
    return sum(u.get("cost", 0.0) for u in compiled.detailed_results.run_usage.values())


def test_an_llm_judge_is_charged_and_reported_as_the_server_bills_it(caplog):
    with BillingServer(serve(), PRICES) as server, caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = run(server)
        bill = server.total()
    usage = compiled.detailed_results.run_usage
    assert usage["metric"]["calls"] == server.calls["judge"] > 0  # every judge call, rollouts' and validation's
    assert usage["policy"]["calls"] == server.calls["student"]
    assert usage["reflection"]["calls"] == server.calls["reflection"]
    assert reported(compiled) == pytest.approx(bill, rel=0.05)
    steps = compiled.detailed_results.steps
    assert all(s.usage["reward"]["calls"] == 16 for s in steps)  # the step's record holds its judge calls
    assert "metric " in caplog.text  # the end-of-run summary names the role


@pytest.mark.parametrize("share", [0.4, 0.15])
def test_max_cost_with_an_llm_judge_stops_within_a_unit_of_the_budget(share):
    with BillingServer(serve(), PRICES) as server:
        run(server)
        whole = server.total()
    with BillingServer(serve(), PRICES) as server:
        budget = share * whole
        stopped = run(server, max_cost=budget)
        bill = server.total()
    assert stopped.detailed_results.stopped_early and "max_cost" in stopped.detailed_results.stopped_early
    assert bill <= 1.15 * budget, (bill, budget)
    assert reported(stopped) == pytest.approx(bill, rel=0.05)


@pytest.mark.parametrize("backend", ["threads", "async"])
def test_max_cost_with_an_llm_judge_holds_over_four_resumes(tmp_path, backend):
    """The first run stops at the budget; the same compile run again four times on its log_dir, as a user does after a
    stop, answers what was asked from the record, sends nothing the budget does not allow, and reports what the server
    billed over all five: the judge's calls too."""
    with BillingServer(serve(), PRICES) as server:
        run(server, backend=backend)
        whole = server.total()
    with BillingServer(serve(), PRICES) as server:
        budget = 0.4 * whole
        for _ in range(5):
            compiled = run(server, max_cost=budget, backend=backend, log_dir=str(tmp_path))
            assert "max_cost" in compiled.detailed_results.stopped_early
        bill = server.total()
    assert bill <= 1.15 * budget, (bill, budget)
    assert reported(compiled) == pytest.approx(bill, rel=0.05)  # the whole run's, as its record holds it
    assert compiled.detailed_results.run_usage["metric"]["calls"] == server.calls["judge"]


def test_a_resume_after_an_outage_of_empty_replies_asks_again_and_finishes(tmp_path, caplog):
    """A reflection model that answers with no choices stops the step as an outage; a resume against the healthy
    model (DSPy's cache on, as by default) sends those calls again instead of reading the empty replies back."""
    dspy.configure_cache(disk_cache_dir=str(tmp_path / "cache"))
    try:
        empty = collections.Counter(left=10 ** 6)
        with BillingServer(serve(empty), PRICES) as server:
            reflection = server.lm("reflection")  # cached, as DSPy's default is
            with pytest.raises(TooManyFailuresError):
                run(server, reflection_lm=reflection, log_dir=str(tmp_path / "run"), num_train_epochs=1)
            failed = server.calls["reflection"]
            empty["left"] = 0  # the provider is back
            with caplog.at_level(logging.WARNING, logger="tfgrpo"):
                resumed = run(server, reflection_lm=reflection, log_dir=str(tmp_path / "run"), num_train_epochs=1)
            assert server.calls["reflection"] - failed > 0  # the failed calls were sent again
        assert resumed.experience_library.texts() and not resumed.detailed_results.stopped_early
    finally:
        dspy.configure_cache(disk_cache_dir=DISK_CACHE_DIR)


def test_a_piloted_plan_counts_the_judge_calls():
    """plan(pilot=N) scores the pilot's answers with the metric too: a judge's calls per scored attempt, and their
    price, are in every step's estimate and in the run's."""
    with BillingServer(serve(), PRICES) as server:
        dspy.configure(lm=server.lm("student", cache=False))
        trainset = [dspy.Example(question=f"Is thing {i} red?").with_inputs("question") for i in range(4)]
        optimizer = TrainingFreeGRPO(judged(server), num_generations=4, batch_size=4, num_train_epochs=2,
                                     learning_path="paper", auto=None, reflection_lm=server.lm("reflection"),
                                     prices={f"openai/{m}": p for m, p in PRICES.items()})
        blind = optimizer.plan(dspy.Predict("question -> answer"), trainset=trainset)
        piloted = optimizer.plan(dspy.Predict("question -> answer"), trainset=trainset, pilot=2)
        assert server.calls["judge"] == 2  # the pilot's two answers, judged
    assert "reward" not in blind.expected["per_step"]
    judge = piloted.expected["per_step"]["reward"]
    assert judge["calls"] == 16 and judge["cost"] > 0  # one judge call for each of a step's 16 attempts


def test_what_counts_as_an_empty_reply_for_the_cache():
    from tfgrpo.optimizers.workers import answered

    record = {"_dspy_format": "dspy-lm15-result-v1", "outputs": [""]}
    assert not answered(record) and answered({**record, "outputs": ["[[ ## answer ## ]]\n2"]})
    assert answered({**record, "outputs": [{"text": None, "tool_calls": [{"id": "1"}]}]})  # a tool call is an answer
    assert not answered({"choices": []}) and not answered({"choices": [{"message": {"content": "  "}}]})
    assert answered({"choices": [{"message": {"content": "2"}}]}) and answered([0.1, 0.2])  # (an embedding)
