"""`tfgrpo report`: the paper-shaped table and learning-dynamics plot, rebuilt from saved results alone.

A run directory holds `eval/baseline.jsonl`, `eval/compiled.jsonl` (one row per problem and run),
`steps.jsonl` (per-step stats) and, after a compile with `attribution`, `worth.json` (what each learned item is worth).
Nothing here calls a model.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tfgrpo.evaluate import bootstrap_ci, paired_difference, per_problem, read_rows, summarize
from tfgrpo.plots import learning_curve


def _mean_ci(rows: list[dict]) -> tuple[float, float, float]:
    """Mean@k with a 95% bootstrap CI over problems."""
    means = [statistics.fmean(v) for v in per_problem(rows).values()]
    return (statistics.fmean(means), *bootstrap_ci(means, resamples=5000))


def _learning_cost(steps: list[dict]) -> tuple[int, int]:
    prompt = completion = 0
    for s in steps:
        for usage in s.get("usage", {}).values():
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
    return prompt, completion


WORTH_KEYS = ("method", "queries", "score", "program_runs", "items", "pruned", "library", "library_ci95", "control",
              "control_ci95")


def _saved(path: Path, keys: tuple[str, ...] = ()) -> dict | None:
    """A saved JSON object with `keys`, or None where the file is absent; a clear ValueError for one that is not."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc}); it was cut short or edited: delete it, or compile "
                         "again into a new folder") from None
    missing = [k for k in keys if k not in data] if isinstance(data, dict) else ["(a JSON object)"]
    if missing:
        raise ValueError(f"{path}: lacks {', '.join(missing)}: written by another version of tfgrpo, or edited; "
                         "delete it, or compile again into a new folder")
    return data


def load_run(run_dir: Path) -> dict:
    """A run directory's saved results; a ValueError that says what is missing (the folder, or its evaluation)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"no such folder: {run_dir}")
    evals = {p.stem: read_rows(p) for p in sorted((run_dir / "eval").glob("*.jsonl"))}
    if not evals:
        raise ValueError(f"{run_dir}: no eval/*.jsonl results (run `tfgrpo evaluate` first)")
    steps = read_rows(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").exists() else []
    library = _saved(run_dir / "library.json", ("experiences",))
    return {"name": run_dir.name, "evals": evals, "steps": steps,
            "library_size": len(library["experiences"]) if library else None,
            "worth": _saved(run_dir / "worth.json", WORTH_KEYS),
            "refit": _saved(run_dir / "refit.json", WORTH_KEYS),
            "limits": _saved(run_dir / "limits.json", ("summary", "stopped"))}


def limits_line(name: str, limits: dict) -> str:
    """What limited a run (the compile's `detailed_results.limits`) in one line: its summary, as the log said it."""
    calls = ", ".join(f"{stage} {n}" for stage, n in limits.get("calls", {}).items())
    return f"- {name}: {limits['summary']}. Calls by stage: {calls or 'none'}. Stopped: {limits['stopped']}."


def worth_markdown(worth: dict, title: str = "What each learned item is worth") -> str:
    """A `WorthResult` (as data) as a Markdown table: each item's worth with its CI (and, for a refit's carried item,
    where it was learned and its worth there), then the two controls."""
    def ci(pair) -> str:
        return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"

    pruned = set(worth["pruned"])
    lines = [f"{title} ({worth['method']}, {worth['queries']} held-out queries, score "
             f"{worth['score']:.3f} with every item; {worth['program_runs']} program runs):", "",
             "| item | kind | worth [95% CI] | text |", "|---|---|---|---|"]
    for item in worth["items"]:
        text = item["text"].replace("|", "\\|").replace("\n", " ")
        if there := item.get("learned_on"):
            was = "not measured" if there.get("worth") is None else f"{there['worth']:+.3f}"
            text = f"{text} (learned with {', '.join(there.get('policy') or ['?'])}: worth there {was})"
        lines.append(f"| {item['id']}{' (pruned)' if item['id'] in pruned else ''} | {item['kind']} | "
                     f"{item['worth']:+.3f} {ci(item['ci95'])} | {text} |")
    lines += [f"| all items | vs nothing learned | {worth['library']:+.3f} {ci(worth['library_ci95'])} | |",
              f"| all items | vs an irrelevant text of their length | {worth['control']:+.3f} "
              f"{ci(worth['control_ci95'])} | |"]
    if check := worth.get("prune_check"):
        lines += ["", f"Pruning {', '.join(check['dropped'])}: {check['difference']:+.3f} {ci(check['ci95'])} against "
                      f"the unpruned program on {check['queries']} other queries; the {check['kept']} program is kept."]
    return "\n".join(lines) + "\n"


def uses_tools(runs: list[dict]) -> bool:
    """Whether any evaluated program of `runs` called a tool: the tool-calls column is for a task that has tools."""
    return any(summarize(rows)["tool_calls_per_problem"] for run in runs for rows in run["evals"].values())


def markdown(runs: list[dict]) -> str:
    """The results table, one row per run and program; the tool-calls column only where a program called tools."""
    tools = uses_tools(runs)
    columns = ["run", "program", "problems x k", "Mean@k [95% CI]", "Pass@k", "other metrics",
               *(["tool calls"] if tools else []), "vs baseline [95% CI]", "experiences", "learning tokens in/out"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
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
            others = ", ".join(f"{k} {v:.3f}" for k, v in s["metrics"].items()) or "-"  # web: judge / EM / F1
            calls = f"| {s['tool_calls_per_problem']:.2f} " if tools else ""
            lines.append(f"| {run['name']} | {name} | {s['problems']} x {s['k']} | {mean:.3f} [{lo:.3f}, {hi:.3f}] "
                         f"| {s['pass_at_k']:.3f} | {others} {calls}| {diff} "
                         f"| {run['library_size'] if learned and run['library_size'] is not None else '-'} "
                         f"| {f'{prompt}/{completion}' if learned and run['steps'] else '-'} |")
    return "\n".join(lines) + "\n"


def build_report(run_dirs: list[Path], out: Path) -> tuple[Path, Path | None]:
    runs = [load_run(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    with_steps = {r["name"]: r["steps"] for r in runs if r["steps"]}
    plot = learning_curve(with_steps, out / "report.png", title="learning dynamics") if with_steps else None
    text = "# tfgrpo report\n\n" + markdown(runs)
    if lines := [limits_line(r["name"], r["limits"]) for r in runs if r["limits"]]:
        text += "\nWhat limited each run:\n\n" + "\n".join(lines) + "\n"
    for run in runs:
        if run["refit"]:
            text += f"\n## {run['name']}: the refit\n\n" + worth_markdown(
                run["refit"], "What each carried item is worth on this model")
        if run["worth"]:
            text += f"\n## {run['name']}\n\n" + worth_markdown(run["worth"])
    if plot:
        text += f"\n![learning dynamics]({plot.name})\n"
    md.write_text(text)
    return md, plot
