"""Edits that earn their place: a paired probe on other training queries before an edit is kept.

A group's winning attempt is not yet a good lesson: on the Game of 24 a program that only sums wins on 3 7 7 7,
and a small policy model copies it faithfully everywhere. So with `probe_size > 0`, each step's candidate edits
(every library operation of the plan, each candidate demo) are tried before they are kept, the way GEPA keeps a
candidate only when it scores better on the minibatch that produced it: the program as it is and the program with
one candidate edit each make one attempt on the same `probe_size` training queries outside the step's batch (never
a held-out one), at the learning temperature.

A probe ranks programs by their full successes (reward 1) first and their mean reward second. Partial credit alone
misleads it: measured on the Game of 24, demos chosen by mean partial reward taught the 1.5B to print any expression
of the four numbers (partial credit 0.3 each time), and it then solved 0 of 48 held-out puzzles (baseline 2). A
library operation is kept when it ranks no lower than the current program; a demo only when it adds full
successes (a demo that ties adds prompt tokens and teaches nothing known), and the demos kept are the set the best
such candidate was probed with (`keep_tied_demos` also keeps a demo that ties a program which already solves some
of the probe: a probe of a few queries on a task the model half solves is at its ceiling). An experience that
carries an excerpt (`max_excerpt_lines`) is code the policy will copy, as it copies a demo, so it too must add full
successes, and only the best such experience of a step is kept (two programs in the prompt teach the policy to mix
them); of two edits of the same experience (a rewrite, a retirement) only the better is kept. A probe slot left
over goes to one current experience in turn: it is retired when the program ranks no lower without it, so an
experience stays only while it earns its place.
"""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import dataclass

import dspy

