"""An API run trusted beyond its happy path. One rule for "no answer": an attempt the provider did not answer (no
choices, or a filtered empty content) is left out of its group and counted as a failed call, never learned from as a
wrong answer (checked against an OpenAI-compatible server of this test's own, the standard library's http.server, not
tfgrpo.testing). A metric's long feedback reaches the learning calls cut, and said once."""

import asyncio
import json
import logging
import re
import threading
import uuid
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import dspy
import pytest

from scripted_lm import ScriptedLM
from test_optimizer import learner, make_trainset, metric
from tfgrpo.optimizers import TrainingFreeGRPO


class Provider(ThreadingHTTPServer):
    """Answers every sum right, except that every third request of a question gets `empty` instead: no choices at all,
    or a content filter's empty content. A JSON-mode retry of an emptied request (DSPy's adapters retry in JSON) is
    emptied too, so that attempt stays unanswered."""

    def __init__(self, empty: str):
        super().__init__(("127.0.0.1", 0), Handler)
        self.empty, self.seen, self.emptied, self.requests = empty, {}, {}, []
        self.lock = threading.Lock()

    def reply(self, body: dict) -> dict:
        text = body["messages"][-1]["content"]
        question = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
        json_mode = bool(body.get("response_format")) or "JSON" in body["messages"][0]["content"]
        with self.lock:
            if json_mode:  # the adapter's retry of the same attempt
                empty = self.emptied.get(question, False)
            else:
                n = self.seen[question] = self.seen.get(question, -1) + 1
                empty = self.emptied[question] = n % 3 == 1
            self.requests.append(empty)
        if empty and self.empty == "no choices":
            choices = []
        elif empty:
            choices = [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "content_filter"}]
        else:
            answer = str(int(question[0]) + int(question[1]))
            content = json.dumps({"answer": answer}) if json_mode else \
                f"[[ ## answer ## ]]\n{answer}\n\n[[ ## completed ## ]]"
            choices = [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps(self.server.reply(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("empty", ["no choices", "content filter"])
def test_an_attempt_the_provider_did_not_answer_is_left_out_not_learned_from(empty, caplog):
    server = Provider(empty)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        student = dspy.LM("openai/test-model", api_base=f"http://127.0.0.1:{server.server_port}/v1", api_key="x",
                          cache=False, num_retries=0)
        reflection = ScriptedLM(learner())  # would propose a lesson from any group with contrast
        dspy.configure(lm=student)
        optimizer = TrainingFreeGRPO(metric, reflection_lm=reflection, auto="off", num_generations=4,
                                     num_train_epochs=1, batch_size=4, num_threads=1, learning_path="paper",
                                     max_failure_rate=0.5)
        with caplog.at_level(logging.WARNING, logger="tfgrpo"):
            compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(4))
    finally:
        server.shutdown()
    (step,) = compiled.detailed_results.steps
    assert any(server.requests), "the server emptied some replies"
    assert step.failed_calls == 4 and step.groups_kept == 0  # one unanswered attempt per group; the rest all right
    assert reflection.calls == [] and len(compiled.experience_library) == 0  # nothing compared against nothing
    assert step.mean_reward == 1.0  # the answered attempts only
    assert "got no answer" in caplog.text and "counted in failed_calls" in caplog.text


def test_a_long_feedback_is_cut_for_the_learning_calls_and_said_once(caplog):
    """A metric's feedback of 12,000 characters reaches each learning call cut to MAX_FEEDBACK_CHARS (head and tail),
    and the log says so once."""
    from tfgrpo.programs.render import MAX_FEEDBACK_CHARS

    long = "the answer is wrong because " + "x" * 12000

    def wordy(example, pred, trace=None):
        ok = str(getattr(pred, "answer", "")).strip() == example.answer
        return dspy.Prediction(score=float(ok), feedback="right" if ok else long)

    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        TrainingFreeGRPO(wordy, auto="off", num_generations=4, num_train_epochs=1, batch_size=4, num_threads=2,
                         learning_path="paper").compile(dspy.Predict("question -> answer"), trainset=make_trainset(4))
    assert len(lm.calls) > 16, "the learning calls ran"
    longest = max(len(json.dumps(c["messages"])) for c in lm.calls)
    assert longest < 12000  # no learning call carries the whole feedback
    assert caplog.text.count("feedback on an attempt ran to 12028 characters") == 1
    assert f"cut to {MAX_FEEDBACK_CHARS}" in caplog.text


class Verbose(dspy.Module):
    """A program whose prediction carries a note of 9,000 characters beside its answer."""

    def __init__(self):
        super().__init__()
        self.solve = dspy.Predict("question -> answer")

    def forward(self, question):
        return dspy.Prediction(answer=self.solve(question=question).answer, notes="y" * 9000)


def test_a_long_attempt_is_cut_for_the_learning_calls_and_said_once(caplog):
    from tfgrpo.programs.render import MAX_ATTEMPT_CHARS

    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        TrainingFreeGRPO(metric, auto="off", num_generations=4, num_train_epochs=1, batch_size=4, num_threads=2,
                         learning_path="paper").compile(Verbose(), trainset=make_trainset(4))
    summaries = [c for c in lm.calls if "attempt" in json.dumps(c["messages"]) and "y" * 100 in json.dumps(c["messages"])]
    runs = [len(r) for c in summaries for r in re.findall(r"y{100,}", json.dumps(c["messages"]))]
    assert runs and max(runs) < MAX_ATTEMPT_CHARS  # the note reaches no learning call whole
    assert caplog.text.count("An attempt ran to ") == 1 and f"cut to {MAX_ATTEMPT_CHARS}" in caplog.text


def test_a_resume_under_other_versions_is_refused_naming_both_unless_asked(tmp_path, monkeypatch, caplog):
    """run.json records the versions that make the prompts; a resume under another DSPy (or tfgrpo, LiteLLM, adapter)
    is refused with both versions and the way to go on; resume_other_versions=True reuses the saved units."""
    from test_optimizer import compile_with

    from tfgrpo.optimizers.checkpoint import RunMismatchError

    compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), log_dir=str(tmp_path))
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["versions"]["dspy"] == dspy.__version__ and saved["versions"]["adapter"].endswith("ChatAdapter")
    monkeypatch.setattr(dspy, "__version__", "9.9.9")
    lm = ScriptedLM(learner())
    with pytest.raises(RunMismatchError) as info:
        compile_with(lm, dspy.Predict("question -> answer"), log_dir=str(tmp_path))
    assert f"versions dspy: '{saved['versions']['dspy']}' -> '9.9.9'" in str(info.value)
    assert "resume_other_versions=True" in str(info.value) and lm.calls == []
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        again = compile_with(lm, dspy.Predict("question -> answer"), log_dir=str(tmp_path),
                             resume_other_versions=True)
    assert lm.calls == [] and len(again.detailed_results.steps) == 1  # the finished step reused, nothing sent
    assert caplog.text.count("made under other versions") == 1  # said once
    recorded = json.loads((tmp_path / "run.json").read_text())
    assert recorded["versions"]["dspy"] == "9.9.9" and recorded["earlier_versions"] == [saved["versions"]]


