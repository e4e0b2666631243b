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
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import dspy

from tfgrpo.base.util import digest
from tfgrpo.optimizers.attempts import solved_by
from tfgrpo.optimizers.checkpoint import Keys
from tfgrpo.optimizers.demos import demo_candidates, keep_best
from tfgrpo.optimizers.parallel import run_parallel
from tfgrpo.optimizers.render import query_key
from tfgrpo.optimizers.rollout import run_and_score, with_own_lms
from tfgrpo.programs.inject import with_learned
from tfgrpo.signatures.operations import Operation

if TYPE_CHECKING:
    from tfgrpo.optimizers.step import Learning, RunSetup, StepStart

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
    and the mean reward over the queries it ran (`ran`: fewer than all when it was stopped early); `solved`: the
    queries each program solved and `tried` those it ran (the current program first); `traces`: per program, the
    traces of its attempts that solved their query, by query."""

    queries: list[int]
    base: tuple[int, float]
    scores: list[tuple[int, float]]
    kept: list[bool]
    ran: list[int]
    solved: list[list[int]]
    tried: list[list[int]]
    traces: list[dict[int, list]]

    def to_dict(self, candidates: list[Candidate]) -> dict:
        return {"queries": self.queries, "base_successes": self.base[0], "base_mean": self.base[1],
                "base_solved": self.solved[0],
                "attempts_run": len(self.queries) + sum(self.ran),  # the current program's, then the candidates'
                "attempts_saved": sum(len(self.queries) - n for n in self.ran),
                "candidates": [{"edit": c.label, "successes": s, "mean": m, "queries_run": n, "kept": k,
                                "solved": solved}
                               for c, (s, m), k, n, solved in zip(candidates, self.scores, self.kept, self.ran,
                                                                  self.solved[1:])]}


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided sign test: the chance of `wins` or more wins in `wins + losses` fair coin tosses (1.0 for none)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def keeps(candidate: Candidate, score: tuple[int, float], base: tuple[int, float], paired: tuple[int, int] = (0, 0), *,
          keep_ties: bool = False, alpha: float = 1.0) -> bool:
    """A demo, or an experience that carries code (an excerpt), must win more probe queries than it loses (`paired`:
    its wins, solved by it and not by the current program, and its losses, the reverse) by a one-sided sign test at
    level `alpha`;
    any other operation must rank no lower (successes, then mean reward). With `keep_ties`, a demo that ranks no
    lower is kept as well when the current program already solves at least one probe query."""
    if candidate.demo is not None and keep_ties and base[0] >= 1 and score >= base:
        return True
    if candidate.shows_code:
        wins, losses = paired
        return wins > losses and sign_test_p(wins, losses) <= alpha
    return score >= base


def probe_queries(trainset_size: int, batch: list[int], size: int, *, seed: int, step: int,
                  unsolved: set[int] = frozenset()) -> list[int]:
    """`size` training queries outside the step's batch (all of the trainset when the batch covers it), drawn
    the same way on a resume. With `unsolved` (queries the current program is known to fail: `focus_on_failures`),
    up to half of them are such failures, where an edit can show a gain; the rest are drawn from the others."""
    pool = [i for i in range(trainset_size) if i not in set(batch)] or list(range(trainset_size))
    rng = random.Random(int(digest([seed, step, "probe"]), 16))
    failing = [i for i in pool if i in unsolved]
    chosen = rng.sample(failing, min(len(failing), (size + 1) // 2)) if failing else []
    others = [i for i in pool if i not in set(chosen)]
    return sorted(chosen + rng.sample(others, min(size - len(chosen), len(others))))


@dataclass(frozen=True)
class ProbeRules:
    """How a probe judges: `alpha`, the sign test's level for a candidate that shows code; `keep_ties`, a demo that
    ties a program already solving some probe query is kept too; `timeout_s`, the metric's (`metric_timeout_s`)."""

    alpha: float = 1.0
    keep_ties: bool = False
    timeout_s: float | None = None


