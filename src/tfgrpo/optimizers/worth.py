"""What each learned item is worth, measured on held-out queries after a compile (the `attribution` knob).

An item is one kept experience or one kept demo. On the attribution queries, the program with everything learned is
run against the same program with one item left out (leave-one-out; above `attribution_max_items` items, Shapley
values estimated from `attribution_permutations` random orders), paired query by query, with a 95% bootstrap CI over
the queries. Two controls put the whole library in context: the program with nothing learned, and the program with an
irrelevant text of the same length in place of what was learned (does the content help, or only the length?).

`prune` then drops items one at a time, the least worth first, while an item's worth is not above zero and leaving it
out of what is still kept does not lower the score (two items that stand in for each other are each worth nothing left
out alone, but not both: measured on the Game of 24, dropping both at once lost 0.75). The attribution queries are
split in two for it: one half measures the worth and chooses what to drop, the other half, which chose nothing, checks
the pruned program against the unpruned one; the pruned one is kept only if it scores at least as well there.

Every program run is an attempt of the run's scope, so its LM calls are charged to the budget and recorded: a resumed
compile runs the measurement again and its calls are answered from the record. A run whose LM call failed has no
answer: it counts as no difference in the pairs it is in.
"""

from __future__ import annotations

import functools
import logging
import random
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

import dspy

from tfgrpo.base.util import bootstrap_ci, clip, digest
from tfgrpo.optimizers.runner import Run, Scope
from tfgrpo.optimizers.workers import with_own_lms
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.plan import measure_runs
from tfgrpo.optimizers.records import Demo, ItemWorth, WorthResult
from tfgrpo.programs.inject import with_learned
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.programs.render import as_text

logger = logging.getLogger(__name__)

# The control's text, written for this purpose: plainly about something else (bread), so that only its length is shared
# with what was learned.
FILLER = ("Bread dough rises because yeast eats the sugars in flour and breathes out carbon dioxide, which the gluten "
          "holds in small pockets. A warm kitchen speeds this up and a cold one slows it, so many bakers leave the "
          "dough in the refrigerator overnight for a slower rise and a deeper flavour. Salt tightens the gluten and "
          "keeps the yeast from racing ahead. Before baking, the loaf is shaped, left to rise once more, and slashed "
          "across the top so that steam can escape without tearing the crust. ")


class Learned(NamedTuple):
    """What a compile kept: the library and the demos."""

    library: ExperienceLibrary
    demos: list[Demo]

    def items(self) -> list[tuple[str, str, str]]:
        """(kind, ID, text) of every item: the experiences by their IDs, then the demos as D1, D2, ..., each shown by
        its query (the inputs of its first call)."""
        items = [("experience", e.id, e.text) for e in self.library]
        for j, demo in enumerate(self.demos):
            first = (demo.trace or [{}])[0].get("inputs", {})
            items.append(("demo", f"D{j + 1}", clip(", ".join(f"{k}: {as_text(v)}" for k, v in first.items()), 120)))
        return items

    def key(self) -> str:
        """A digest of what these items are (their texts and demos, not only their IDs)."""
        return digest({"experiences": [[e.id, e.text, e.excerpt] for e in self.library], "demos": [d.to_record() for d in self.demos]})

    def only(self, ids: set[str]) -> "Learned":
        """The items whose IDs are in `ids`, nothing else."""
        state = self.library.dump_state()
        state["experiences"] = [e for e in state["experiences"] if e["id"] in ids]
        return Learned(ExperienceLibrary.from_state(state),
                       [d for j, d in enumerate(self.demos) if f"D{j + 1}" in ids])


