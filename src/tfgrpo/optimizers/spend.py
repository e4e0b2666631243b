"""What LM calls cost, and how fast they may be sent: a model's price (`model_price`), its tokens and context window
(`token_counter`, `context_window`), a meter of the calls made outside a compile's record (`metered`: a plan's pilot,
an evaluation) and the pacer that keeps a provider's requests-per-minute limit (`RequestPacer`). A compile's own calls
are priced and charged by its record (record.py).

Calls and tokens of a meter come from DSPy's usage-tracker hook, which every call that reaches the provider reports to
(replies from DSPy's cache are not counted); dollars are tokens times the model's price (DSPy's copy of LiteLLM's price
map, or `prices=`), cached prompt tokens at the cached price.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import contextvars
import threading
import time
from typing import Any, Callable, Iterator

import dspy
import pydantic
from dspy.utils.callback import BaseCallback
from dspy.utils.usage_tracker import UsageTracker



# -- meters and prices -------------------------------------------------------------------------------------------------
def model_price(model: str, prices: dict | None = None) -> dict[str, float] | None:
    """USD per token of `model` (a dspy.LM model string): {"input", "output", "cached_input"}, from `prices` (per
    million tokens, by model string) or DSPy's copy of LiteLLM's price map; None when neither knows it."""
    if prices and model in prices:
        given = prices[model]
        return {k: given.get(k, given["input"] if k == "cached_input" else 0.0) / 1e6 for k in ("input", "output",
                                                                                                 "cached_input")}
    try:
        from dspy.clients.capabilities import resolve
        from dspy.clients.model_metadata import model_info, rate

        route = resolve(dspy.LM(model))
        info = model_info(route.provider, route.model)
    except Exception:  # a model DSPy cannot route (a custom BaseLM, a name without a provider)
        return None
    found = {k: rate(info, key) for k, key in (("input", "input_cost_per_token"), ("output", "output_cost_per_token"),
                                              ("cached_input", "cache_read_input_token_cost"))}
    if found["input"] is None or found["output"] is None:
        return None
    return {**found, "cached_input": found["cached_input"] if found["cached_input"] is not None else found["input"]}


ESTIMATE = "an estimate (LiteLLM's default tokenizer, not the model's own)"


def token_counter(lm: Any) -> tuple[Callable[[str], int], str]:
    """How to count `lm`'s tokens in a text, and what that count is: the model's own tokenizer where it is known (a
    llama.cpp server's, the embedded model's among them, by its `/tokenize`; an OpenAI model's, by LiteLLM), else an
    estimate (`ESTIMATE`)."""
    model, base = str(getattr(lm, "model", "")), (getattr(lm, "kwargs", None) or {}).get("api_base")
    if base and _server_json(base, "/tokenize", {"content": "a"}) is not None:
        return functools.partial(_server_tokens, base), f"the model's own tokenizer ({model}'s server)"
    own = (_model_info(model) or {}).get("litellm_provider") in ("openai", "azure")
    return functools.partial(_litellm_tokens, model), f"{model}'s own tokenizer (LiteLLM)" if own else ESTIMATE


def context_window(lm: Any) -> int | None:
    """The most tokens a prompt of `lm` may hold, where it is known: what a llama.cpp server (the embedded model's)
    was started with, else LiteLLM's model map; None where neither knows."""
    base = (getattr(lm, "kwargs", None) or {}).get("api_base")
    props = _server_json(base, "/props") if base else None
    if isinstance(props, dict) and isinstance(n := (props.get("default_generation_settings") or {}).get("n_ctx"), int):
        return n
    info = _model_info(str(getattr(lm, "model", ""))) or {}
    return info.get("max_input_tokens") or info.get("max_tokens")


def _model_info(model: str) -> dict | None:
    """LiteLLM's model map's entry for `model`, or None where it has none (said quietly: LiteLLM prints its list of
    providers for a model it does not know)."""
    import litellm

    quiet, litellm.suppress_debug_info = litellm.suppress_debug_info, True
    try:
        return litellm.get_model_info(model)
    except Exception:  # noqa: BLE001 - a model LiteLLM does not know
        return None
    finally:
        litellm.suppress_debug_info = quiet


def _server_json(base: str, path: str, body: dict | None = None) -> Any:
    """A llama.cpp server's answer at `path` (beside its OpenAI API at `base`), or None where none answers."""
    import json
    import urllib.request

    root = base.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(root + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read())
    except Exception:  # noqa: BLE001 - not a llama.cpp server, or none at all
        return None


def _server_tokens(base: str, text: str) -> int:
    found = _server_json(base, "/tokenize", {"content": text})
    return len(found["tokens"]) if isinstance(found, dict) else _litellm_tokens("", text)


def _litellm_tokens(model: str, text: str) -> int:
    import litellm

    return litellm.token_counter(model=model or "gpt-4o", text=text) if text else 0


class UsageMeter(UsageTracker):
    """A usage tracker that the threads of a stage share: calls, tokens (cached ones apart) and, where the model's price
    is known, dollars. It also counts the calls made outside any predictor (`direct`), which get no library."""

    def __init__(self, prices: dict[str, dict | None] | None = None, custom: dict | None = None):
        super().__init__()
        self._lock, self.prices, self.custom = threading.Lock(), prices if prices is not None else {}, custom

    def __deepcopy__(self, memo) -> UsageMeter:
        return self  # DSPy's parallel executor gives each thread a copy of the tracker, which would lose the counts

    def add_usage(self, lm: str, usage_entry: dict[str, Any]) -> None:
        entry = {k: v.model_dump() if isinstance(v, pydantic.BaseModel) else v for k, v in (usage_entry or {}).items()}
        entry["direct"] = not any(isinstance(m, dspy.Predict) for m in dspy.settings.caller_modules or [])
        with self._lock:
            if lm not in self.prices:
                self.prices[lm] = model_price(lm, self.custom)
            entry["cost"] = call_cost(self.prices[lm], usage_of(entry))
            self.usage_data[lm].append(entry)

    def totals(self) -> dict[str, float]:
        """Calls, tokens, cached tokens and cost so far (cost left out when no call had a known price); safe to read
        while threads still report."""
        with self._lock:
            entries = [e for lm_entries in list(self.usage_data.values()) for e in lm_entries]
        return totals([{"usage": usage_of(e), "cost": e.get("cost")} for e in entries])

    def absorb(self, usage_data: dict[str, list[dict]]) -> None:
        """Take in every call another meter saw (its `usage_data`: a unit's own meter, into its stage's; a Ray task's)."""
        with self._lock:
            for lm, entries in usage_data.items():
                self.usage_data[lm].extend(entries)


def usage_of(usage: dict | None) -> dict[str, int]:
    """A call's usage as DSPy reports it (LiteLLM's, `prompt_tokens_details` a dict or an object), as prompt,
    completion and cached prompt tokens."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else getattr(details, "cached_tokens", 0)
    return {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0), "cached_tokens": int(cached or 0)}


def call_cost(price: dict[str, float] | None, usage: dict[str, int]) -> float | None:
    """USD of one call's `usage` (`usage_of`'s terms) at `price` (`model_price`'s), cached prompt tokens at the cached
    price; None where no price is known."""
    if price is None:
        return None
    cached = usage.get("cached_tokens", 0)
    return ((usage.get("prompt_tokens", 0) - cached) * price["input"] + cached * price["cached_input"]
            + usage.get("completion_tokens", 0) * price["output"])


def totals(entries: list[dict]) -> dict:
    """Calls, prompt, completion and cached tokens of call entries (each with `usage` in `usage_of`'s terms and a
    `cost`), and their cost where any had a known price."""
    total = {"calls": len(entries), "prompt_tokens": sum(e["usage"].get("prompt_tokens", 0) for e in entries),
             "completion_tokens": sum(e["usage"].get("completion_tokens", 0) for e in entries),
             "cached_tokens": sum(e["usage"].get("cached_tokens", 0) for e in entries)}
    costs = [e["cost"] for e in entries if e.get("cost") is not None]
    return {**total, "cost": sum(costs)} if costs else total


@contextlib.contextmanager
def metered(prices: dict | None = None) -> Iterator[UsageMeter]:
    """Meter the LM calls made inside the block, in this thread and in those DSPy starts from it (`meter.totals()`);
    an enclosing `dspy.track_usage()` still receives them."""
    meter, outer = UsageMeter(custom=prices), dspy.settings.usage_tracker
    try:
        with dspy.context(usage_tracker=meter):
            yield meter
    finally:
        if outer is not None:
            for lm, entries in meter.usage_data.items():
                outer.usage_data[lm].extend(entries)



class RequestPacer(BaseCallback):
    """Holds an LM's requests to `per_minute` in any sliding minute, as a provider's requests-per-minute limit counts
    them: a request that would be one too many waits for the oldest one to leave the window instead of drawing a 429
    and a Retry-After wait. Add it to the LM (`dspy.LM(..., callbacks=[RequestPacer(500)])`, or
    `max_requests_per_minute` in a config's LM section); `lm.copy()` shares it, so every copy the optimizer makes is
    paced together, on every thread and every coroutine of the process.

    Each try of a call is paced where DSPy sends it, once its request is built (the first RequestPacer made installs
    the wait there, in `dspy.clients.execution`): a retry after a 429 or a timeout is paced as a request of its own,
    a call DSPy answers from its cache takes no start, and a coroutine (backend="async") waits on the event loop
    without holding it. A start is dated again when its request is sent (LiteLLM's pre-call hook; DSPy's own client's
    transports, where a request may first wait for a free connection), since that can be a second or more after the
    start was taken (LiteLLM's first call sets itself up; a busy event loop). It paces the
    calls of one process: two compiles on one key each need a pacer at their share of the key's limit (two at 250 for
    a limit of 500). A provider's other limits (tokens a minute) are still met by its 429 and DSPy's retries
    (`num_retries`)."""

    window_s = 60.0
    margin_s = 0.25  # a start waits this much past the window: the provider's clock sees the request a little later

    def __init__(self, per_minute: int):
        if not isinstance(per_minute, int) or per_minute < 1:
            raise ValueError(f"RequestPacer needs a whole number of requests a minute, at least 1 (got {per_minute!r})")
        self.per_minute = per_minute
        self._starts: collections.deque[list[float]] = collections.deque()  # each start's time, in a list of its own
        # (LiteLLM's pre-call hook dates it again: `_pace_tries`)
        self._lock = threading.Lock()
        self.waited_s = 0.0  # the time requests spent waiting for a start, all threads together
        _pace_tries()

    def _take(self) -> tuple[float, list[float] | None]:
        """Take a start now: (0, the start); or (how long to wait before trying again, None)."""
        with self._lock:
            now = time.monotonic()
            while self._starts and now - self._starts[0][0] >= self.window_s + self.margin_s:
                self._starts.popleft()
            if len(self._starts) < self.per_minute:
                self._starts.append(taken := [now])
                return 0.0, taken
            wait = self.window_s + self.margin_s - (now - self._starts[0][0])
            self.waited_s += wait
            return wait, None

    def start(self) -> list[float]:
        """Wait (on this thread) until a request may be sent, and take its start."""
        while (taken := self._take())[1] is None:
            time.sleep(taken[0])
        return taken[1]

    async def astart(self) -> list[float]:
        """`start` for a coroutine: the wait leaves the event loop free."""
        while (taken := self._take())[1] is None:
            await asyncio.sleep(taken[0])
        return taken[1]

    def __deepcopy__(self, memo) -> RequestPacer:
        return self  # a deep copy of a program's LM still shares the provider's limit

    def __reduce__(self):
        return RequestPacer, (self.per_minute,)  # the lock cannot travel; a copy in another process paces apart


# the starts the current try took, one per RequestPacer of its LM: LiteLLM's pre-call hook dates them again
TRY_STARTS: contextvars.ContextVar[list[list[float]]] = contextvars.ContextVar("tfgrpo_try_starts", default=[])


def _pace_tries() -> None:
    """Make every try of an LM call (DSPy's `_attempt`, once per retry) first take a start from each RequestPacer
    among its LM's callbacks, dated again where its request is sent (LiteLLM's pre-call hook, or DSPy's own client's
    transports); installed once per process."""
    import litellm  # (here: only a paced run pays for importing LiteLLM before its first call)
    from dspy._vendor.lm15.transports import _async as lm15_async, _sync as lm15_sync
    from dspy.clients import execution
    from litellm.integrations.custom_logger import CustomLogger

    attempt, aattempt = getattr(execution, "_attempt", None), getattr(execution, "_aattempt", None)
    if attempt is None or aattempt is None:
        raise RuntimeError(f"RequestPacer paces each try where DSPy sends it, in dspy.clients.execution, which this "
                           f"DSPy ({dspy.__version__}) does not have: install the DSPy tfgrpo pins (requirements.lock)")
    if getattr(attempt, "paced", False):
        return

    def paced_attempt(lm, *args, **kwargs):
        token = TRY_STARTS.set([pacer.start() for pacer in _pacers_of(lm)])
        try:
            return attempt(lm, *args, **kwargs)
        finally:
            TRY_STARTS.reset(token)

    async def paced_aattempt(lm, *args, **kwargs):
        token = TRY_STARTS.set([await pacer.astart() for pacer in _pacers_of(lm)])
        try:
            return await aattempt(lm, *args, **kwargs)
        finally:
            TRY_STARTS.reset(token)

    class Sent(CustomLogger):
        """LiteLLM's hook right before it sends a request."""

        def log_pre_api_call(self, model, messages, kwargs) -> None:
            _sent()

    def dated_send(transport, *args, **kwargs):
        _sent()
        return send(transport, *args, **kwargs)

    async def dated_asend(transport, *args, **kwargs):
        _sent()
        return await asend(transport, *args, **kwargs)

    paced_attempt.paced = paced_aattempt.paced = True
    execution._attempt, execution._aattempt = paced_attempt, paced_aattempt
    litellm.input_callback.append(Sent())
    # DSPy's own client writes each request in its transports' `_send_request`, after waiting for a free connection
    # (on a busy event loop, seconds after the start was taken)
    send, asend = lm15_sync.StdlibTransport._send_request, lm15_async.StdlibAsyncTransport._send_request
    lm15_sync.StdlibTransport._send_request, lm15_async.StdlibAsyncTransport._send_request = dated_send, dated_asend


def _sent() -> None:
    """The current try's request leaves now: its starts are dated now, when that is later (a start stays in its
    pacer's window until a minute after its request left)."""
    now = time.monotonic()
    for taken in TRY_STARTS.get():
        taken[0] = max(taken[0], now)


def _pacers_of(lm: Any) -> list[RequestPacer]:
    return [c for c in getattr(lm, "callbacks", None) or [] if isinstance(c, RequestPacer)]


def paced(lm) -> bool:
    """Whether `lm` carries a RequestPacer."""
    return bool(_pacers_of(lm))
