"""`tfgrpo report`: the paper-shaped table and learning-dynamics plot, rebuilt from saved results alone.

A run directory holds `eval/baseline.jsonl`, `eval/compiled.jsonl` (one row per problem and run) and
`steps.jsonl` (per-step stats). Nothing here calls a model.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from tfgrpo.evaluate import paired_difference, read_rows, summarize


def _mean_ci(rows: list[dict], *, seed: int = 0, resamples: int = 5000) -> tuple[float, float, float]:
    """Mean@k with a 95% bootstrap CI over problems."""
    per: dict[int, list[float]] = {}
    for r in rows:
        per.setdefault(r["problem"], []).append(r["score"])
    means = [statistics.fmean(v) for v in per.values()]
    rng = random.Random(seed)
    boot = sorted(statistics.fmean(rng.choices(means, k=len(means))) for _ in range(resamples))
    return statistics.fmean(means), boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]


def _learning_cost(steps: list[dict]) -> tuple[int, int]:
    prompt = completion = 0
    for s in steps:
        for usage in s.get("usage", {}).values():
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
    return prompt, completion


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    evals = {p.stem: read_rows(p) for p in sorted((run_dir / "eval").glob("*.jsonl"))}
    if not evals:
        raise ValueError(f"{run_dir}: no eval/*.jsonl results (run `tfgrpo evaluate` first)")
    steps_path = run_dir / "steps.jsonl"
    steps = [json.loads(x) for x in steps_path.read_text().splitlines() if x.strip()] if steps_path.exists() else []
    library = run_dir / "library.json"
    size = len(json.loads(library.read_text())["experiences"]) if library.exists() else None
    return {"name": run_dir.name, "evals": evals, "steps": steps, "library_size": size}


def markdown(runs: list[dict]) -> str:
    lines = ["| run | program | problems x k | Mean@k [95% CI] | Pass@k | tool calls | vs baseline [95% CI] "
             "| experiences | learning tokens in/out |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        base = run["evals"].get("baseline")
        prompt, completion = _learning_cost(run["steps"])
        for name, rows in run["evals"].items():
            s = summarize(rows)
            mean, lo, hi = _mean_ci(rows)
            diff = "-"
            if base is not None and name != "baseline":
                p = paired_difference(base, rows)
                diff = f"{p['difference']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}]"
            learned = name != "baseline"
            lines.append(f"| {run['name']} | {name} | {s['problems']} x {s['k']} | {mean:.3f} [{lo:.3f}, {hi:.3f}] "
                         f"| {s['pass_at_k']:.3f} | {s['tool_calls_per_problem']:.2f} | {diff} "
                         f"| {run['library_size'] if learned and run['library_size'] is not None else '-'} "
                         f"| {f'{prompt}/{completion}' if learned and run['steps'] else '-'} |")
    return "\n".join(lines) + "\n"


def dynamics_plot(runs: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [r for r in runs if r["steps"]]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for run in runs:
        xs = [s["step"] for s in run["steps"]]
        for ax, key in zip(axes, ("mean_reward", "tool_calls_mean", "library_size")):
            ax.plot(xs, [s.get(key, 0) for s in run["steps"]], marker="o", label=run["name"])
    for ax, title in zip(axes, ("mean train reward", "tool calls per attempt", "library size")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(run_dirs: list[Path], out: Path) -> tuple[Path, Path | None]:
    runs = [load_run(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    plot = dynamics_plot(runs, out / "report.png")
    text = "# tfgrpo report\n\n" + markdown(runs)
    if plot:
        text += f"\n![learning dynamics]({plot.name})\n"
    md.write_text(text)
    return md, plot
