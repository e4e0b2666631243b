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

from tfgrpo.optimizers.attempts import Group


def demo_candidates(groups: list[Group], step: int, *, min_reward: float = 1.0,
                    explore_from: int | None = None) -> list[dict]:
    """Per informative group: its best attempt, if its reward reaches `min_reward` (1: it fully succeeded; a probe
    judges candidates by what they do elsewhere, so it takes any that scored), with its group advantage.

    `explore_from`: attempts from this index on ran without the demos (`num_explore_generations`). Then what the
    current program does on every one of its attempts alike is no candidate (a small model's copy of its demo: the
    demo it already has); the best of the other attempts is."""
    found = []
    for group in groups:
        order = range(len(group.attempts))
        own = group.rewards[:explore_from] if explore_from is not None else []
        if explore_from is not None and explore_from < len(group.attempts) and len(set(own)) == 1:
            order = range(explore_from, len(group.attempts))  # the current program's uniform attempts teach nothing new
        best = max(order, key=lambda g: (group.rewards[g], -g))
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
