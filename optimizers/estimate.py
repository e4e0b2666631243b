"""A `--dry-run` of a Training-Free GRPO run: compile's own checks, and an estimate of what it will send, before
anything is spent.

Call counts are upper bounds: every group is assumed to have contrast, every probed edit to run on every probe
query, and every call to be sent twice (a learning reply that does not parse is asked for once more; a student's
reply that does not parse is re-asked by DSPy's JSON fallback). Token counts are rough: prompt sizes come from the
program's instructions and the training queries at ~4 characters per token, with a full library and a full set of
demos in the prompt; completions are counted at the LM's `max_tokens` cap.
"""

from __future__ import annotations

import statistics

from tfgrpo.optimizers.inputs import check_program

CHARS_PER_TOKEN = 4
LEARNING_PROMPT_OVERHEAD = 400  # tokens of instructions and formatting in a learning call
TRIES = 2  # the most times one call is sent: once, and once more when its reply does not parse


class _Checked(Exception):
    """Raised where compile would start the run: every check before that point passed."""


class _StopAtStart:
    """Stands for compile's checkpoint: compile checks everything it can before it records the run (`start`), and
    makes no LM call before then, so this is where a dry run stops it."""

    def start(self, fingerprint: dict) -> None:
        raise _Checked


def check_run(optimizer, student, trainset: list, valset: list | None = None,
              attribution_set: list | None = None) -> None:
    """Make compile's own checks of these arguments, and stop where compile would start the run (its checkpoint's
    `start`, which comes after every check and before any LM call): what compile refuses (the program, the examples,
    a `max_cost` no price can measure, a learning path that cannot learn, ...) is refused here with the same error,
    and nothing is called or written. The LMs checked are dspy's configured one and `optimizer.reflection_lm`."""
    check_program(student)
    try:
        optimizer._compile(student, trainset=trainset, valset=valset, trackers=(), ckpt=_StopAtStart(),
                           attribution_set=attribution_set)
    except _Checked:
        return


def estimate_run(knobs, student, trainset: list, *, turns_per_rollout: int = 1, max_tokens: int = 512,
                 learning_path: str = "paper") -> dict:
    """`learning_path`: "paper" (summaries, advantages, consolidation) or "contrast" (one call per pair of
    attempts, plus at most one rewrite of a rule that repeated its query, and with `max_excerpt_lines` one call that
    picks its excerpt). With `probe_size`, the probe's attempts (the current program and each of `max_probed_edits`
    candidate edits on `probe_size` training queries) are the "probe" stage."""
    opt = knobs  # a TrainingFreeGRPO's `resolved(model)`, the preset's values in place
    steps = opt.total_steps(len(trainset))
    batch = min(opt.batch_size + opt.max_resampled_queries, len(trainset))  # dynamic sampling may add queries
    G = opt.num_generations
    instructions = sum(len(p.signature.instructions) for _, p in student.named_predictors()) // CHARS_PER_TOKEN
    query = int(statistics.fmean(len(str(x.inputs().toDict())) for x in trainset)) // CHARS_PER_TOKEN
    library = (opt.max_experiences or 40) * int(opt.max_words_per_experience * 1.4)  # a full library, in tokens
    demos = opt.max_demos * (query + max_tokens)  # each demo: a query and a whole attempt
    rollout_prompt = instructions + query + library + demos + (turns_per_rollout - 1) * max_tokens // 2
    rollout = {"calls": batch * G * turns_per_rollout, "prompt_tokens": batch * G * turns_per_rollout * rollout_prompt}
    if learning_path == "contrast":
        pairs = batch * min(opt.max_operations_per_group, G // 2)
        calls = (3 if opt.max_excerpt_lines else 2) * pairs  # per pair: the contrast, a rewrite, the excerpt's pick
        per_step = {"rollout": rollout, "contrast": {
            "calls": calls, "prompt_tokens": calls * (LEARNING_PROMPT_OVERHEAD + query + library + 2 * max_tokens)}}
    else:
        per_step = _paper_step(opt, rollout, batch, (query, library, max_tokens))
    if opt.probe_size:  # one attempt of the current program and of each candidate edit per probe query
        attempts = (1 + opt.max_probed_edits) * min(opt.probe_size, len(trainset))
        per_step["probe"] = {"calls": attempts * turns_per_rollout,
                             "prompt_tokens": attempts * turns_per_rollout * rollout_prompt}
    for stage in per_step.values():
        stage["calls"] *= TRIES
        stage["prompt_tokens"] *= TRIES
        stage["completion_tokens"] = stage["calls"] * max_tokens
    total = {k: steps * sum(s[k] for s in per_step.values()) for k in ("calls", "prompt_tokens", "completion_tokens")}
    return {"steps": steps, "per_step_upper_bound": per_step, "total_upper_bound": total}


def _paper_step(opt, rollout: dict, batch: int, sizes: tuple[int, int, int]) -> dict:
    """The paper's path per step: a summary per attempt, an advantage call per group, one consolidation (`sizes`: the
    tokens of a query, of a full library, and a reply's cap)."""
    (query, library, max_tokens), G = sizes, opt.num_generations
    return {
        "rollout": rollout,
        "summary": {"calls": batch * G, "prompt_tokens": batch * G * (LEARNING_PROMPT_OVERHEAD + query + library + max_tokens)},
        "advantage": {"calls": batch, "prompt_tokens": batch * (LEARNING_PROMPT_OVERHEAD + query + library + G * max_tokens)},
        "consolidation": {"calls": 1, "prompt_tokens": LEARNING_PROMPT_OVERHEAD + library
                          + batch * opt.max_operations_per_group * 60},
    }


def attribution_runs(knobs, trainset_size: int, queries: int) -> dict:
    """Upper bound of the attribution's program runs (`attribution`, worth.py) on `queries` held-out queries: the
    items are at most every experience the steps can add (or max_experiences) and max_demos; leave-one-out runs each
    query with all items, none, the control and each item left out; Shapley runs up to one subset per item and
    sampled order; prune tries up to one more subset per item, then checks two programs on the other half."""
    if not knobs.attribution or not queries:
        return {"items": 0, "runs": 0, "method": None}
    added = knobs.total_steps(trainset_size) * knobs.batch_size * knobs.max_operations_per_group
    items = min(knobs.max_experiences if knobs.max_experiences is not None else added, added) + knobs.max_demos
    choose = (queries + 1) // 2 if knobs.prune else queries
    shapley = items > knobs.attribution_max_items
    per_query = knobs.attribution_permutations * items + 2 if shapley else items + 3
    per_query += items if knobs.prune else 0
    return {"items": items, "runs": choose * per_query + 2 * (queries - choose),
            "method": "shapley" if shapley else "leave-one-out"}