class Probe:
    """Full successes and mean reward of `programs[0]` (the current program) and of `programs[1 + c]` (with candidate
    c) over `queries`, and which candidates are kept (`run`).

    `unit_of(p, qi)` names a checkpoint unit, `cached(unit)` reads one, `run_units(fn, jobs)` runs the attempts on the
    step's threads (with its meter and progress) and stores them. The candidates run query by query, and a candidate
    whose verdict is known runs no more queries (the verdicts of the full probe, with fewer attempts)."""

    def __init__(self, programs: list[dspy.Module], candidates: list[Candidate], *, queries: list[int], trainset: list,
                 metric, unit_of, cached, run_units, rules: ProbeRules = ProbeRules()):
        self.programs, self.candidates, self.queries, self.trainset = programs, candidates, queries, trainset
        self.metric, self.unit_of, self.cached, self.run_units, self.rules = metric, unit_of, cached, run_units, rules
        self.found: dict[tuple[int, int], dict] = {}  # (program, query) -> its attempt's reward, error, trace
        self.base: tuple[int, float] = (0, 0.0)

    def run(self) -> ProbeResult:
        self._run([(0, qi) for qi in self.queries])  # the bar every candidate must clear
        self.base = self.score(0)
        alive = list(range(len(self.candidates)))
        for qi in self.queries:
            self._run([(1 + c, qi) for c in alive])
            alive = [c for c in alive if self._possible(c, alive)]
        return self._result(alive)

    # -- the attempts ------------------------------------------------------------------------------------------
    def _attempt(self, job: tuple[int, int]) -> dict:
        p, qi = job
        rec = run_and_score(self.programs[p], self.trainset[qi], self.metric, self.rules.timeout_s)  # a failed one: 0
        return {"reward": rec["reward"], "error": rec["error"], "trace": rec["trace"] if rec["reward"] >= 1 else []}

    def _run(self, jobs: list[tuple[int, int]]) -> None:
        hits = {job: self.cached(self.unit_of(*job)) for job in jobs}
        self.found.update({job: rec for job, rec in hits.items() if rec is not None})
        todo = [job for job in jobs if hits[job] is None]
        self.found.update(zip(todo, self.run_units(self._attempt, todo)))

    # -- what they show ------------------------------------------------------------------------------------------
    def solved(self, p: int, qi: int) -> bool:
        return self.found[(p, qi)]["reward"] >= 1

    def rewards(self, p: int) -> list[float]:
        """Program p's rewards on the queries it has run."""
        return [self.found[(p, qi)]["reward"] for qi in self.queries if (p, qi) in self.found]

    def score(self, p: int) -> tuple[int, float]:
        """Full successes and mean reward over the queries program p has run."""
        rs = self.rewards(p)
        return sum(r >= 1 for r in rs), statistics.fmean(rs or [0.0])

    def paired(self, c: int) -> tuple[int, int, int, int]:
        """Candidate c's wins and losses against the current program so far, and the wins and losses still possible."""
        ran = [qi for qi in self.queries if (1 + c, qi) in self.found]
        left = [qi for qi in self.queries if (1 + c, qi) not in self.found]
        wins = sum(self.solved(1 + c, qi) and not self.solved(0, qi) for qi in ran)
        losses = sum(self.solved(0, qi) and not self.solved(1 + c, qi) for qi in ran)
        return wins, losses, sum(not self.solved(0, qi) for qi in left), sum(self.solved(0, qi) for qi in left)

    def _keeps(self, c: int, point: tuple[int, float], wins: int, losses: int) -> bool:
        return keeps(self.candidates[c], point, self.base, (wins, losses), keep_ties=self.rules.keep_ties,
                     alpha=self.rules.alpha)

    def _bound(self, c: int, case: str) -> tuple[bool, tuple[int, float]]:
        """Whether c is kept, and its (successes, mean), if every query left goes its way ("best") or against it
        ("worst"); widened by a rounding error's width, so a tie is never cut short."""
        wins, losses, can_win, can_lose = self.paired(c)
        rs, n, left = self.rewards(1 + c), len(self.queries), can_win + can_lose
        if case == "best":
            point, wins = (sum(r >= 1 for r in rs) + left, (sum(rs) + left) / n + 1e-9), wins + can_win
        else:
            point, losses = (sum(r >= 1 for r in rs), sum(rs) / n - 1e-9), losses + can_lose
        return self._keeps(c, point, wins, losses), point

    def _possible(self, c: int, alive: list[int]) -> bool:
        """Can candidate c still be kept? (One demo is kept, the best: can c still be it?)"""
        ok, best_case = self._bound(c, "best")
        if not ok:
            return False
        return self.candidates[c].demo is None or not any(
            d != c and self.candidates[d].demo is not None and self._bound(d, "worst")[0]
            and (self._bound(d, "worst")[1], d) > (best_case, c) for d in alive)

    def _result(self, alive: list[int]) -> ProbeResult:
        candidates = self.candidates
        scores = [self.score(1 + c) for c in range(len(candidates))]
        kept = [c in alive and self._keeps(c, scores[c], *self.paired(c)[:2]) for c in range(len(candidates))]
        # code competes: one demo (the step keeps the set it was probed with) and one experience with an excerpt; and
        # one edit per current experience (a rewrite and a retirement of it cannot both be kept)
        kinds = [lambda c: c.demo is not None, lambda c: c.demo is None and c.shows_code]
        kinds += [lambda c, t=t: t in c.targets for t in sorted({t for c in candidates for t in c.targets})]
        for kind in kinds:
            wins = [(score, i) for i, (c, score, k) in enumerate(zip(candidates, scores, kept)) if k and kind(c)]
            best = max(wins)[1] if wins else None
            kept = [k and (not kind(c) or i == best) for i, (c, k) in enumerate(zip(candidates, kept))]
        tried = [[qi for qi in self.queries if (p, qi) in self.found] for p in range(len(self.programs))]
        solved = [[qi for qi in ran if self.solved(p, qi)] for p, ran in enumerate(tried)]
        traces = [{qi: self.found[(p, qi)]["trace"] for qi in solved[p] if self.found[(p, qi)].get("trace")}
                  for p in range(len(self.programs))]
        result = ProbeResult(queries=self.queries, base=self.base, scores=scores, kept=kept,
                             ran=[len(self.rewards(1 + c)) for c in range(len(candidates))], solved=solved,
                             tried=tried, traces=traces)
        for c, (s, m), k, r in zip(candidates, result.scores, result.kept, result.ran):
            logger.info("Probe: %s: %d solved of %d run, mean %.3f vs %d, %.3f now -> %s", c.label, s, r, m,
                        *result.base, "kept" if k else "dropped")
        return result


