"""`tfgrpo compile CONFIG --dry-run`: compile's own checks of the config, then upper bounds of the calls and tokens
the run will spend; nothing is started, called or written."""

from __future__ import annotations

import dspy
from rich.console import Console
from rich.table import Table

from tfgrpo.config import Config, LMConfig
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.estimate import attribution_runs, check_run, estimate_run


def unstarted_lm(cfg: LMConfig) -> dspy.LM:
    """A `dspy.LM` of the model a run of this section calls, for the checks, which read only its name: nothing is
    started for it, and it is never called."""
    if cfg.backend == "local":
        return local_dspy_lm(cfg.model, "http://127.0.0.1:1/v1", max_tokens=cfg.max_tokens)  # named as a run names it
    return dspy.LM(cfg.model)


def dry_run(cfg: Config, parts, data: tuple[list, list | None, list | None], knobs: dict, console: Console) -> None:
    """Refuse what compile would refuse (the same error), else print the estimate (`optimizers/estimate.py`) and
    what the budgets cap. `data`: the trainset, valset and attribution set (None where the config names none)."""
    t, (trainset, valset, held_out) = cfg.task, data
    turns = t.max_iters + 1 if t.program == "react" or t.name == "web" else 1
    reflection = unstarted_lm(cfg.reflection_config())
    optimizer = TrainingFreeGRPO(parts.reward, reflection_lm=reflection, **knobs)
    with dspy.context(lm=unstarted_lm(cfg.policy)):
        check_run(optimizer, parts.make(), trainset, valset, held_out)
    path = optimizer.resolve_learning_path(reflection.model)
    knobs = optimizer.resolved(reflection.model)  # with the `auto` preset's values
    est = estimate_run(knobs, parts.make(), trainset, turns_per_rollout=turns, max_tokens=cfg.policy.max_tokens,
                       learning_path=path)
    table = Table(title=f"dry run: {est['steps']} step(s), {path} learning path, upper bounds (no call is made)")
    for col in ("stage", "calls/step", "prompt tokens/step", "completion tokens/step"):
        table.add_column(col)
    for stage, s in est["per_step_upper_bound"].items():
        table.add_row(stage, str(s["calls"]), f"{s['prompt_tokens']:,}", f"{s['completion_tokens']:,}")
    total = est["total_upper_bound"]
    table.add_row("[bold]run total", f"{total['calls']:,}", f"{total['prompt_tokens']:,}",
                  f"{total['completion_tokens']:,}")
    console.print(table)
    held = held_out if held_out is not None else valset
    if (worth := attribution_runs(knobs, len(trainset), len(held or []))).get("runs"):
        console.print(f"attribution ({worth['method']}, up to {worth['items']} items): at most {worth['runs']:,} program "
                      f"runs of {turns} call(s) on {len(held)} held-out queries, after the compile")
    _print_budgets(knobs, est, console)


def _print_budgets(o, est: dict, console: Console) -> None:
    """What the budgets (of the knobs `o`, presets applied) cap of the estimate."""
    total = est["total_upper_bound"]
    if o.max_total_tokens is not None:
        step = sum(s["prompt_tokens"] + s["completion_tokens"] for s in est["per_step_upper_bound"].values())
        run = total["prompt_tokens"] + total["completion_tokens"]
        said = f"max_total_tokens = {o.max_total_tokens:,}: the run stops after the step that reaches it"
        console.print(f"{said}, so it uses at most {o.max_total_tokens + step:,} tokens (the budget plus one step of "
                      f"at most {step:,}) of the {run:,} above" if o.max_total_tokens + step < run else
                      f"{said}; at these bounds the whole run ({run:,} tokens) fits in the budget plus one step")
    if o.max_metric_calls is not None:
        console.print(f"max_metric_calls = {o.max_metric_calls:,}: the run stops after the step (or validation) that "
                      "reaches it")
    if o.max_cost is not None:
        console.print(f"max_cost = ${o.max_cost:g}: the run stops after the step that reaches it (no price is "
                      "estimated here)")
