"""The fake LM server as a paid API (tfgrpo.testing.provider), checked through real dspy.LM calls on loopback: the
cached share of a prompt, the bill, reasoning models, OpenAI's 400 for their temperature, the request log."""

import json
import urllib.error
import urllib.request

import dspy
import pytest
from dspy.utils.exceptions import LMInvalidRequestError, LMRateLimitError

from tfgrpo.testing import FakeLMServer, PrefixCache, dspy_prices

LONG = " ".join(f"fact{i}" for i in range(300))  # a long shared context, as a program's instructions and demos are


def ask(lm, question: str, context: str = LONG, **config):
    """One ChatAdapter call of a two-input program; (prediction, what DSPy passed to its usage tracker)."""
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()), dspy.track_usage() as tracker:
        pred = dspy.Predict("context, question -> answer")(context=context, question=question, config=config)
    (usage,) = tracker.usage_data[lm.model]
    return pred, usage


def post(server, body: dict) -> tuple[int, dict]:
    """A raw chat completion request: (HTTP status, JSON body)."""
    request = urllib.request.Request(f"{server.api_base}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_defaults_keep_the_plain_usage_and_reply():
    with FakeLMServer() as server:
        status, body = post(server, {"model": "o3-mini", "temperature": 0.7, "max_tokens": 10,
                                     "messages": [{"role": "user", "content": "What is 1 + 2?"}]})
        stats = server.stats()
    assert status == 200 and set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert body["usage"]["prompt_tokens"] == 5 and set(body["choices"][0]["message"]) == {"role", "content"}
    assert stats["requests"] == [] and stats["billed_usd"] == 0 and stats["statuses"] == {"200": 1}


def test_prefix_cache_counts_whole_blocks_past_the_minimum():
    deepseek, openai = PrefixCache(), PrefixCache(block=128, minimum=1024)
    words = [f"w{i}" for i in range(1300)]
    assert deepseek.serve("m", words[:200]) == 0  # nothing seen yet
    assert deepseek.serve("m", words[:150] + ["other"]) == 128  # 150 shared words: two whole blocks of 64
    assert deepseek.serve("m", words[:200]) == 192  # the same prompt again: all its whole blocks
    assert deepseek.serve("other-model", words[:200]) == 0  # each model has its own cache
    assert openai.serve("m", words[:1000]) == 0 and openai.serve("m", words[:1000]) == 0  # below 1,024: never cached
    assert openai.serve("m", words[:1300]) == 0 and openai.serve("m", words[:1200] + ["x"]) == 1152


def test_cached_share_grows_and_dspy_reads_it():
    prices = dspy_prices("deepseek/deepseek-chat")
    assert prices["cached_input"] < prices["input"] < prices["output"]
    with FakeLMServer(prefix_cache=True, prices={"deepseek/deepseek-chat": prices}, log_requests=True) as server:
        lm = server.lm("deepseek/deepseek-chat")
        _, first = ask(lm, "What is 1 + 2?")
        _, second = ask(lm, "What is 3 + 4?")  # the same long prefix, another tail
        stats = server.stats()
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached % 64 == 0 and 0.8 * second["prompt_tokens"] < cached < second["prompt_tokens"]
    first_log, second_log = stats["requests"]
    assert second_log["cached_tokens"] == cached and first_log["model"] == "deepseek-chat"
    # DSPy prices each call from its own map; the server, given the same prices, bills the same
    assert stats["billed_usd"] == pytest.approx(sum(entry["cost"] for entry in lm.history), rel=1e-9)
    assert stats["cached_tokens"] == cached and stats["models"]["deepseek-chat"]["calls"] == 2


def test_both_providers_usage_shapes_are_sent():
    with FakeLMServer(prefix_cache=True) as server:
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": LONG}]}
        post(server, body)
        _, reply = post(server, body)
    usage = reply["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 256} and usage["prompt_cache_hit_tokens"] == 256
    assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"] - 256 == 300 - 256


def test_the_bill_is_the_sum_of_its_parts():
    price = {"input": 1e-6, "cached_input": 1e-7, "output": 4e-6}
    with FakeLMServer(prefix_cache=True, prices={"*": price}, log_requests=True) as server:
        lm = server.lm("openai/any-model")
        for question in ("What is 1 + 2?", "What is 2 + 2?", "What is 5 + 2?"):
            ask(lm, question)
        stats = server.stats()
    by_hand = sum((r["prompt_tokens"] - r["cached_tokens"]) * 1e-6 + r["cached_tokens"] * 1e-7
                  + r["completion_tokens"] * 4e-6 for r in stats["requests"])
    assert stats["cached_tokens"] > 0 and stats["billed_usd"] == pytest.approx(by_hand, rel=1e-12)
    assert stats["kinds"]["student"]["billed_usd"] == pytest.approx(by_hand, rel=1e-12)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in stats["requests"])


def test_a_reasoning_model_reply_is_parsed_and_its_reasoning_counted():
    price = {"input": 1e-6, "output": 2e-6}
    with FakeLMServer(reasoning=True, prices=price, log_requests=True) as server:
        lm = server.lm("deepseek/deepseek-reasoner")
        pred, usage = ask(lm, "What is 1 + 2?", context="short")
        (entry,) = server.stats()["requests"]
    assert pred.answer in ("3", "4")  # right or wrong by the server's hash, but parsed by the ChatAdapter
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 32} and usage["completion_tokens"] > 32
    assert lm.history[-1]["outputs"][0]["reasoning_content"].startswith("first restate")
    assert entry["billed_usd"] == pytest.approx(entry["prompt_tokens"] * 1e-6 + entry["completion_tokens"] * 2e-6)


