"""What makes the fake LM server behave like a paid API: prefix caching, prices, reasoning models, a rate limit.

`FakeLMServer` keeps the HTTP side; a `Provider` decides, for one request, what a real provider would add to it:

* prefix caching as DeepSeek and OpenAI bill it: the prompt's longest prefix shared with an earlier prompt to the
  same model counts as cached, in whole blocks (DeepSeek: 64 tokens; OpenAI: 128, and nothing below 1,024);
* a bill per call from per-token prices (`dspy_prices` reads the ones DSPy itself prices calls with);
* reasoning models: hidden or visible reasoning tokens counted in the completion, and OpenAI's refusal (HTTP 400)
  of a `temperature` other than 1 or of `max_tokens` for its o-series and gpt-5 models;
* a requests-per-minute limit answered with 429 and a Retry-After.

Words stand in for tokens, as everywhere in the fake server: a prompt is the words of its messages in order (each
tagged with its message's role, so a system text does not match the same user text), and their number is the
`prompt_tokens` the server has always reported.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
import threading
import time

OPENAI_REASONING = re.compile(r"^(o\d+(-.*)?|gpt-5(?!.*-chat).*)$")  # o1, o3-mini, o4-mini, gpt-5, gpt-5-mini...
DEEPSEEK_REASONING = re.compile(r"^deepseek-reasoner")
REASONING_TOKENS = 32  # per reply, for `reasoning=True`; reasoning_effort scales it
_EFFORT = {"minimal": 0.25, "low": 0.5, "medium": 1.0, "high": 2.0}
_THOUGHT = "first restate the question then work it through step by step and check the result before answering".split()


def message_text(content) -> str:
    """The text of a message's content: a string, or the text of its content parts."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def prompt_words(messages: list, token_chars: int | None = None) -> list[str]:
    """The prompt as tokens: every word of every message (or, with `token_chars`, every run of that many characters, as
    a real tokenizer counts about 4), in order, tagged with its message's role."""
    if token_chars:
        return [f"{m.get('role', '')}\x1f{text[i:i + token_chars]}" for m in messages
                for text in [message_text(m.get("content"))] for i in range(0, len(text), token_chars)]
    return [f"{m.get('role', '')}\x1f{w}" for m in messages for w in message_text(m.get("content")).split()]