def test_what_a_stopped_run_spent_is_in_its_usage_and_a_run_that_sent_nothing_says_so(caplog):
    """A run stopped part way through a step by its budget reports what that step spent (run_usage, calls by stage);
    a fresh run whose budget pays for no step says it made no call, not that every unit was reused."""
    from test_optimizer import compile_with

    lm = ScriptedLM(learner())
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        stopped = compile_with(lm, dspy.Predict("question -> answer"), max_total_tokens=600, learning_path="paper")
    result = stopped.detailed_results
    assert result.stopped_early and result.steps == [] and lm.calls, "stopped part way through step 0"
    assert result.run_usage["policy"]["calls"] == len([c for c in lm.calls]) - result.run_usage["reflection"].get(
        "calls", 0) > 0
    assert result.limits["calls"]["rollout"] == result.run_usage["policy"]["calls"]
    caplog.clear()
    lm = ScriptedLM(learner())
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        none = compile_with(lm, dspy.Predict("question -> answer"), max_metric_calls=5, learning_path="paper")
    assert lm.calls == [] and none.detailed_results.stopped_early.startswith("budget max_metric_calls=5 cannot pay")
    assert "compile spent: nothing (no call was made)" in caplog.text and "every unit reused" not in caplog.text


def test_the_plan_is_the_run_the_budget_lets_go(caplog):
    """500 training examples, every default (the paper preset, 2,000 metric calls): the plan says the 8 steps the budget
    lets the run start, not the 30 scheduled, the examples those steps read, and the rollouts and metric calls the run
    makes. (Its learning calls are the scripted LM's, many of them answered from DSPy's cache: the calls sent are
    compared against a server in benchmarks.api_run.)"""
    dspy.configure(lm=ScriptedLM(learner()))
    trainset = [dspy.Example(question=f"What is {i} + {i + 10}?", answer=str(2 * i + 10)).with_inputs("question")
                for i in range(500)]
    optimizer = TrainingFreeGRPO(metric, num_threads=8)
    plan = optimizer.plan(dspy.Predict("question -> answer"), trainset)
    total = plan.expected["total"]
    assert plan.steps == 30 and total["steps"] == 8 and total["metric_calls"] == 2000
    assert total["examples_read"]["trainset"] == 400 and "8 step(s) (of 30 scheduled" in plan.summary()
    assert "400 trainset example(s)" in plan.summary() and "from the output fields" in plan.summary()
    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    with caplog.at_level(logging.INFO, logger="tfgrpo.optimizers.training_free_grpo"):
        compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=trainset)
    result = compiled.detailed_results
    assert len(result.steps) == 8 and "max_metric_calls=2000" in result.stopped_early
    # as the run goes, each step's line projects the steps' total from what they spent so far
    projections = [r.getMessage() for r in caplog.records if r.getMessage().startswith("after step")]
    spent = sum(u["calls"] for s in result.steps for u in s.usage.values())
    assert len(projections) == 8 and projections[0].startswith("after step 1 of 8: the steps spent ")
    assert projections[-1].startswith(f"after step 8 of 8: the steps spent {spent:,} calls; at this rate 8 step(s) "
                                      f"make ~{spent:,} calls (the plan: ")
    assert sum(s.metric_calls for s in result.steps) == total["metric_calls"]
    rollouts = sum(s.usage["rollout"]["calls"] for s in result.steps)
    assert rollouts == total["steps"] * plan.expected["per_step"]["rollout"]["calls"] == 2000


