"""Learned programs that ship with the package: the best program the benchmarks measured for the embedded model on a
task, to look at (`tfgrpo show NAME`) and to score again (`tfgrpo evaluate NAME`) without compiling one.

Each lives in `learned_programs/NAME/`: `program.json` (saved DSPy state, as `compiled.save()` writes it) and
`provenance.json`, which says where it comes from (the benchmark arm, its knobs and seed, the measured run) and how it
was scored: the program, metric and held-out split by name, the sampling, and the score. `evaluate` scores it the way
benchmarks/peers.py scored it (`tfgrpo.evaluate.heldout_rows`, the same code); the server samples at the stated
temperature with a seed of its own, so a new run's score varies around the stated one.
"""

from __future__ import annotations

import importlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FOLDER = Path(__file__).with_name("learned_programs")


@dataclass(frozen=True)
class Learned:
    """A shipped program: its name, its saved state and its provenance (the parsed provenance.json)."""

    name: str
    program_path: Path
    provenance: dict[str, Any]


def names() -> list[str]:
    """The names of the shipped programs."""
    return sorted(p.name for p in FOLDER.iterdir() if (p / "provenance.json").is_file())


def find(name: str) -> Learned | None:
    """The shipped program called `name`, or None."""
    if name not in names():
        return None
    folder = FOLDER / name
    return Learned(name, folder / "program.json", json.loads((folder / "provenance.json").read_text(encoding="utf-8")))


def named(spec: str) -> Any:
    """The object a `module:attribute` spec of a provenance names."""
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def load(learned: Learned):
    """A fresh program of the provenance's kind, with the shipped state loaded into it."""
    program = named(learned.provenance["program"])()
    program.load(str(learned.program_path))
    return program


def heldout(learned: Learned) -> list:
    """The held-out examples the stated score was measured on."""
    split = learned.provenance["heldout"]
    return named(split["loader"])(split["split"], limit=split["limit"], offset=split["offset"])


def describe(learned: Learned) -> list[str]:
    """Where the program comes from and what it scored, as lines for a terminal."""
    p, made = learned.provenance, learned.provenance["compiled_with"]
    score, split, s = p["score"], p["heldout"], p["sampling"]
    knobs = ", ".join(f"{k}={v!r}" for k, v in made["knobs"].items())
    return [f"{learned.name}: {p['summary']}",
            f"  compiled by {made['arm']} (seed {made['seed']}) on {made['trainset']['limit']} problems of "
            f"{made['trainset']['split']} from offset {made['trainset']['offset']}: {knobs}",
            f"  held out: {split['limit']} problems of {split['split']} from offset {split['offset']}, solved "
            f"{score['solved']} of "
            f"{score['problems']} (the uncompiled program: {score['baseline_solved']}), model {p['model']}, "
            f"temperature {s['temperature']}, max_tokens {s['max_tokens']}, {s['runs_per_problem']} run per problem, "
            f"measured {p['measured']}",
            f"  chosen as {p['chosen']}; from {p['source']}"]


def sampling_lm(learned: Learned, api_base: str):
    """The policy LM with the sampling the stated score was measured with (cache off: every call is sampled)."""
    from tfgrpo.lms import local_dspy_lm

    s = learned.provenance["sampling"]
    return local_dspy_lm(learned.provenance["model"], api_base, temperature=s["temperature"],
                         max_tokens=s["max_tokens"], timeout=300, num_retries=2, cache=s["cache"])


def evaluate(learned: Learned, *, api_base: str | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Score the shipped program on its held-out split as its provenance says it was scored: the embedded model (or
    the OpenAI-compatible `api_base`), the same sampling, one run per problem. Returns the rows, what was solved and
    a 95% bootstrap CI of this run's score over the problems."""
    from tfgrpo.evaluate import bootstrap_ci, heldout_rows
    from tfgrpo.lms import serving

    p, s = learned.provenance, learned.provenance["sampling"]
    program, examples, metric = load(learned), heldout(learned), named(p["metric"])
    with serving(p["model"], api_base, n_ctx=s["n_ctx"]) as base:
        rows = heldout_rows(program, examples, metric, lm=sampling_lm(learned, base), seed=s["rollout_id"],
                            num_threads=s["num_threads"], name=learned.name, progress=progress)
    scores = [r["score"] for r in rows]
    return {"rows": rows, "solved": sum(scores), "problems": len(rows), "score": statistics.fmean(scores),
            "ci95": bootstrap_ci(scores), "stated": p["score"]}

