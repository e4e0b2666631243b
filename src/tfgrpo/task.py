"""The configured task as the parts the CLI needs: program factory, loader, metrics, training reward."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tfgrpo.config import Config

ONLINE_KEYS = {"serper": "SERPER_API_KEY", "tavily": "TAVILY_API_KEY", "brave": "BRAVE_API_KEY"}


@dataclass
class TaskParts:
    make: Callable  # () -> a fresh, uncompiled program
    load: Callable  # (name, limit=, offset=) -> examples
    metric: Callable  # evaluation: the score every comparison is made on
    reward: Callable  # learning
    extra_metrics: dict[str, Callable] = field(default_factory=dict)  # evaluation: reported next to the metric
    judge: object | None = None  # the web task's LLMJudge (its verdict count goes into the summary)


def task_parts(config: Config, stack: contextlib.ExitStack, *, policy=None, judge_lm=None) -> TaskParts:
    """The parts of `config.task`; anything they need running (the offline web site) is closed by `stack`."""
    t = config.task
    if t.name == "custom":
        return _custom_parts(t)
    if t.name == "game24":
        from tfgrpo.tasks.game24 import Game24Solver, game24_metric, game24_reward, load_game24

        reward = game24_reward if t.train_reward == "partial" else game24_metric
        return TaskParts(Game24Solver, load_game24, game24_metric, reward)
    if t.name == "web":
        return _web_parts(config, stack, policy, judge_lm)
    from tfgrpo.tasks.math.datasets import load_math
    from tfgrpo.tasks.math.metric import math_metric
    from tfgrpo.tasks.math.programs import make_program

    return TaskParts(lambda: make_program(t.program, max_iters=t.max_iters), load_math, math_metric, math_metric)


def _web_parts(config: Config, stack: contextlib.ExitStack, policy, judge_lm) -> TaskParts:
    from tfgrpo.tasks.web import (LLMJudge, PageFetcher, StepAgent, WebTools, em_metric, f1_metric, judge_metric,
                                  load_web, react_agent)
    from tfgrpo.tasks.web.search import make_backend
    from tfgrpo.tasks.web.site import running_site

    w = config.web
    allowed = ()
    if w.search == "local":
        base_url = w.site_url or stack.enter_context(running_site(w.corpus))
        backend, allowed = make_backend("local", base_url=base_url), (base_url,)
    else:
        backend = make_backend(w.search, api_key_env=w.api_key_env or ONLINE_KEYS[w.search])
    tools = WebTools(backend, fetcher=PageFetcher(allowed_origins=allowed), top_k=w.top_k, snippet_chars=w.snippet_chars,
                     page_chars=w.page_chars, page_lm=policy if w.page_passages else None)
    judge = LLMJudge(judge_lm, constrained=config.judge_config().constrained_mode,
                     cache_path=Path(config.run_dir) / "judge_cache.jsonl")
    metrics = {"judge": judge_metric(judge), "f1": f1_metric, "em": em_metric}
    reward = metrics[w.reward]
    iters, step_mode = config.task.max_iters, config.policy.constrained_mode

    def make():
        if w.agent == "react":
            return react_agent(tools, max_iters=iters)
        return StepAgent(tools, max_iters=iters, constrained=step_mode)

    return TaskParts(make, load_web, reward, reward, {k: m for k, m in metrics.items() if k != w.reward}, judge)


def _custom_parts(t) -> TaskParts:
    """The user's own program, metric and data (tfgrpo.user_task)."""
    from tfgrpo.user_task import load_examples, metric_function, program_factory

    make, metric = program_factory(t.program), metric_function(t.metric)
    reward = metric_function(t.train_metric, "train_metric") if t.train_metric else metric

    def load(path, limit=None, offset=0):
        return load_examples(path, input_keys=t.input_keys, limit=limit, offset=offset)

    return TaskParts(make, load, metric, reward)