def _reply(choices: list[dict]) -> dict:
    return {"id": "r", "object": "chat.completion", "created": 0, "model": "reflector", "choices": choices,
            "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}}


def _choice(finish: str, **message) -> list[dict]:
    return [{"index": 0, "message": {"role": "assistant", "content": "", **message}, "finish_reason": finish}]


@pytest.mark.parametrize("kind, reply", [
    ("no choices", _reply([])),
    ("empty", _reply(_choice("stop"))),
    ("filtered", _reply(_choice("content_filter"))),
    ("cut", _reply(_choice("length"))),
    ("reasoning", _reply(_choice("stop", reasoning_content="First I weigh the attempts."))),
    ("reasoning, cut", _reply(_choice("length", reasoning_content="First I weigh the attempts and then"))),
])
def test_a_reflection_reply_with_nothing_in_it_says_what_came_back_and_the_fix(caplog, kind, reply):
    """A reflection LM whose replies have nothing to read fails each learning call; the failure names what came back
    (no choices, an empty content, a filter, a cut, only reasoning) and the fix that fits it, first."""
    from test_optimizer import compile_with

    from tfgrpo.optimizers.workers import EMPTY_REPLIES
    from tfgrpo.testing.billing import BillingServer

    with BillingServer(lambda body: reply) as server, caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"),
                                reflection_lm=server.lm("reflector", cache=False), learning_path="paper",
                                max_failure_rate=1.0)
    assert compiled.detailed_results.steps[0].learning_failures > 0
    failures = [r.getMessage() for r in caplog.records if " of query " in r.getMessage()]
    assert failures and all(f"failed ({EMPTY_REPLIES[kind]} (" in m for m in failures), failures[:1]


