"""Evaluation: k runs per problem, Mean@k / Pass@k, and a paired comparison of two programs.

Both programs see the same problems with the same run indices (run r of every problem uses rollout_id r),
so their difference is measured per problem and the bootstrap resamples problems, which keeps the
comparison paired. Rows are written as JSONL so reports are rebuilt without calling any model again.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import dspy

from tfgrpo.base.util import bootstrap_ci, read_jsonl_rows, write_atomic
from tfgrpo.optimizers.spend import totals
from tfgrpo.optimizers.runner import Run, Scope
from tfgrpo.optimizers.spend import metered
from tfgrpo.optimizers.workers import with_own_lms
from tfgrpo.optimizers.knobs import Knobs
from tfgrpo.optimizers.rewards import MetricError, call_metric


def evaluate_program(program: dspy.Module, examples: list, metric: Callable, *, lm: dspy.BaseLM, num_runs: int = 1,
                     num_threads: int = 4, name: str = "program",
                     progress: Callable[[str, int, int], None] | None = None,
                     extra_metrics: dict[str, Callable] | None = None, backend: str = "threads") -> list[dict]:
    """One row per (problem, run): score, tool calls, the extracted answer, and the program's error if it raised
    (scored 0; `failed` when its LM call failed); `extra_metrics` (name -> metric) are scored too, under `metrics`. A
    metric that fails stops the evaluation with a `MetricError`. Runs as a compile's attempts run, on its `backend`
    ("ray": each run a task on a Ray cluster)."""
    program = program.deepcopy()
    program.set_lm(lm)
    candidates = [with_own_lms(program, **({"rollout_id": r} if num_runs > 1 else {})) for r in range(num_runs)]
    jobs = [(i, r) for i in range(len(examples)) for r in range(num_runs)]
    stage = f"evaluate {name}"
    with Run(knobs=Knobs(num_threads=num_threads, progress=progress, backend=backend), metric=metric) as run, \
            Scope(run, stage) as scope:
        attempts = scope.scored(stage, [(candidates[r], examples[i]) for i, r in jobs])
    if raised := next((a.metric_error for a in attempts if a.metric_error), None):  # (a figure is no place for 0s
        raise MetricError(raised)  # the metric made up)
    usage = run.record.usage().get(stage, totals([]))
    rows = []
    for (i, r), a in zip(jobs, attempts):
        row = {"program": name, "problem": i, "run": r, "score": a.reward or 0.0, "feedback": a.feedback,
               "answer": str((a.outputs or {}).get("answer", "")), "tool_calls": a.tool_calls, "error": a.error,
               **({"failed": True} if a.failed else {})}
        if extra_metrics:
            row["metrics"] = {k: call_metric(m, examples[i], a.prediction)[0] if a.outputs is not None else 0.0
                              for k, m in extra_metrics.items()}
        rows.append(row)
    if rows:
        rows[0]["usage_total"] = usage  # tokens of the whole evaluation, kept on the first row
    return rows


def heldout_rows(program: dspy.Module, examples: list, metric: Callable, *, lm: dspy.BaseLM, seed: int,
                 num_threads: int, name: str, progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """The benchmarks' held-out evaluation (benchmarks/peers.py, and `tfgrpo evaluate NAME` of a shipped program):
    one run per example, sampled by `lm` as it is set, under rollout_id `seed`. The first row also holds `wall_s`
    and `eval_calls`, the LM calls made (one per example, more where the program makes several)."""
    started = time.time()
    with metered() as used:
        rows = evaluate_program(program, examples, metric, lm=lm.copy(rollout_id=seed), num_threads=num_threads,
                                name=name, progress=progress)
    if rows:
        rows[0]["wall_s"] = round(time.time() - started, 1)
        rows[0]["eval_calls"] = used.totals()["calls"]
    return rows


def per_problem(rows: list[dict], key: str = "score") -> dict[int, list[float]]:
    """Scores grouped by problem: {problem: [score of run 0, run 1, ...]}; `key` other than "score" names one of
    the rows' extra metrics."""
    scores: dict[int, list[float]] = {}
    for row in rows:
        scores.setdefault(row["problem"], []).append(row["score"] if key == "score" else row["metrics"][key])
    return scores


def summarize(rows: list[dict]) -> dict:
    """Mean@k (mean accuracy over all runs), Pass@k (any run right), pass@1 (run 0), tool calls, tokens."""
    by_problem = per_problem(rows)
    k = max((len(v) for v in by_problem.values()), default=0)
    usage = next((r["usage_total"] for r in rows if "usage_total" in r), {})
    return {
        "problems": len(by_problem), "k": k,
        "mean_at_k": statistics.fmean(statistics.fmean(v) for v in by_problem.values()) if by_problem else 0.0,
        "pass_at_k": statistics.fmean(float(max(v) >= 1.0) for v in by_problem.values()) if by_problem else 0.0,
        "pass_at_1": statistics.fmean(r["score"] for r in rows if r["run"] == 0) if rows else 0.0,
        "tool_calls_per_problem": statistics.fmean(r.get("tool_calls", 0) for r in rows) if rows else 0.0,
        "errors": sum(1 for r in rows if r.get("error")),
        "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
        "metrics": {k: statistics.fmean(statistics.fmean(v) for v in per_problem(rows, k).values())
                    for k in (rows[0].get("metrics") or {})} if rows else {},
    }


def paired_difference(base: list[dict], other: list[dict], *, seed: int = 0, resamples: int = 10_000,
                      key: str = "score") -> dict:
    """Mean per-problem difference (other - base) of `key` with a 95% bootstrap CI over problems."""
    a = {p: statistics.fmean(v) for p, v in per_problem(base, key).items()}
    b = {p: statistics.fmean(v) for p, v in per_problem(other, key).items()}
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two evaluations share no problem")
    diffs = [b[p] - a[p] for p in shared]
    return {"problems": len(shared), "difference": statistics.fmean(diffs),
            "ci95": list(bootstrap_ci(diffs, seed=seed, resamples=resamples)),
            "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs)}


def write_rows(rows: list[dict], path: Path) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_rows(path: Path) -> list[dict]:
    """The rows of a results file (JSON lines); a ValueError naming the file and line for one that does not parse."""
    return [row for _, row in read_jsonl_rows(Path(path))]
