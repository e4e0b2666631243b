"""The judge: which of a step's lessons and winning attempts the program keeps.

Without a probe, every valid operation of the plan is applied, as in the paper, and with `max_demos` the winning
attempts with the highest group advantage become demos: a group's best attempt that fully succeeded while its groupmates
did worse (a small policy model copies a working example far better than it follows advice; only full successes
qualify, since a half-right example teaches its mistakes too).

With `probe_size > 0`, each candidate edit is tried first, as GEPA keeps a candidate only when it scores better on the
minibatch: the program as it is and the program with one candidate edit each (every operation of the plan, each
candidate demo) make one attempt on the same `probe_size` training queries outside the step's batch (never a held-out
one). A winning attempt is not yet a good lesson: on the Game of 24 a program that only sums wins on 3 7 7 7, and a
small policy model copies it faithfully everywhere.

A probe ranks programs by full successes (reward 1) first and mean reward second; partial credit alone misleads it (on
the Game of 24, demos chosen by mean partial reward taught the 1.5B to print any expression of the four numbers and it
then solved 0 of 48 held-out puzzles). A library operation is kept when it ranks no lower than the current program; a
demo, or an experience carrying an excerpt (code the policy will copy), only when it wins more probe queries than it
loses against the current program, and only the best such candidate of each kind is kept; of two edits of one
experience (a rewrite, a retirement) only the better. A probe slot left over retires one current experience in turn,
when the program ranks no lower without it. The candidates run query by query, and one whose verdict is known runs no
more queries. A probe query on which an attempt's LM call failed leaves the probe, for every program alike, so the
comparison stays paired.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable

import dspy

from tfgrpo.base.util import digest
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.records import Demo, Group, Lessons, Scored, Verdict
from tfgrpo.optimizers.runner import Run, Scope, State
from tfgrpo.optimizers.workers import rollout_id, with_own_lms
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.render import query_key
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


def judge(run: Run, scope: Scope, state: State, step: int, groups: list[Group], lessons: Lessons) -> Verdict:
    """The verdict on a step's lessons and winning attempts: the probe's with `probe_size`, else every operation of the
    plan and (with `max_demos`) the demos by group advantage. With `probe_min_power`, a probe that could not tell a
    better candidate from a useless one at the step's solve rate is skipped: no edit is kept unprobed, the free demo
    slots are filled as BootstrapFewShot fills them, with full successes (by group advantage: those of groups with
    contrast first, then those of groups that all succeeded), and the record says why (the run stops)."""
    knobs = run.knobs
    skipped = unresolvable(knobs, groups)
    if knobs.probe_size and not skipped:
        return probe_edits(run, scope, state, step, groups, lessons.plan)
    skipped = {**skipped, "unprobed": len(lessons.plan)} if skipped else None
    if knobs.max_demos:
        # (where the probe is skipped, as BootstrapFewShot: any group's full success, those with contrast first)
        new = demo_candidates([g for g in groups if g.informative or skipped], step)
        if skipped:  # the demos the program has were kept for a reason: only free slots are filled
            held = {d.query for d in state.demos}
            new = best_demos([d for d in new if d.query not in held], knobs.max_demos - len(state.demos))
        demos = best_demos(state.demos + new, knobs.max_demos)
        return Verdict(plan=[] if skipped else lessons.plan, demos=demos, record=skipped)
    return Verdict(plan=[] if skipped else lessons.plan, demos=state.demos, record=skipped)


def unresolvable(knobs: Knobs, groups: list[Group]) -> dict | None:
    """Why a probe of the step's edits would be skipped (`probe_min_power`): its power at the step's solve rate (the
    share of its attempts with reward 1) is below the knob; None when it would run, or none is asked for."""
    if not knobs.probe_size:
        return None
    attempts = [a.reward >= 1 for g in groups for a in g.attempts]
    rate = statistics.fmean(attempts) if attempts else 0.0
    power = probe_power(rate, knobs.probe_size)
    if power >= knobs.probe_min_power:
        return None
    return {"skipped": f"a probe of {knobs.probe_size} queries has power {power:.2f} < probe_min_power="
                       f"{knobs.probe_min_power} at the step's solve rate {rate:.0%}", "solve_rate": rate, "power": power}


def probe_power(solve_rate: float, size: int) -> float:
    """How well a probe of `size` queries tells a candidate that halves the program's failures from a useless one, at
    the program's `solve_rate`: the chance the first solves more probe queries than the program, less the chance the
    second does (independent binomial counts; near 1 where the program solves nothing, 0 where it solves everything)."""
    better = solve_rate + (1 - solve_rate) / 2
    base, good = ([math.comb(size, k) * r ** k * (1 - r) ** (size - k) for k in range(size + 1)]
                  for r in (solve_rate, better))
    return sum((good[j] - base[j]) * sum(base[:j]) for j in range(size + 1))  # P(good > base) - P(useless > base)


# -- demos ------------------------------------------------------------------------------------------------------------
def demo_candidates(groups: list[Group], step: int, *, min_reward: float = 1.0) -> list[Demo]:
    """Per group given: its best attempt, if its reward reaches `min_reward` (1: it fully succeeded; a probe judges
    candidates by what they do elsewhere, so it takes any that scored), with its group advantage."""
    found = []
    for group in groups:
        best = max(group.attempts, key=lambda a: (a.reward, -a.g))
        if best.reward >= min_reward and best.reward > 0 and not best.error and best.trace:
            found.append(Demo(query=group.key, trace=best.trace, step=step, reward=best.reward,
                              advantage=best.reward - statistics.fmean(group.rewards)))
    return found


def carried_demos(program: dspy.Module, targets: list[str]) -> list[Demo]:
    """The demos the target predictors of a student already carry (learned before, by this model or another), as
    demos the run keeps, probes against and may replace: each one call of its predictor, known by its place."""
    demos = []
    for name, predictor in program.named_predictors():
        fields = predictor.signature.input_fields, predictor.signature.output_fields
        for j, example in enumerate(predictor.demos if name in targets else []):
            values = dict(example)
            demos.append(Demo(query=f"{name}[{j}]", trace=[{
                "predictor": name, "inputs": {k: values[k] for k in fields[0] if k in values},
                "outputs": {k: values[k] for k in fields[1] if k in values}}]))
    return demos


def best_demos(demos: list[Demo], n: int, score: str = "advantage") -> list[Demo]:
    """The `n` demos with the highest `score` (their group "advantage", or a probe's "gain", 0 where none was
    measured; the earlier step first on ties, a carried demo first of all), one per query."""
    best_per_query: dict[str, Demo] = {}
    for demo in sorted(demos, key=lambda d: (-(getattr(d, score) or 0.0), -1 if d.step is None else d.step, d.query)):
        best_per_query.setdefault(demo.query, demo)
    return list(best_per_query.values())[: max(n, 0)]


# -- the probe --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One edit to probe: library operations, or a demo (a winning attempt's trace)."""

    label: str  # how logs and the step record name it
    operations: tuple[Operation, ...] = ()
    demo: Demo | None = None

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