class Biller(ThreadingHTTPServer):
    """An OpenAI-compatible server that answers sums (with a few sentences of reasoning where the prompt asks for it)
    and bills every request by its own count: a token per 4 characters of the messages and of the reply, at
    gpt-4o-mini's list prices."""

    PRICES = {"input": 0.15, "output": 0.60}  # USD per million tokens

    def __init__(self):
        super().__init__(("127.0.0.1", 0), BillingHandler)
        self.bill, self.requests, self.lock = 0.0, 0, threading.Lock()

    def reply(self, body: dict) -> dict:
        text = body["messages"][-1]["content"]
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
        answer = str(int(a) + int(b))
        reasoning = (f"We need the sum of {a} and {b}. Adding the ones digits first and carrying where needed, then "
                     f"the tens, gives {answer}. Checking by subtracting {b} from {answer} gives back {a}.")
        fields = {"reasoning": reasoning, "answer": answer} if "[[ ## reasoning ## ]]" in body["messages"][0][
            "content"] else {"answer": answer}
        content = "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in fields.items()) + "[[ ## completed ## ]]"
        prompt = sum(len(m["content"]) for m in body["messages"]) // 4
        completion = len(content) // 4
        with self.lock:
            self.requests += 1
            self.bill += (prompt * self.PRICES["input"] + completion * self.PRICES["output"]) / 1e6
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}


class BillingHandler(Handler):
    pass


@pytest.mark.parametrize("program", ["Predict", "ChainOfThought"])
def test_after_the_first_step_the_projected_dollars_are_the_bill_within_35_percent(program, caplog):
    """The program's calls against a server of this test's own, which counts the tokens itself. Before any call the
    plan can only guess a reply's length (from the output fields) and assumes a library that grows; after the first
    step the progress line projects the steps' dollars from what they cost: within 35% of what the server billed."""
    server = Biller()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dspy.configure(lm=dspy.LM("openai/biller", api_base=f"http://127.0.0.1:{server.server_port}/v1",
                                  api_key="x", cache=False, num_retries=0))
        optimizer = TrainingFreeGRPO(metric, reflection_lm=ScriptedLM(learner()), auto="off", num_generations=4,
                                     num_train_epochs=1, batch_size=4, num_threads=2, learning_path="paper",
                                     prices={"openai/biller": Biller.PRICES})
        student = getattr(dspy, program)("question -> answer")
        with caplog.at_level(logging.INFO, logger="tfgrpo.optimizers.training_free_grpo"):
            compiled = optimizer.compile(student, trainset=make_trainset(8))
    finally:
        server.shutdown()
    steps = compiled.detailed_results.steps
    assert server.requests == sum(s.usage["rollout"]["calls"] for s in steps) == 32
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("after step 1 of 2"))
    projected = float(re.search(r"make ~[\d,]+ calls, \$([\d.]+)", first).group(1))
    assert abs(projected - server.bill) <= 0.35 * server.bill, (first, server.bill)
    assert "replies averaged" in first and "(the plan: " in first


@pytest.mark.parametrize("program", ["Predict", "ChainOfThought"])
def test_a_pilot_sets_the_plans_sizes_from_the_providers_count(program):
    """`plan(pilot=4)` runs the student on 4 training queries against the billing server first: a reply's tokens and
    the prompts' come from those calls. The run then answers every query right, so nothing is learned: its bill is
    within 35% of the plan's figure for a library that stays as it starts, and below the figure for one that grows.
    Without the pilot the plan guesses from the output fields, and says so."""
    server = Biller()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dspy.configure(lm=dspy.LM("openai/biller", api_base=f"http://127.0.0.1:{server.server_port}/v1",
                                  api_key="x", cache=False, num_retries=0))
        reflection = ScriptedLM(learner())  # its calls are not billed: priced at 0
        optimizer = TrainingFreeGRPO(metric, reflection_lm=reflection, auto="off", num_generations=4,
                                     num_train_epochs=1, batch_size=4, num_threads=2, learning_path="paper",
                                     prices={"openai/biller": Biller.PRICES, reflection.model: {"input": 0,
                                                                                               "output": 0}})
        student = getattr(dspy, program)("question -> answer")
        guessed = optimizer.plan(student, make_trainset(8))
        assert server.requests == 0 and "from the output fields" in guessed.summary()
        plan = optimizer.plan(student, make_trainset(8), pilot=4)
        assert server.requests == 4 and "from 4 pilot call(s)" in plan.summary() and "the pilot: 4 call(s)" in \
            plan.summary()
        server.bill, server.requests = 0.0, 0
        optimizer.compile(student, trainset=make_trainset(8))
    finally:
        server.shutdown()
    total, fields = plan.expected["total"], guessed.expected["total"]
    print(f"plan_pilot: program={program} bill=${server.bill:.5f} piloted=${total['cost']:.5f} "
          f"piloted_unlearned=${total['cost_unlearned']:.5f} fields=${fields['cost']:.5f} "
          f"fields_unlearned=${fields['cost_unlearned']:.5f} ({total['reply']}; {fields['reply']})")  # pytest -s
    assert abs(total["cost_unlearned"] - server.bill) <= 0.35 * server.bill, (total, server.bill)
    assert server.bill < total["cost"] and abs(guessed.expected["total"]["cost_unlearned"] - server.bill) > \
        0.35 * server.bill  # the guess from the fields alone is further off


