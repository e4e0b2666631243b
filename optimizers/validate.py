"""Scoring a learned program on held-out examples: validation after an epoch, and the attribution's runs
(`worth.py`), by the same path as the probe's attempts."""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import dspy

from tfgrpo.optimizers.checkpoint import Checkpoint, Keys
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.parallel import TooManyFailuresError, run_parallel
from tfgrpo.optimizers.rollout import run_and_score, with_own_lms
from tfgrpo.optimizers.step import RunSetup, StepStart
from tfgrpo.programs.inject import with_learned

logger = logging.getLogger(__name__)


def scored_runs(program: dspy.Module, examples: list, *, metric: Callable, knobs: Knobs, ckpt: Checkpoint,
                unit: Callable[[dspy.Example], str] | None = None) -> list[dict]:
    """One run of `program` per example, scored: `reward`, and `error` (the program raised, or its metric call timed
    out; it scores 0). `unit(example)`: the checkpoint key of each run (a failed run is not kept: a resume runs it
    again). More failures than `max_failure_rate` allows raise `TooManyFailuresError`: an outage must not pass for a
    bad program."""
    cand, _ = with_own_lms(program)

    def one(example):
        def run():
            rec = run_and_score(cand, example, metric, knobs.metric_timeout_s)
            return {"reward": rec["reward"], "error": rec["error"] or rec.get("timeout")}
        return ckpt.unit(unit(example), run, keep=lambda r: not r["error"]) if unit else run()

    records = run_parallel(one, list(examples), num_threads=knobs.num_threads, stage="held-out",
                           progress=knobs.progress)
    errors = [r["error"] for r in records if r["error"]]
    if len(errors) > knobs.max_failure_rate * len(records):
        raise TooManyFailuresError(f"the program failed on {len(errors)} of {len(records)} held-out examples (first: "
                                   f"{errors[0]}); finished work is kept in log_dir={knobs.log_dir!r}")
    return records


def validate(setup: RunSetup, start: StepStart, *, valset: list, epoch: int) -> dict:
    """The epoch's validation record for the program `start` holds with its library and demos: `val_score` (mean
    metric; a run of the program that raised, or whose metric call timed out, scores 0) and `val_failures`."""
    knobs, ckpt, library, demos = setup.knobs, setup.ckpt, start.library, start.demos
    if (saved := ckpt.get(Keys.epoch(epoch))) is not None:
        return {"val_score": saved["val_score"], "val_failures": saved.get("val_failures", 0)}
    logger.info("validation: %d call(s) on %d thread(s)", len(valset), knobs.num_threads)
    try:
        records = scored_runs(with_learned(start.program, start.targets, library, demos), valset, metric=setup.metric,
                              knobs=knobs, ckpt=ckpt)
    except TooManyFailuresError as exc:
        raise TooManyFailuresError(f"validation after epoch {epoch}: {exc}") from None
    errors = [r["error"] for r in records if r["error"]]
    if errors:
        logger.warning("Epoch %d: the program failed on %d of %d validation examples, scored 0 (first: %s)",
                       epoch, len(errors), len(records), errors[0])
    value = statistics.fmean(r["reward"] for r in records)
    logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(library))
    ckpt.put(Keys.epoch(epoch), {"val_score": value, "val_failures": len(errors), "library": library.dump_state(),
                                 "demos": demos})
    return {"val_score": value, "val_failures": len(errors)}