def keeps(candidate: Candidate, score: tuple[int, float], base: tuple[int, float], wins: int = 0, losses: int = 0
          ) -> bool:
    """A demo, or an experience that carries code (an excerpt), must win more probe queries than it loses (`wins`:
    those solved by it and not by the current program; `losses`: the reverse); any other operation must rank no lower
    (successes, then mean reward)."""
    if candidate.shows_code:
        return wins > losses
    return score >= base


def probe_queries(trainset_size: int, batch: list[int], size: int, *, seed: int, step: int) -> list[int]:
    """`size` training queries outside the step's batch (all of the trainset when the batch covers it), drawn
    the same way on a resume."""
    pool = [i for i in range(trainset_size) if i not in set(batch)] or list(range(trainset_size))
    rng = random.Random(int(digest([seed, step, "probe"]), 16))
    return sorted(rng.sample(pool, min(size, len(pool))))


@dataclass
class Probe:
    """The statistics of a probe: program 0 is the current one, program 1 + c carries candidate c. `run` asks the
    step's scope for the attempts, query by query, and leaves the verdicts in `kept`, with each program's (successes, mean)
    in `base` and `scores`, the queries each ran (`tried`) and solved (`solved`), their solving traces (`traces`) and
    how many queries each candidate ran (`ran`). A query whose attempt got no answer leaves `queries`."""

    candidates: list[Candidate]
    queries: list[int]
    found: dict[tuple[int, int], Scored] = field(default_factory=dict)  # (program, query) -> its scored attempt
    base: tuple[int, float] = (0, 0.0)

    def run(self, scope: Scope, program_of: Callable[[int, int], dspy.Module], trainset: list) -> Probe:
        """Run the probe: `program_of(p, qi)` is program p as it makes its attempt on training query qi."""
        def ask(jobs):
            units = [(program_of(p, qi), trainset[qi]) for p, qi in jobs]
            for (p, qi), attempt in zip(jobs, scope.scored("probe", units)):
                if attempt.failed and qi in self.queries:  # no answer: the query leaves the probe, for all
                    logger.warning("Probe: an LM call failed on training query %d (%s); it leaves the probe", qi,
                                   attempt.error)
                    self.queries.remove(qi)
                elif not attempt.failed:
                    self.found[(p, qi)] = attempt

        ask([(0, qi) for qi in self.queries])  # the bar every candidate must clear
        self.base = self.score(0)
        alive = list(range(len(self.candidates)))
        for qi in list(self.queries):
            if qi in self.queries:
                ask([(1 + c, qi) for c in alive])
                self.base = self.score(0)
            alive = [c for c in alive if self._possible(c, alive)]
        self._verdicts(alive)
        return self

    # -- what the attempts show ------------------------------------------------------------------------------------
    def _hit(self, p: int, qi: int) -> bool:
        return self.found[(p, qi)].reward >= 1

    def rewards(self, p: int) -> list[float]:
        """Program p's rewards on the probe queries it has run."""
        return [self.found[(p, qi)].reward for qi in self.queries if (p, qi) in self.found]

    def score(self, p: int) -> tuple[int, float]:
        """Full successes and mean reward over the queries program p has run."""
        rs = self.rewards(p)
        return sum(r >= 1 for r in rs), statistics.fmean(rs or [0.0])

    def paired(self, c: int) -> tuple[int, int, int, int]:
        """Candidate c's wins and losses against the current program so far, and the wins and losses still possible."""
        ran = [qi for qi in self.queries if (1 + c, qi) in self.found]
        left = [qi for qi in self.queries if (1 + c, qi) not in self.found]
        wins = sum(self._hit(1 + c, qi) and not self._hit(0, qi) for qi in ran)
        losses = sum(self._hit(0, qi) and not self._hit(1 + c, qi) for qi in ran)
        return wins, losses, sum(not self._hit(0, qi) for qi in left), sum(self._hit(0, qi) for qi in left)

    def _bound(self, c: int, case: str) -> tuple[bool, tuple[int, float]]:
        """Whether c is kept, and its (successes, mean), if every query left goes its way ("best") or against it
        ("worst"); widened by a rounding error's width, so a tie is never cut short."""
        wins, losses, can_win, can_lose = self.paired(c)
        rs, n, left = self.rewards(1 + c), max(len(self.queries), 1), can_win + can_lose
        if case == "best":
            point, wins = (sum(r >= 1 for r in rs) + left, (sum(rs) + left) / n + 1e-9), wins + can_win
        else:
            point, losses = (sum(r >= 1 for r in rs), sum(rs) / n - 1e-9), losses + can_lose
        return keeps(self.candidates[c], point, self.base, wins, losses), point

    def _possible(self, c: int, alive: list[int]) -> bool:
        """Can candidate c still be kept? (One demo is kept, the best: can c still be it?)"""
        ok, best_case = self._bound(c, "best")
        if not ok:
            return False
        return self.candidates[c].demo is None or not any(
            d != c and self.candidates[d].demo is not None and self._bound(d, "worst")[0]
            and (self._bound(d, "worst")[1], d) > (best_case, c) for d in alive)

    def _verdicts(self, alive: list[int]) -> None:
        candidates = self.candidates
        self.scores = [self.score(1 + c) for c in range(len(candidates))]
        kept = [c in alive and keeps(candidates[c], self.scores[c], self.base, *self.paired(c)[:2])
                for c in range(len(candidates))]
        # code competes: one demo (the step keeps the set it was probed with) and one experience with an excerpt; and
        # one edit per current experience (a rewrite and a retirement of it cannot both be kept)
        kinds = [lambda c: c.demo is not None, lambda c: c.demo is None and c.shows_code]
        kinds += [lambda c, t=t: t in c.targets for t in sorted({t for c in candidates for t in c.targets})]
        for kind in kinds:
            wins = [(score, i) for i, (c, score, k) in enumerate(zip(candidates, self.scores, kept)) if k and kind(c)]
            best = max(wins)[1] if wins else None
            kept = [k and (not kind(c) or i == best) for i, (c, k) in enumerate(zip(candidates, kept))]
        self.kept, programs = kept, range(len(candidates) + 1)
        self.ran = [len(self.rewards(1 + c)) for c in range(len(candidates))]
        self.tried = [[qi for qi in self.queries if (p, qi) in self.found] for p in programs]
        self.solved = [[qi for qi in ran if self._hit(p, qi)] for p, ran in enumerate(self.tried)]
        self.traces = [{qi: self.found[(p, qi)].trace for qi in self.solved[p] if self.found[(p, qi)].trace}
                       for p in programs]
        for c, (s, m), k, r in zip(candidates, self.scores, self.kept, self.ran):
            logger.info("Probe: %s: %d solved of %d run, mean %.3f vs %d, %.3f now -> %s", c.label, s, r, m,
                        *self.base, "kept" if k else "dropped")

    def record(self) -> dict:
        """The probe as the step's record holds it."""
        return {"queries": self.queries, "base_successes": self.base[0], "base_mean": self.base[1],
                "base_solved": self.solved[0],
                "attempts_run": len(self.queries) + sum(self.ran),  # the current program's, then the candidates'
                "attempts_saved": sum(len(self.queries) - n for n in self.ran),
                "candidates": [{"edit": c.label, "successes": s, "mean": m, "queries_run": n, "kept": k,
                                "solved": solved} for c, (s, m), k, n, solved in zip(
                    self.candidates, self.scores, self.kept, self.ran, self.solved[1:])]}


