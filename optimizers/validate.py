"""Validation after an epoch: the learned program scored on the valset, by the same path as the probe's attempts."""

from __future__ import annotations

import logging
import statistics

from tfgrpo.optimizers.checkpoint import Keys
from tfgrpo.optimizers.parallel import TooManyFailuresError, run_parallel
from tfgrpo.optimizers.rollout import run_and_score, with_own_lms
from tfgrpo.optimizers.step import RunSetup, StepStart
from tfgrpo.programs.inject import with_learned

logger = logging.getLogger(__name__)


def validate(setup: RunSetup, start: StepStart, *, valset: list, epoch: int) -> dict:
    """The epoch's validation record for the program `start` holds with its library and demos: `val_score` (mean
    metric; a run of the program that raised, or whose metric call timed out, scores 0) and `val_failures`. More
    failures than `max_failure_rate` allows stop the run with `TooManyFailuresError`: an outage must not pass for a
    bad library."""
    knobs, metric, ckpt, library, demos = setup.knobs, setup.metric, setup.ckpt, start.library, start.demos
    if (saved := ckpt.get(Keys.epoch(epoch))) is not None:
        return {"val_score": saved["val_score"], "val_failures": saved.get("val_failures", 0)}
    cand, _ = with_own_lms(with_learned(start.program, start.targets, library, demos))
    logger.info("validation: %d call(s) on %d thread(s)", len(valset), knobs.num_threads)
    records = run_parallel(lambda example: run_and_score(cand, example, metric, knobs.metric_timeout_s), list(valset),
                           num_threads=knobs.num_threads, stage="validation", progress=knobs.progress)
    errors = [r["error"] or r["timeout"] for r in records if r["error"] or r.get("timeout")]  # a timeout has "timeout"
    if len(errors) > knobs.max_failure_rate * len(records):
        raise TooManyFailuresError(f"validation after epoch {epoch}: the program failed on {len(errors)} of "
                                   f"{len(records)} examples (first: {errors[0]}); finished work is kept in "
                                   f"log_dir={knobs.log_dir!r}")
    if errors:
        logger.warning("Epoch %d: the program failed on %d of %d validation examples, scored 0 (first: %s)",
                       epoch, len(errors), len(records), errors[0])
    value = statistics.fmean(r["reward"] for r in records)
    logger.info("Epoch %d: validation score %.3f with %d experiences", epoch, value, len(library))
    ckpt.put(Keys.epoch(epoch), {"val_score": value, "val_failures": len(errors), "library": library.dump_state(),
                                 "demos": demos})
    return {"val_score": value, "val_failures": len(errors)}
