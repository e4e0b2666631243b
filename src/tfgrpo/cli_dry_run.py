"""`tfgrpo compile CONFIG --dry-run`: the optimizer's plan for the config (`TrainingFreeGRPO.plan`): compile's own
checks (a refusal is compile's, with the same error), the preset, the budget, and the calls, tokens and dollars the run
is expected to spend, with upper bounds; nothing is started, called or written, unless `--pilot N` asks for the program
to run on N training queries first (the config's LMs started and called for them) to size the plan."""

from __future__ import annotations

from pathlib import Path

import dspy
from rich.console import Console
from rich.table import Table

from tfgrpo.config import Config, LMConfig
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.plan import attribution_runs


def unstarted_lm(cfg: LMConfig) -> dspy.LM:
    """A `dspy.LM` of the model a run of this section calls, for the checks, which read only its name: nothing is
    started for it, and it is never called."""
    if cfg.backend == "local":
        return local_dspy_lm(cfg.model, "http://127.0.0.1:1/v1", max_tokens=cfg.max_tokens)  # named as a run names it
    return dspy.LM(cfg.model, max_tokens=cfg.max_tokens, **cfg.extra)


def dry_run(cfg: Config, parts, data: tuple[list, list | None, list | None], knobs: dict, console: Console, *,
            lms: tuple[dspy.LM, dspy.LM] | None = None, pilot: int = 0) -> None:
    """Refuse what compile would refuse (the same error), else print the plan. `data`: the trainset, valset and
    attribution set (None where the config names none). `pilot`: the plan's pilot queries, sent to `lms` (the
    policy and reflection LMs, started); without it no LM is started or called."""
    trainset, valset, held_out = data
    policy, reflection = lms or (unstarted_lm(cfg.policy), unstarted_lm(cfg.reflection_config()))
    optimizer = TrainingFreeGRPO(parts.reward, reflection_lm=reflection,
                                 log_dir=str(Path(cfg.run_dir) / "checkpoint"), **knobs)
    with dspy.context(lm=policy):
        plan = optimizer.plan(parts.make(), trainset, valset, attribution_set=held_out, pilot=pilot)
    table = Table(title=f"dry run: {plan.steps} step(s), {plan.learning_path} learning path, preset {plan.preset!r} "
                        + (f"(sized by {pilot} pilot queries)" if pilot else "(no LM call is made)"))
    for col in ("stage", "calls/step", "prompt tokens/step", "completion tokens/step", "$/step", "calls/step at most"):
        table.add_column(col)
    for stage, s in plan.expected["per_step"].items():
        cost = f"{s['cost']:.4f}" if s.get("cost") is not None else "n/a"
        table.add_row(stage, f"{s['calls']:,}", f"{s['prompt_tokens']:,}", f"{s['completion_tokens']:,}", cost,
                      f"{plan.bound['per_step'][stage]['calls']:,}")
    total = plan.expected["total"]
    cost = f"{total['cost']:.4f}" if total.get("cost") is not None else "n/a"
    table.add_row("[bold]run total", f"{total['calls']:,}", f"{total['prompt_tokens']:,}",
                  f"{total['completion_tokens']:,}", cost, f"{plan.bound['total']['calls']:,}")
    console.print(table)
    console.print(plan.summary(), markup=False, highlight=False, soft_wrap=True)  # (whole lines: a terminal wraps them)
    for line in warnings(cfg, plan.knobs.batch_size, len(trainset)):
        console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    bound = plan.bound["total"]
    console.print(f"at most: {bound['calls']:,} calls, {bound['prompt_tokens']:,} prompt + "
                  f"{bound['completion_tokens']:,} completion tokens (every call sent twice, replies at max_tokens)",
                  soft_wrap=True)
    for knob, value in plan.budget.items():
        if value is not None:
            shown = f"${value:g}" if knob == "max_cost" else f"{value:,}"
            console.print(f"{knob} = {shown}: charged before each unit of work, the run stops where the next one would "
                          "not fit (a resume with a larger budget goes on)", soft_wrap=True)
    held = held_out if held_out is not None else valset
    if (worth := attribution_runs(plan.knobs, len(trainset), len(held or []))).get("runs"):
        console.print(f"attribution ({worth['method']}, up to {worth['items']} items): at most {worth['runs']:,} program "
                      f"runs of {plan.turns} call(s) on {len(held)} held-out queries, after the compile",
                      soft_wrap=True)


def warnings(cfg: Config, batch_size: int, train_size: int) -> list[str]:
    """What the plan's numbers leave unsaid and a run would meet: a batch larger than the trainset (each step then
    takes every example), and the API keys the dry run went without."""
    lines = []
    if batch_size > train_size:
        lines.append(f"warning: batch_size {batch_size} is larger than the trainset ({train_size} examples): each step "
                     f"uses all {train_size} examples")
    lines += [f"note: {variable} ({key}) is not set in the environment: the dry run needs no key, a run does"
              for key, variable in cfg.unset_keys().items()]
    return lines
