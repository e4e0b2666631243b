"""Winning attempts kept as demonstrations: an extension of the paper, off unless `max_demos > 0`.

A small policy model copies what it sees in its prompt, and a small reflection model cannot yet put a
working procedure into words (see benchmarks/rule_ceiling.py). The group rollouts already hold the
procedure whenever one attempt succeeded where its groupmates failed. Such an attempt is a candidate
demonstration; its group advantage (reward minus the group's mean reward) ranks it, as the group-relative
signal ranks everything else in this optimizer. The best `max_demos` of the run so far, at most one per
training query, fill the target predictors' few-shot slots (`predictor.demos`, what DSPy's
BootstrapFewShot fills), so the next step's rollouts and the compiled program see them, and they save and
load as plain DSPy state. Only full successes (reward >= 1) qualify: a half-right program taught by example
teaches its mistakes too.
"""

from __future__ import annotations

import dspy

from tfgrpo.optimizers.attempts import Group
from tfgrpo.programs.inject import apply_library


def demo_candidates(groups: list[Group], step: int, *, min_reward: float = 1.0) -> list[dict]:
    """Per informative group: its best attempt, if its reward reaches `min_reward` (1: it fully succeeded; a probe
    judges candidates by what they do elsewhere, so it takes any that scored), with its group advantage."""
    found = []
    for group in groups:
        best = max(range(len(group.attempts)), key=lambda g: (group.rewards[g], -g))
        attempt = group.attempts[best]
        if attempt.reward >= min_reward and attempt.reward > 0 and not attempt.error and attempt.trace:
            found.append({"query": group.key, "step": step, "reward": attempt.reward,
                          "advantage": attempt.reward - group.mean_reward, "trace": attempt.trace})
    return found


def keep_best(demos: list[dict], n: int) -> list[dict]:
    """The `n` probed demos with the highest gain on the probe (the earlier step first on ties), one per query."""
    return _best_per_query(demos, n, "gain")


def select_demos(pool: list[dict], new: list[dict], max_demos: int) -> list[dict]:
    """The `max_demos` best of the pool and the new candidates: highest advantage first, then the earlier
    step; one per query."""
    return _best_per_query(pool + new, max_demos, "advantage")


def _best_per_query(demos: list[dict], n: int, score: str) -> list[dict]:
    """The `n` demos with the highest `score` (the earlier step first on ties), one per query."""
    best_per_query: dict[str, dict] = {}
    for demo in sorted(demos, key=lambda d: (-d.get(score, 0.0), d["step"], d["query"])):
        best_per_query.setdefault(demo["query"], demo)
    return list(best_per_query.values())[: max(n, 0)]


def apply_demos(program: dspy.Module, demos: list[dict], targets: list[str]) -> dspy.Module:
    """Put each demo's predictor calls into the matching target predictors' `demos` (in place; returns
    `program`). Without demos the program's own demos are left as they are."""
    if not demos:
        return program
    for name, predictor in program.named_predictors():
        if name in targets:
            predictor.demos = [dspy.Example(**call["inputs"], **call["outputs"])
                               for demo in demos for call in demo["trace"] if call["predictor"] == name]
    return program


def with_learned(program: dspy.Module, targets: list[str], library, demos: list[dict]) -> dspy.Module:
    """A copy of `program` carrying what was learned: the library in the targets' instructions, and the demos."""
    return apply_demos(apply_library(program.deepcopy(), library, targets), demos, targets)