@dataclass(frozen=True)
class ProbeOutcome:
    """What the probe stage hands on: the kept plan, the demos, what is known of the queries the program it hands on
    solves (query -> solved), the probe's record for the step's result (None when no probe ran), its usage, the LM
    copies it priced them with, and the demo candidates it found for the next step (`_found`)."""

    plan: list[Operation]
    demos: list[dict]
    evidence: dict[int, bool]
    record: dict | None = None
    usage: dict = field(default_factory=dict)
    lms: list = field(default_factory=list)
    found: list[dict] = field(default_factory=list)


def probe_edits(setup: RunSetup, start: StepStart, learning: Learning, *, saved: Callable[[], None]) -> ProbeOutcome:
    """The step's probe stage: the plan's operations and the demo candidates, each tried against the current program
    on the same training queries outside the step's queries; kept as `Probe` says."""
    knobs, library, demos = setup.knobs, start.library, start.demos
    candidates, unprobed = _candidates(knobs, start, learning)
    evidence = solved_by(learning.groups, knobs.num_generations - knobs.num_explore_generations, start.evidence)
    if not candidates:
        return ProbeOutcome(plan=[], demos=demos, evidence=evidence, record={"candidates": [], "unprobed": unprobed})
    programs = [with_learned(start.program, start.targets, library, demos)]
    for c in candidates:
        if c.demo is not None:  # the demo replaces the weakest of the kept ones, last: what a small model copies
            programs.append(with_learned(start.program, start.targets, library,
                                         keep_best(demos, knobs.max_demos - 1) + [c.demo]))
        else:
            trial = library.copy()
            trial.apply(list(c.operations), step=start.index, quiet=True)  # said once, as it was proposed
            programs.append(with_learned(start.program, start.targets, trial, demos))
    rollout_id = int(digest([knobs.seed, start.index, "probe"]), 16) % 2**31
    lms, runnable = [], []
    for p in programs:
        cand, copies = with_own_lms(p, rollout_id=rollout_id, temperature=knobs.temperature)
        runnable.append(cand)
        lms += copies
    # the current program's attempts are kept by what the program is, not by step: a later step whose program
    # has not changed reuses them on the probe queries it shares with this one
    current = digest([[e.model_dump() for e in library.active.values()], demos])

    def unit_of(p, qi):
        return Keys.probe_base(current, qi) if p == 0 else Keys.probe(start.index, p, qi)

    def run_units(fn, jobs):
        def unit(job):
            return setup.ckpt.unit(unit_of(*job), lambda: fn(job), then=saved)
        return run_parallel(unit, jobs, num_threads=knobs.num_threads, stage="probe", progress=knobs.progress)

    unsolved = {q for q, ok in start.evidence.items() if not ok} if knobs.focus_on_failures else set()
    queries = probe_queries(len(start.trainset), [g.index for g in learning.groups], knobs.probe_size,
                            seed=knobs.seed, step=start.index, unsolved=unsolved)
    rules = ProbeRules(alpha=knobs.probe_alpha, keep_ties=knobs.keep_tied_demos, timeout_s=knobs.metric_timeout_s)
    result = Probe(runnable, candidates, queries=queries, trainset=start.trainset, metric=setup.metric,
                   unit_of=unit_of, cached=setup.ckpt.get, run_units=run_units, rules=rules).run()
    kept_ops = [op for c, k in zip(candidates, result.kept) if k for op in c.operations]
    best = next((i for i, (c, k) in enumerate(zip(candidates, result.kept))  # a demo is shown solving its query
                 if k and c.demo is not None and (c.demo["reward"] >= 1 or result.traces[1 + i])), None)
    if best is not None:  # the demo set the winning candidate demo was probed with
        demos = keep_best(demos, knobs.max_demos - 1) + [_shown_demo(candidates[best].demo, best, result, start)]
        evidence = {qi: qi in result.solved[1 + best] for qi in result.tried[1 + best]}  # the new program's
    else:
        evidence.update({qi: qi in result.solved[0] for qi in result.tried[0]})
    record = {"candidates": [], "unprobed": unprobed, **result.to_dict(candidates)}
    found = _found(start, result, [not start.demos and c.demo is None for c in candidates], knobs) \
        if knobs.max_demos else []
    return ProbeOutcome(plan=kept_ops, demos=demos, evidence=evidence, record=record, lms=lms, found=found)