def count_tokens(text: str, token_chars: int | None = None) -> int:
    """A reply's tokens, counted as `prompt_words` counts a prompt's."""
    return -(-len(text) // token_chars) if token_chars else len(text.split())


def bare(model: str) -> str:
    """A model name as it goes on the wire: `deepseek/deepseek-chat` -> `deepseek-chat`."""
    return str(model).rsplit("/", 1)[-1]


def dspy_prices(model: str) -> dict:
    """DSPy's own per-token prices for a `dspy.LM` model string, as `FakeLMServer(prices=...)` takes them.

    DSPy 3.4 routes the model to a provider and reads LiteLLM's price map (its bundled snapshot when
    LITELLM_LOCAL_MODEL_COST_MAP=true); a cached-input price it does not know is the input price, as DSPy bills it.
    """
    import dspy
    from dspy.clients.capabilities import resolve
    from dspy.clients.model_metadata import model_info, rate

    route = resolve(dspy.LM(model))
    info = model_info(route.provider, route.model)
    found = {"input": rate(info, "input_cost_per_token"), "cached_input": rate(info, "cache_read_input_token_cost"),
             "output": rate(info, "output_cost_per_token")}
    if found["input"] is None or found["output"] is None:
        raise ValueError(f"DSPy knows no price for {model!r} (provider {route.provider!r}, model {route.model!r})")
    return {**found, "cached_input": found["input"] if found["cached_input"] is None else found["cached_input"]}


class PrefixCache:
    """The prompt prefixes a provider has served, per model, as digests of whole blocks (each block's digest covers
    everything before it, so a block matches only when the whole prefix up to it does)."""

    def __init__(self, block: int = 64, minimum: int = 64):
        if block < 1 or minimum < 0:
            raise ValueError(f"cache block must be >= 1 and minimum >= 0, got {block} and {minimum}")
        self.block, self.minimum, self._seen = block, minimum, {}

    def serve(self, model: str, tokens: list[str]) -> int:
        """The tokens of this prompt already cached (a whole number of blocks, or 0 below the minimum); then it is
        remembered, so a later prompt may reuse it."""
        seen, digest, cached, hit = self._seen.setdefault(model, set()), b"", 0, True
        for end in range(self.block, len(tokens) + 1, self.block):
            block = "\x1e".join(tokens[end - self.block:end]).encode()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            if hit and digest in seen:
                cached = end
            else:
                hit = False
                seen.add(digest)
        return cached if cached >= self.minimum else 0


class Provider:
    """The paid-API behaviours of `FakeLMServer` (all off by default, leaving its replies as they always were).

    prefix_cache, cache_block, cache_min: see `PrefixCache`. prices: {model: {"input", "cached_input", "output"}}
    in USD per token, a model named as on the wire or as DSPy names it, "*" for any other (or one price dict for
    all). reasoning: True for the default reasoning models (OpenAI's o-series and gpt-5 family but its -chat
    models, deepseek-reasoner), or {model name or prefix: reasoning tokens per reply}. rate_limit_rpm: requests
    accepted per sliding minute; more get 429 with a Retry-After. token_chars: count a token per this many characters
    (about 4 for English under a real tokenizer) instead of one per word.
    """

    def __init__(self, *, prefix_cache: bool = False, cache_block: int = 64, cache_min: int = 64,
                 prices: dict | None = None, reasoning: bool | dict | None = None, rate_limit_rpm: int | None = None,
                 token_chars: int | None = None):
        self.cache = PrefixCache(cache_block, cache_min) if prefix_cache else None
        prices = dict(prices or {})
        self.prices = {"*": prices} if "input" in prices else prices
        for name, price in self.prices.items():
            if not {"input", "output"} <= set(price) or set(price) - {"input", "cached_input", "output"}:
                raise ValueError(f"prices[{name!r}] must have 'input' and 'output' (and may have 'cached_input'), "
                                 f"in USD per token; got {sorted(price)}")
        self.reasoning_models, self.rate_limit_rpm, self.token_chars = reasoning, rate_limit_rpm, token_chars
        self._lock, self._accepted = threading.Lock(), collections.deque()

    def refusal(self, body: dict) -> tuple[int, dict, dict] | None:
        """The error a real API answers before doing any work, if any: 429 past the rate limit, then 400 for a
        parameter OpenAI's reasoning models refuse."""
        if self.rate_limit_rpm is not None:
            with self._lock:
                now = time.monotonic()
                while self._accepted and self._accepted[0] <= now - 60:
                    self._accepted.popleft()
                if len(self._accepted) >= self.rate_limit_rpm:
                    wait = max(1, math.ceil(self._accepted[0] + 60 - now))
                    return 429, {"Retry-After": str(wait)}, _error(
                        f"Rate limit reached for {body.get('model')}: limit {self.rate_limit_rpm} requests per min. "
                        f"Please try again in {wait}s.", None, "rate_limit_exceeded", type_="requests")
                self._accepted.append(now)
        if not (self.reasoning_tokens(body) is not None and OPENAI_REASONING.match(bare(body.get("model", "")))):
            return None
        temperature = body.get("temperature")
        if temperature is not None and temperature != 1:
            return 400, {}, _error(f"Unsupported value: 'temperature' does not support {temperature} with this "
                                   "model. Only the default (1) value is supported.", "temperature",
                                   "unsupported_value")
        if "max_tokens" in body:
            return 400, {}, _error("Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                   "'max_completion_tokens' instead.", "max_tokens", "unsupported_parameter")
        return None

    def reasoning_tokens(self, body: dict) -> int | None:
        """How many reasoning tokens a reply to this request carries; None for a model that does not reason."""
        model = bare(body.get("model", ""))
        if self.reasoning_models is True:
            n = REASONING_TOKENS if OPENAI_REASONING.match(model) or DEEPSEEK_REASONING.match(model) else None
        else:
            n = next((v for k, v in (self.reasoning_models or {}).items() if model.startswith(bare(k))), None)
        return None if n is None else int(n * _EFFORT.get(body.get("reasoning_effort"), 1.0))

    def reasoning(self, body: dict) -> tuple[int, str | None]:
        """(reasoning tokens, the reasoning text the reply shows: None where the provider hides it, as OpenAI does)."""
        n = self.reasoning_tokens(body) or 0
        hidden = OPENAI_REASONING.match(bare(body.get("model", "")))
        return n, None if not n or hidden else " ".join(_THOUGHT[i % len(_THOUGHT)] for i in range(n))

    def usage(self, body: dict, messages: list, completion: int, reasoning: int) -> tuple[dict, dict]:
        """(the response's `usage`, this call's accounting) for a served request of `completion` tokens, reasoning
        included. Without a cache or a reasoning model the usage is the plain OpenAI triple."""
        if self.cache:
            tokens = prompt_words(messages, self.token_chars)
            with self._lock:
                prompt, cached = len(tokens), self.cache.serve(body.get("model", ""), tokens)
        else:  # (the same count, without tagging every token)
            prompt, cached = sum(count_tokens(message_text(m.get("content")), self.token_chars) for m in messages), 0
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cache:
            usage.update(prompt_tokens_details={"cached_tokens": cached}, prompt_cache_hit_tokens=cached,
                         prompt_cache_miss_tokens=prompt - cached)
        if self.reasoning_tokens(body) is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        price = self.price(body.get("model", ""))
        billed = 0.0 if price is None else ((prompt - cached) * price["input"] + completion * price["output"]
                                            + cached * price.get("cached_input", price["input"]))
        return usage, {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
                       "reasoning_tokens": reasoning, "billed_usd": billed}

    def price(self, model: str) -> dict | None:
        """The price of a model as the client names it on the wire (or as DSPy does), else the "*" price."""
        if model in self.prices:
            return self.prices[model]
        return next((p for k, p in self.prices.items() if k != "*" and bare(k) == bare(model)), self.prices.get("*"))


def _error(message: str, param: str | None, code: str, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