from tfgrpo.base.util import digest
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.optimizers.rollout import run_program
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One edit to probe: library operations, or a demo (a winning attempt's trace)."""

    label: str  # how logs and the step record name it
    operations: tuple[Operation, ...] = ()
    demo: dict | None = None

    @property
    def shows_code(self) -> bool:
        """A demo, or an operation that adds or rewrites an experience with an excerpt: something the policy will
        copy, so it is held to a demo's standard."""
        return self.demo is not None or any(getattr(op, "excerpt", "") and op.action in ("add", "modify")
                                            for op in self.operations)

    @property
    def targets(self) -> set[str]:
        """The current experiences this edit rewrites, merges or retires."""
        return {i for op in self.operations if op.action != "add" for i in op.ids}


@dataclass
class ProbeResult:
    """What the probe saw: the queries, and for the current program (`base`) and each candidate the full successes
    and the mean reward over the queries it ran (`ran`: fewer than all when it was stopped early)."""

    queries: list[int]
    base: tuple[int, float]
    scores: list[tuple[int, float]]
    kept: list[bool]
    ran: list[int]

    def to_dict(self, candidates: list[Candidate]) -> dict:
        return {"queries": self.queries, "base_successes": self.base[0], "base_mean": self.base[1],
                "attempts_run": len(self.queries) + sum(self.ran),  # the current program's, then the candidates'
                "attempts_saved": sum(len(self.queries) - n for n in self.ran),
                "candidates": [{"edit": c.label, "successes": s, "mean": m, "queries_run": n, "kept": k}
                               for c, (s, m), k, n in zip(candidates, self.scores, self.kept, self.ran)]}


def keeps(candidate: Candidate, score: tuple[int, float], base: tuple[int, float], *, keep_ties: bool = False) -> bool:
    """A demo, or an experience that carries code (an excerpt), must add full successes; any other operation must
    rank no lower (successes, then mean reward). With `keep_ties`, a demo that ranks no lower is kept as well when
    the current program already solves at least one probe query."""
    if candidate.demo is not None and keep_ties and base[0] >= 1 and score >= base:
        return True
    return score[0] > base[0] if candidate.shows_code else score >= base


def probe_queries(trainset_size: int, batch: list[int], size: int, *, seed: int, step: int) -> list[int]:
    """`size` training queries outside the step's batch (all of the trainset when the batch covers it), drawn
    the same way on a resume."""
    pool = [i for i in range(trainset_size) if i not in set(batch)] or list(range(trainset_size))
    return sorted(random.Random(int(digest([seed, step, "probe"]), 16)).sample(pool, min(size, len(pool))))


def run_probe(programs: list[dspy.Module], candidates: list[Candidate], *, queries: list[int], trainset: list,
              metric, unit_of, cached, run_units, keep_ties: bool = False, stop_early: bool = True) -> ProbeResult:
    """Full successes and mean reward of `programs[0]` (the current program) and of `programs[1 + c]` (with candidate
    c) over `queries`, and which candidates are kept.

    `unit_of(p, qi)` names a checkpoint unit, `cached(unit)` reads one, `run_units(fn, jobs)` runs the attempts on
    the step's threads (with its meter and progress) and stores them. With `stop_early`, a candidate whose verdict
    is known runs no more queries (same verdicts, fewer attempts)."""

    def attempt(job):
        p, qi = job
        _, rec = run_program(programs[p], trainset[qi])  # a failed attempt scores 0, as in the rollouts
        return {"reward": score_attempt(metric, trainset[qi], rec)["reward"], "error": rec["error"]}

    found: dict[tuple[int, int], dict] = {}

    def run(jobs):
        hits = {job: cached(unit_of(*job)) for job in jobs}
        found.update({job: rec for job, rec in hits.items() if rec is not None})
        todo = [job for job in jobs if hits[job] is None]
        found.update(zip(todo, run_units(attempt, todo)))

    n = len(queries)

    def rewards(p: int) -> list[float]:  # program p's rewards on the queries it has run
        return [found[(p, qi)]["reward"] for qi in queries if (p, qi) in found]

    def score(p: int) -> tuple[int, float]:  # full successes, mean reward over the queries it has run
        rs = rewards(p)
        return sum(r >= 1 for r in rs), statistics.fmean(rs or [0.0])

    run([(0, qi) for qi in queries])  # the bar every candidate must clear
    base = score(0)
    alive = list(range(len(candidates)))
    rounds = [[qi] for qi in queries] if stop_early else [queries]
    for done, block in enumerate(rounds, start=1):
        run([(1 + c, qi) for c in alive for qi in block])
        left = n - sum(map(len, rounds[:done]))
        bounds = {c: (sum(r >= 1 for r in rs), sum(rs)) for c in alive for rs in [rewards(1 + c)]}
        # every query left solved, or none; widened by a rounding error's width, so a tie is never cut short
        best_case = {c: (s + left, (t + left) / n + 1e-9) for c, (s, t) in bounds.items()}
        worst_case = {c: (s, t / n - 1e-9) for c, (s, t) in bounds.items()}

        def possible(c) -> bool:
            if not keeps(candidates[c], best_case[c], base, keep_ties=keep_ties):
                return False
            return candidates[c].demo is None or not any(  # one demo is kept: the best; can c still be it?
                d != c and candidates[d].demo is not None and keeps(candidates[d], worst_case[d], base,
                                                                    keep_ties=keep_ties)
                and (worst_case[d], d) > (best_case[c], c) for d in alive)

        alive = [c for c in alive if possible(c)]
    ran = [len(rewards(1 + c)) for c in range(len(candidates))]
    scores = [score(1 + c) for c in range(len(candidates))]
    passed = [c in alive and keeps(cand, score, base, keep_ties=keep_ties)
              for c, (cand, score) in enumerate(zip(candidates, scores))]

    def best_of(kind, kept) -> int | None:  # the candidate of a kind still kept that ranks highest
        wins = [(score, i) for i, (c, score, k) in enumerate(zip(candidates, scores, kept)) if k and kind(c)]
        return max(wins)[1] if wins else None

    # code competes: one demo (the step keeps the set it was probed with) and one experience with an excerpt; and
    # one edit per current experience (a rewrite and a retirement of it cannot both be kept)
    kinds = [lambda c: c.demo is not None, lambda c: c.demo is None and c.shows_code]
    kinds += [lambda c, t=t: t in c.targets for t in sorted({t for c in candidates for t in c.targets})]
    kept = list(passed)
    for kind in kinds:
        best = best_of(kind, kept)
        kept = [k and (not kind(c) or i == best) for i, (c, k) in enumerate(zip(candidates, kept))]
    result = ProbeResult(queries=queries, base=base, scores=scores, kept=kept, ran=ran)
    for c, (s, m), k, r in zip(candidates, result.scores, result.kept, result.ran):
        logger.info("Probe: %s: %d solved of %d run, mean %.3f vs %d, %.3f now -> %s", c.label, s, r, m, *result.base,
                    "kept" if k else "dropped")
    return result