class RateLimited(Biller):
    """The Biller behind a requests-per-window limit, as a provider's requests-a-minute one (a window of `window_s`
    seconds here, to keep the test short): a request past `limit` in the sliding window is answered 429 with the wait
    as Retry-After."""

    def __init__(self, limit: int, window_s: float):
        super().__init__()
        self.limit, self.window_s, self.accepted, self.refused = limit, window_s, [], 0

    def admit(self) -> float | None:
        """None if the request is taken, else the seconds until it would be."""
        with self.lock:
            now = time.monotonic()
            recent = [t for t in self.accepted if now - t < self.window_s]
            if len(recent) < self.limit:
                self.accepted.append(now)
                return None
            self.refused += 1
            return self.window_s - (now - recent[0])


class RateLimitedHandler(Handler):
    def do_POST(self):
        wait = self.server.admit()
        if wait is None:
            return super().do_POST()
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps({"error": {"message": "rate limit reached", "type": "rate_limit_error"}}).encode()
        self.send_response(429)
        self.send_header("Retry-After", f"{wait:.2f}")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize("paced", [False, True])
def test_a_paced_lm_keeps_within_the_providers_requests_a_minute(paced):
    """16 rollouts at 4 threads against a provider that takes 6 requests a window: unpaced, some draw a 429 (and wait
    its Retry-After); with `max_requests_per_minute`'s RequestPacer on the same window, none does, and every window
    holds at most 6 starts."""
    from tfgrpo.optimizers.spend import RequestPacer

    server = RateLimited(limit=6, window_s=1.5)
    server.RequestHandlerClass = RateLimitedHandler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pacer = RequestPacer(6)
    pacer.window_s = server.window_s
    try:
        dspy.configure(lm=dspy.LM("openai/biller", api_base=f"http://127.0.0.1:{server.server_port}/v1", api_key="x",
                                  cache=False, num_retries=8, callbacks=[pacer] if paced else []))
        optimizer = TrainingFreeGRPO(metric, reflection_lm=ScriptedLM(learner()), auto="off", num_generations=4,
                                     num_train_epochs=1, batch_size=4, num_threads=4, learning_path="paper")
        compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(4))
    finally:
        server.shutdown()
    (step,) = compiled.detailed_results.steps
    assert step.failed_calls == 0 and len(server.accepted) == 16
    if not paced:
        assert server.refused > 0  # the provider does limit: 16 at once is past 6 a window
        return
    assert server.refused == 0 and pacer.waited_s > 0
    starts = sorted(server.accepted)
    assert all(b - a >= server.window_s for a, b in zip(starts, starts[6:]))  # 7 starts never share a window


class SometimesRefusing(Biller):
    """The Biller answering every other request 429 (Retry-After 0: a limit of another kind, tokens a minute say),
    with the time each request arrived, refused or not."""

    def __init__(self):
        super().__init__()
        self.arrived = []

    def admit(self) -> float | None:
        with self.lock:
            self.arrived.append(time.monotonic())
            return 0.0 if len(self.arrived) % 2 else None