@dataclass
class Attribution:
    """Measures a compile's items on `examples` within the run (`Run`): its knobs, metric, record and budget."""

    run: Run

    def measure(self, base: dspy.Module, targets: list[str], learned: Learned, examples: list, *,
                prune: bool | None = None, name: str = "attribution") -> tuple[WorthResult, Learned]:
        """The items' worth, and what the compiled program keeps: `learned`, or its pruned part (with `prune`, the
        knob's value unless given); `name`: the scope's (a refit's is "refit")."""
        with Scope(self.run, name) as scope:
            knobs, ids = self.run.knobs, [i for _, i, _ in learned.items()]
            prune = knobs.prune if prune is None else prune
            ci = functools.partial(bootstrap_ci, seed=knobs.seed, resamples=2000)  # a 95% CI over the queries
            if not ids:
                logger.info("Attribution: nothing was learned, so there is nothing to measure")
                return WorthResult(method="leave-one-out", queries=0, score=0.0, items=[], library=0.0,
                                   library_ci95=(0.0, 0.0), control=0.0, control_ci95=(0.0, 0.0), pruned=[],
                                   prune_check=None, program_runs=0), learned
            choose, check = _halves(examples, knobs.seed) if prune else (list(examples), [])
            runs = measure_runs(knobs, len(ids), len(examples), prune=prune)
            logger.info("Attribution of %d item(s) on %d held-out queries: up to %d program runs (%s)", len(ids),
                        len(examples), runs["runs"], runs["method"])
            scores = _Scores(scope, base, targets, learned, choose)
            full, none = scores.of(set(ids)), scores.of(set())
            control = scores.runs(_control(base, targets, learned), choose)
            shapley = len(ids) > knobs.attribution_max_items
            per_item = _shapley(scores, ids, knobs) if shapley else {i: _minus(full, scores.of(set(ids) - {i})) for i in ids}
            items = [ItemWorth(kind=kind, id=i, text=text, worth=statistics.fmean(per_item[i]),
                               ci95=ci(per_item[i])) for kind, i, text in learned.items()]
            dropped = _backward(scores, items) if prune else []
            check_record, kept, checked = None, learned, 0
            if dropped:
                pruned = learned.only(set(ids) - set(dropped))
                on_check = _Scores(scope, base, targets, learned, check)
                diffs = _minus(on_check.of(set(ids) - set(dropped)), on_check.of(set(ids)))
                better = statistics.fmean(diffs) >= 0
                check_record = {"queries": len(check), "dropped": dropped, "difference": statistics.fmean(diffs),
                                "ci95": ci(diffs), "kept": "pruned" if better else "unpruned"}
                kept, checked = (pruned if better else learned), on_check.made
            gain, over_control = _minus(full, none), _minus(full, control)
            result = WorthResult(
                method="shapley" if shapley else "leave-one-out", queries=len(choose), score=_mean(full),
                items=items, library=statistics.fmean(gain), library_ci95=ci(gain),
                control=statistics.fmean(over_control), control_ci95=ci(over_control),
                pruned=dropped if kept is not learned else [], prune_check=check_record,
                program_runs=scores.made + checked)
            return result, kept


def log_worth(worth: WorthResult) -> None:
    """Say in the log what the attribution measured."""
    logger.info("Attribution on %d held-out queries (%s): score %.3f; the library adds %+.3f (95%% CI %+.3f..%+.3f), "
                "%+.3f over an irrelevant text of its length (%+.3f..%+.3f)", worth.queries, worth.method, worth.score,
                worth.library, *worth.library_ci95, worth.control, *worth.control_ci95)
    for item in worth.items:
        logger.info("  %s %s: worth %+.3f (95%% CI %+.3f..%+.3f) %s", item.kind, item.id, item.worth, *item.ci95,
                    item.text[:80])
    if worth.prune_check:
        check = worth.prune_check
        logger.info("Pruning %s: the pruned program scored %+.3f against the unpruned one on %d other queries; kept "
                    "the %s one", ", ".join(check["dropped"]), check["difference"], check["queries"], check["kept"])