def test_openai_reasoning_models_refuse_a_temperature_but_1_and_dspy_does_not_retry():
    with FakeLMServer(reasoning=True, log_requests=True) as server:
        lm = server.lm("openai/o3-mini", num_retries=3)
        with pytest.raises(LMInvalidRequestError, match="Only the default \\(1\\) value is supported") as caught:
            ask(lm, "What is 1 + 2?", temperature=0.7)
        assert caught.value.status == 400 and server.stats()["calls"] == 1  # not retried
        pred, usage = ask(lm, "What is 1 + 2?", temperature=1.0)
        stats = server.stats()
    assert pred.answer and usage["completion_tokens_details"]["reasoning_tokens"] == 32
    assert "reasoning_content" not in lm.history[-1]["outputs"][0]  # OpenAI hides its reasoning
    assert [r["status"] for r in stats["requests"]] == [400, 200] and stats["statuses"] == {"400": 1, "200": 1}


def test_openai_reasoning_models_refuse_max_tokens_in_openais_words():
    with FakeLMServer(reasoning=True) as server:
        message = [{"role": "user", "content": "What is 1 + 2?"}]
        status, body = post(server, {"model": "gpt-5-mini", "max_tokens": 100, "messages": message})
        ok, _ = post(server, {"model": "gpt-5-chat-latest", "max_tokens": 100, "temperature": 0.2, "messages": message})
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["code"] == "unsupported_parameter"
    assert body["error"]["type"] == "invalid_request_error" and ok == 200  # a -chat model is no reasoning model


def test_the_request_log_records_what_dspy_sends():
    with FakeLMServer(reasoning=True, log_requests=True) as server:
        lm = server.lm("openai/o3-mini", reasoning_effort="low", max_tokens=16000, temperature=1.0)
        _, usage = ask(lm, "What is 1 + 2?")
        (entry,) = server.stats()["requests"]
    assert entry["extra"]["reasoning_effort"] == "low" and entry["temperature"] == 1.0
    assert entry["max_completion_tokens"] == 16000 and entry["max_tokens"] is None  # DSPy renames it for o-series
    assert entry["reasoning_tokens"] == 16 == usage["completion_tokens_details"]["reasoning_tokens"]  # low: half


def test_a_rate_limit_answers_429_with_a_retry_after():
    with FakeLMServer(rate_limit_rpm=2) as server:
        lm = server.lm(num_retries=0)
        lm("What is 1 + 2?")
        lm("What is 2 + 2?")
        with pytest.raises(LMRateLimitError):
            lm("What is 3 + 2?")
        status, body = post(server, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert server.stats()["statuses"] == {"200": 2, "429": 2}


def test_in_its_own_process():
    prices = {"o3-mini": dspy_prices("openai/o3-mini")}  # named as on the wire
    with FakeLMServer(process=True, prefix_cache=True, prices=prices, reasoning=True, log_requests=True) as server:
        lm = server.lm("openai/o3-mini")
        ask(lm, "What is 1 + 2?")
        _, usage = ask(lm, "What is 3 + 4?")
        with pytest.raises(LMInvalidRequestError):
            ask(lm, "What is 1 + 2?", temperature=0.5)
        stats = server.stats()
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0 and stats["reasoning_tokens"] == 64
    assert [r["status"] for r in stats["requests"]] == [200, 200, 400]
    assert stats["billed_usd"] == pytest.approx(sum(e["cost"] for e in lm.history if e.get("cost")), rel=1e-9)


def test_a_bounded_request_log_keeps_the_latest():
    with FakeLMServer(log_requests=2) as server:
        for i in range(4):
            post(server, {"model": f"m{i}", "messages": [{"role": "user", "content": "What is 1 + 2?"}]})
        stats = server.stats()
    assert [r["model"] for r in stats["requests"]] == ["m2", "m3"] and len(stats["models"]) == 4