def test_each_try_is_paced_where_it_is_sent_and_a_cached_call_takes_no_start():
    """Every try of a call takes a start from the pacer, so a retry after a 429 is paced as a request of its own: the
    requests that reach the provider, refused ones included, never pass 3 in a window; a call DSPy answers from its
    cache sends nothing and takes no start."""
    from tfgrpo.optimizers.spend import RequestPacer

    server = SometimesRefusing()
    server.RequestHandlerClass = RateLimitedHandler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pacer = RequestPacer(3)
    pacer.window_s, pacer.margin_s = 1.0, 0.05
    try:
        lm = dspy.LM("openai/biller", api_base=f"http://127.0.0.1:{server.server_port}/v1", api_key="x",
                     num_retries=4, callbacks=[pacer])
        with dspy.context(lm=lm):
            predict, fresh = dspy.Predict("question -> answer"), uuid.uuid4().hex  # (no earlier test's cached reply)
            for i in range(3):
                predict(question=f"What is {i} + 1? ({fresh})")
            sent, starts = len(server.arrived), list(pacer._starts)
            predict(question=f"What is 0 + 1? ({fresh})")  # the same request again: from DSPy's cache
    finally:
        server.shutdown()
    assert sent == 6 and len(server.arrived) == sent, "3 calls refused once each, then answered; the cached one: none"
    assert list(pacer._starts) == starts and pacer.waited_s > 0
    assert all(b - a >= 1.0 for a, b in zip(server.arrived, server.arrived[3:])), server.arrived


def test_a_config_sections_max_requests_per_minute_paces_its_lm(tmp_path):
    from tfgrpo.config import Config
    from tfgrpo.lms import open_lms
    from tfgrpo.optimizers.spend import RequestPacer

    path = tmp_path / "api.toml"
    path.write_text('[policy]\nbackend = "litellm"\nmodel = "openai/x"\napi_base = "http://127.0.0.1:9/v1"\n'
                    'max_requests_per_minute = 500\n[task]\nname = "math"\n')
    with open_lms(Config.load(path)) as (policy, reflection, _):
        (pacer,) = policy.callbacks
        assert isinstance(pacer, RequestPacer) and pacer.per_minute == 500 and reflection is policy
    with pytest.raises(ValueError, match="at least 1"):
        RequestPacer(0)


class SlowSums(ThreadingHTTPServer):
    """Answers each sum after 0.3 s, noting when each request arrived (this process's monotonic clock)."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads, self.arrived = True, []

    def reply(self, body: dict) -> dict:
        self.arrived.append(time.monotonic())
        time.sleep(0.3)
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", body["messages"][-1]["content"])[-1]
        content = f"[[ ## answer ## ]]\n{int(a) + int(b)}\n\n[[ ## completed ## ]]"
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def test_a_start_is_dated_when_dspys_own_client_sends_the_request(monkeypatch):
    """DSPy's own client sends a request once one of its connections is free: a try that waited for one (here a
    pool of one connection, three calls at once on the event loop, as backend="async" has hundreds) keeps its pacer
    start in the window from when it was sent, not from when it was taken."""
    from dspy._vendor.lm15.transports import _async

    from tfgrpo.optimizers.spend import RequestPacer

    one = _async._AsyncConnectionPool.__init__
    monkeypatch.setattr(_async._AsyncConnectionPool, "__init__", lambda pool, _: one(pool, 1))
    server = SlowSums()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pacer = RequestPacer(100)
    try:
        lm = dspy.LM("openai/sums", api_base=f"http://127.0.0.1:{server.server_port}/v1", api_key="x", cache=False,
                     num_retries=0, callbacks=[pacer])

        async def three():
            with dspy.context(lm=lm):
                predict = dspy.Predict("question -> answer")
                return await asyncio.gather(*(predict.acall(question=f"What is {i} + 1?") for i in range(3)))
        answers = asyncio.run(three())
    finally:
        server.shutdown()
    assert [a.answer for a in answers] == ["1", "2", "3"]
    starts, arrived = sorted(s[0] for s in pacer._starts), sorted(server.arrived)
    assert arrived[2] - arrived[0] >= 0.6, "one connection: each request waited for the one before"
    assert all(abs(s - a) < 0.1 for s, a in zip(starts, arrived)), (starts, arrived)