def _found(start: StepStart, result: ProbeResult, demo_free: list[bool], knobs) -> list[dict]:
    """Demo candidates for the next step, found on the way: the probe's attempts that solved their query, made by a
    program without demos (the current one, or one with a candidate rule). Each is a fresh sample of what the model
    writes; an attempt made with a demo in the prompt is mostly that demo again."""
    programs = [not start.demos] + demo_free
    return [{"query": query_key(start.trainset[qi], qi), "step": start.index, "reward": 1.0, "advantage": 0.0,
             "trace": trace} for p, free in enumerate(programs) if free for qi, trace in result.traces[p].items()]


def _candidates(knobs, start: StepStart, learning: Learning) -> tuple[list[Candidate], int]:
    """The edits to probe (demos first, half the slots at most; then the plan's operations the library accepts; a
    spare slot retires a current experience in turn), and how many were left out."""
    explore_from = knobs.num_generations - knobs.num_explore_generations if knobs.num_explore_generations else None
    found = demo_candidates(learning.informative, start.index, min_reward=0.0, explore_from=explore_from) + \
        list(start.pending) if knobs.max_demos else []
    found = sorted(found, key=lambda d: (-d["reward"], -d["advantage"], d["query"]))[: (knobs.max_probed_edits + 1) // 2]
    candidates = [Candidate(label=f"demo from {d['query']} (reward {d['reward']:.2f})", demo=d) for d in found]
    plan, library = learning.lessons.plan, start.library
    for op in plan:
        if len(candidates) >= knobs.max_probed_edits:
            break
        if library.copy().apply([op], step=start.index).num_applied:  # one the library refuses is not worth a probe
            candidates.append(Candidate(label=f"{op.action} {op.ids or ''} {op.text[:60]!r}", operations=(op,)))
    if library.active and len(candidates) < knobs.max_probed_edits:  # a spare slot: must a current experience stay?
        target = list(library.active)[start.index % len(library.active)]  # each in turn
        candidates.append(Candidate(label=f"retire {target}", operations=(Operation(action="delete", ids=[target]),)))
    return candidates, max(0, len(plan) + len(found) - len(candidates))


def _shown_demo(demo: dict, c: int, result: ProbeResult, start: StepStart) -> dict:
    """The winning demo as it is kept: with its probe gain; shown as an attempt that solved its own query (a candidate
    judged by what it did on other queries may have failed its own: then its attempt on a probe query it solved)."""
    solved, mean = result.scores[c]
    demo = dict(demo, gain=solved - result.base[0] + mean - result.base[1])
    if demo["reward"] < 1:
        qi = next(iter(result.traces[1 + c]))
        demo.update(query=query_key(start.trainset[qi], qi), reward=1.0, trace=result.traces[1 + c][qi])
    return demo
