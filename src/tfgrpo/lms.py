"""Turn `[policy]` / `[reflection]` config sections into `dspy.LM`s, starting the embedded server if needed."""

from __future__ import annotations

import contextlib
import logging
import os

import dspy

from tfgrpo.config import Config, LMConfig
from tfgrpo.local_model import ensure_server
from tfgrpo.optimizers.spend import RequestPacer

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def open_lms(config: Config):
    """Yield `(policy_lm, reflection_lm, judge_lm)`; local servers started here are stopped on exit, errors and
    Ctrl-C. Without a [reflection] section the policy LM reflects; without a [judge] section the reflection LM
    judges (the web task's reward)."""
    with contextlib.ExitStack() as stack:
        started: dict[tuple, str] = {}  # one server per local model, shared by policy, reflection and judge
        built: dict[int, dspy.LM] = {}  # a section that falls back to another gets that one's LM itself

        def lm(cfg: LMConfig) -> dspy.LM:
            if id(cfg) not in built:
                built[id(cfg)] = _build(cfg, stack, started)
            return built[id(cfg)]

        yield lm(config.policy), lm(config.reflection_config()), lm(config.judge_config())


@contextlib.contextmanager
def serving(model: str, api_base: str | None = None, **server_kw):
    """The API base to send `model`'s calls to: `api_base` when given (any OpenAI-compatible endpoint), else the
    embedded server of `model` (a `tfgrpo lm start` one is reused; one started here, with `server_kw`, is stopped
    on exit)."""
    if api_base:
        yield api_base
        return
    api_base, server = ensure_server(model, **server_kw)
    try:
        yield api_base
    finally:
        if server is not None:
            server.stop()


def local_dspy_lm(model: str, api_base: str, *, max_tokens: int, **kwargs) -> dspy.LM:
    """A `dspy.LM` for the embedded llama.cpp server.

    DSPy's OpenAI dialect sends the reply limit as `max_completion_tokens`, which some llama.cpp servers ignore:
    a reply then runs until the context is full (minutes on this CPU, while every other request waits). The
    limit is sent as `max_tokens` too, which every server honours."""
    return dspy.LM(f"openai/{model}", api_base=api_base, api_key="local", max_tokens=max_tokens,
                   extra_body={"max_tokens": max_tokens}, **kwargs)


def _build(cfg: LMConfig, stack: contextlib.ExitStack, started: dict) -> dspy.LM:
    common = dict(temperature=cfg.temperature, max_tokens=cfg.max_tokens, num_retries=cfg.num_retries,
                  timeout=cfg.timeout_s, cache=cfg.cache, **cfg.extra)
    if cfg.max_requests_per_minute:
        common["callbacks"] = [RequestPacer(cfg.max_requests_per_minute)]
    if cfg.backend == "local":
        key = (cfg.model, cfg.n_ctx, cfg.n_threads, cfg.speculative, cfg.parallel)
        if key not in started:
            logger.info("Starting the embedded model %s (first run assembles the weights)", cfg.model)
            api_base, server = ensure_server(cfg.model, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads, speculative=cfg.speculative,
                                             parallel=cfg.parallel)
            if server is not None:
                stack.callback(server.stop)
            started[key] = api_base
        return local_dspy_lm(cfg.model, started[key], **common)
    if cfg.api_base:
        common["api_base"] = cfg.api_base
    if cfg.api_key_env:
        common["api_key"] = os.environ[cfg.api_key_env]  # read at run time, never written anywhere
    elif cfg.api_base:
        common["api_key"] = "none"  # self-hosted endpoints (vLLM, Ollama) need no key, but clients want one
    return dspy.LM(cfg.model, **common)