def probe_edits(run: Run, scope: Scope, state: State, step: int, groups: list[Group], plan: list[Operation]
                ) -> Verdict:
    """The step's probe: the plan's operations and the demo candidates, each tried against the current program on the
    same training queries outside the step's queries; kept as `Probe` says."""
    knobs, library, demos = run.knobs, state.library, state.demos
    candidates, unprobed = _candidates(knobs, state, step, groups, plan)
    if not candidates:
        return Verdict(plan=[], demos=demos, record={"candidates": [], "unprobed": unprobed})
    programs = [with_learned(run.program, run.targets, library, demos)]
    for c in candidates:
        if c.demo is not None:  # the demo replaces the weakest of the kept ones, last: what a small model copies
            programs.append(with_learned(run.program, run.targets, library,
                                         best_demos(demos, knobs.max_demos - 1, "gain") + [c.demo]))
        else:
            trial = library.copy()
            # (its refusals said once, as it was proposed)
            trial.apply(list(c.operations), step=step, quiet=True, fold_at=knobs.duplicate_overlap)
            programs.append(with_learned(run.program, run.targets, trial, demos))
    seed = rollout_id(knobs.seed, step, "probe")
    runnable = [with_own_lms(p, rollout_id=seed, temperature=knobs.temperature) for p in programs]
    queries = probe_queries(len(run.trainset), [g.index for g in groups], knobs.probe_size, seed=knobs.seed, step=step)
    # the current program's attempt on a probe query keeps the rollout ID of the step that first probed it there, so
    # that a later step whose program has not changed gets the same attempt back (its calls answered by the record)
    current = digest([[e.dump() for e in library.active.values()], [d.to_record() for d in demos]])
    first = state.probed.get(current, {})
    earlier = {s: with_own_lms(programs[0], rollout_id=rollout_id(knobs.seed, s, "probe"), temperature=knobs.temperature)
               for s in set(first.values())}

    def program_of(p: int, qi: int) -> dspy.Module:
        return earlier[first[str(qi)]] if p == 0 and str(qi) in first else runnable[p]
    probe = Probe(candidates, list(queries)).run(scope, program_of, run.trainset)
    probed = {str(qi): step for (p, qi), a in probe.found.items() if p == 0 and not a.error and not a.metric_failed
              and str(qi) not in first}
    kept_ops = [op for c, k in zip(candidates, probe.kept) if k for op in c.operations]
    best = next((i for i, (c, k) in enumerate(zip(candidates, probe.kept))  # a demo is shown solving its query
                 if k and c.demo is not None and (c.demo.reward >= 1 or probe.traces[1 + i])), None)
    if best is not None:  # the demo set the winning candidate demo was probed with
        demos = best_demos(demos, knobs.max_demos - 1, "gain") + [_shown_demo(candidates[best].demo, best, probe,
                                                                                      run.trainset)]
    # demo candidates for the next step, found on the way: attempts that solved their probe query made by a program
    # without demos (a fresh sample of what the model writes; with a demo in the prompt it is mostly that demo again)
    free = [not state.demos] + [not state.demos and c.demo is None for c in candidates]
    found = [Demo(query=query_key(run.trainset[qi], qi), trace=trace, step=step, reward=1.0, advantage=0.0)
             for p, ok in enumerate(free) if ok and knobs.max_demos for qi, trace in probe.traces[p].items()]
    return Verdict(plan=kept_ops, demos=demos, record={"unprobed": unprobed, **probe.record()},
                   found=found, probed={current: probed}, tried=probe.found)