@dataclass
class _Scores:
    """Per-query rewards of the program carrying a subset of the learned items, each subset run once (`made`: the
    program runs so far)."""

    scope: Scope
    base: dspy.Module
    targets: list[str]
    learned: Learned
    examples: list
    made: int = 0
    _seen: dict = field(default_factory=dict)  # subset key -> its rewards

    def of(self, ids: set[str]) -> list[float]:
        part = self.learned.only(ids)
        key = part.key()
        if key not in self._seen:
            self._seen[key] = self.runs(with_learned(self.base, self.targets, *part), self.examples)
        return self._seen[key]

    def runs(self, program: dspy.Module, examples: list) -> list[float | None]:
        """The program's reward per example (None where its LM call failed)."""
        self.made += len(examples)
        runnable = with_own_lms(program)
        attempts = self.scope.scored("attribution", [(runnable, x) for x in examples])
        self.scope.check("attribution")
        return [a.reward for a in attempts]


def _backward(scores: _Scores, items: list[ItemWorth]) -> list[str]:
    """The items to drop, chosen one at a time, the least worth first: an item worth no more than zero is dropped when
    the program without it, and without those dropped before it, scores at least what it did with it."""
    kept, dropped = {it.id for it in items}, []
    for item in sorted(items, key=lambda it: it.worth):
        if item.worth > 0:
            break
        if _mean(scores.of(kept - {item.id})) >= _mean(scores.of(kept)):
            kept, dropped = kept - {item.id}, [*dropped, item.id]
    return dropped


def _shapley(scores: _Scores, ids: list[str], knobs: Knobs) -> dict[str, list[float]]:
    """Per item, its per-query Shapley value estimated from `attribution_permutations` random orders: the mean gain
    of adding it to the items before it in each order."""
    rng, total = random.Random(knobs.seed), {i: [0.0] * len(scores.examples) for i in ids}
    for _ in range(knobs.attribution_permutations):
        order, before = rng.sample(ids, len(ids)), set()
        previous = scores.of(before)
        for i in order:
            before = before | {i}
            current = scores.of(before)
            total[i] = [t + d for t, d in zip(total[i], _minus(current, previous))]
            previous = current
    return {i: [t / knobs.attribution_permutations for t in v] for i, v in total.items()}


def _control(base: dspy.Module, targets: list[str], learned: Learned) -> dspy.Module:
    """The program with nothing learned and, at the end of each target's instructions, as many characters of
    `FILLER` as the learned items take in its prompt (the experience block, and the demos' fields)."""
    bare = with_learned(base, targets, learned.only(set()).library, [])
    full = dict(with_learned(base, targets, learned.library, []).named_predictors())
    control = bare.deepcopy()
    for name, predictor in control.named_predictors():
        if name not in targets:
            continue
        calls = [call for demo in learned.demos for call in demo.trace if call["predictor"] == name]
        length = (len(full[name].signature.instructions) - len(predictor.signature.instructions)
                  + sum(len(as_text(v)) for call in calls for v in [*call["inputs"].values(), *call["outputs"].values()]))
        if length > 0:
            text = (FILLER * (length // len(FILLER) + 1))[:length]
            predictor.signature = predictor.signature.with_instructions(predictor.signature.instructions + "\n\n" + text)
    return control


def _halves(examples: list, seed: int) -> tuple[list, list]:
    if len(examples) < 4:
        raise ValueError(f"prune needs at least 4 attribution queries (half to choose, half to check), not {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    half = (len(order) + 1) // 2
    return [examples[i] for i in order[:half]], [examples[i] for i in order[half:]]


def _mean(values: list[float | None]) -> float:
    answered = [v for v in values if v is not None]
    return statistics.fmean(answered) if answered else 0.0


def _minus(a: list[float | None], b: list[float | None]) -> list[float]:
    """Per query, a - b; 0 where either has no answer (its LM call failed)."""
    return [x - y if x is not None and y is not None else 0.0 for x, y in zip(a, b)]
