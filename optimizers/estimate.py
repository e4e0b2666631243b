"""A `--dry-run` estimate of what a Training-Free GRPO run will send, before anything is spent.

Call counts are upper bounds: every group is assumed to have contrast, and every call to be sent twice (a
learning reply that does not parse is asked for once more; a student's reply that does not parse is re-asked
by DSPy's JSON fallback). Token counts are rough: prompt sizes come from the program's instructions and the
training queries at ~4 characters per token, with a full library in the prompt; completions are counted at
the LM's `max_tokens` cap.
"""

from __future__ import annotations

import statistics

CHARS_PER_TOKEN = 4
LEARNING_PROMPT_OVERHEAD = 400  # tokens of instructions and formatting in a learning call
TRIES = 2  # the most times one call is sent: once, and once more when its reply does not parse


def estimate_run(optimizer, student, trainset: list, *, turns_per_rollout: int = 1, max_tokens: int = 512,
                 learning_path: str = "paper") -> dict:
    """`learning_path`: "paper" (summaries, advantages, consolidation) or "contrast" (one call per pair of
    attempts, plus at most one rewrite of a rule that repeated its query)."""
    opt = optimizer
    steps = opt.total_steps(len(trainset))
    batch = min(opt.batch_size, len(trainset))
    G = opt.num_generations
    instructions = sum(len(p.signature.instructions) for _, p in student.named_predictors()) // CHARS_PER_TOKEN
    query = int(statistics.fmean(len(str(x.inputs().toDict())) for x in trainset)) // CHARS_PER_TOKEN
    library = (opt.max_experiences or 40) * int(opt.max_words_per_experience * 1.4)  # a full library, in tokens
    rollout_prompt = instructions + query + library + (turns_per_rollout - 1) * max_tokens // 2
    rollout = {"calls": batch * G * turns_per_rollout, "prompt_tokens": batch * G * turns_per_rollout * rollout_prompt}
    if learning_path == "contrast":
        pairs = batch * min(opt.max_operations_per_group, G // 2)
        per_step = {"rollout": rollout, "contrast": {
            "calls": 2 * pairs, "prompt_tokens": 2 * pairs * (LEARNING_PROMPT_OVERHEAD + query + library + 2 * max_tokens)}}
    else:
        per_step = _paper_step(opt, rollout, batch, G, query, library, max_tokens)
    for stage in per_step.values():
        stage["calls"] *= TRIES
        stage["prompt_tokens"] *= TRIES
        stage["completion_tokens"] = stage["calls"] * max_tokens
    total = {k: steps * sum(s[k] for s in per_step.values()) for k in ("calls", "prompt_tokens", "completion_tokens")}
    return {"steps": steps, "per_step_upper_bound": per_step, "total_upper_bound": total}


def _paper_step(opt, rollout: dict, batch: int, G: int, query: int, library: int, max_tokens: int) -> dict:
    return {
        "rollout": rollout,
        "summary": {"calls": batch * G, "prompt_tokens": batch * G * (LEARNING_PROMPT_OVERHEAD + query + library + max_tokens)},
        "advantage": {"calls": batch, "prompt_tokens": batch * (LEARNING_PROMPT_OVERHEAD + query + library + G * max_tokens)},
        "consolidation": {"calls": 1, "prompt_tokens": LEARNING_PROMPT_OVERHEAD + library
                          + batch * opt.max_operations_per_group * 60},
    }