def _candidates(knobs: Knobs, state: State, step: int, groups: list[Group], plan: list[Operation]
                ) -> tuple[list[Candidate], int]:
    """The edits to probe (demos first, half the slots at most; then the plan's operations the library accepts; a
    spare slot retires a current experience in turn), and how many were left out."""
    found = demo_candidates([g for g in groups if g.informative], step, min_reward=0.0) + \
        list(state.pending) if knobs.max_demos else []
    found = sorted(found, key=lambda d: (-d.reward, -d.advantage, d.query))[: (knobs.max_probed_edits + 1) // 2]
    candidates = [Candidate(label=f"demo from {d.query} (reward {d.reward:.2f})", demo=d) for d in found]
    library = state.library
    for op in plan:
        if len(candidates) >= knobs.max_probed_edits:
            break
        if library.copy().apply([op], step=step, fold_at=knobs.duplicate_overlap).num_applied:  # one the library
            # refuses, or folds into an experience that says the same, is not worth a probe
            candidates.append(Candidate(label=f"{op.action} {op.ids or ''} {op.text[:60]!r}", operations=(op,)))
    if library.active and len(candidates) < knobs.max_probed_edits:  # a spare slot: must a current experience stay?
        target = list(library.active)[step % len(library.active)]  # each in turn
        candidates.append(Candidate(label=f"retire {target}", operations=(Operation(action="delete", ids=[target]),)))
    return candidates, max(0, len(plan) + len(found) - len(candidates))


def _shown_demo(demo: Demo, c: int, probe: Probe, trainset: list) -> Demo:
    """The winning demo as it is kept: with its probe gain; shown as an attempt that solved its own query (a candidate
    judged by what it did on other queries may have failed its own: then its attempt on a probe query it solved)."""
    solved, mean = probe.scores[c]
    demo = dataclasses.replace(demo, gain=solved - probe.base[0] + mean - probe.base[1])
    if demo.reward < 1:
        qi = next(iter(probe.traces[1 + c]))
        demo = dataclasses.replace(demo, query=query_key(trainset[qi], qi), reward=1.0, trace=probe.traces[1 + c][qi])
    return demo
