"""The plots: learning dynamics per step (mean train reward, library size, and tool calls for a task that has
tools), one line per run; and the benchmarks' held-out score against compile cost, one point per optimizer."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # a figure of its own, not pyplot's: no backend is chosen for the process
from matplotlib.ticker import MaxNLocator

# Each step rolls out on its own batch of problems, so the reward panel compares batches, not one fixed probe set.
PANELS = (("mean reward of the step's attempts\n(each step: other problems)", "mean_reward"),
          ("library size after the step", "library_size"), ("tool calls per attempt", "tool_calls_mean"))


def panels(runs: dict[str, list[dict]]) -> tuple[tuple[str, str], ...]:
    """The panels a learning curve of `runs` has: the tool-calls panel only where an attempt called a tool."""
    tools = any(s.get("tool_calls_mean") for steps in runs.values() for s in steps)
    return PANELS if tools else tuple(p for p in PANELS if p[1] != "tool_calls_mean")


def learning_curve(runs: dict[str, list[dict]], path: Path, title: str = "Training-Free GRPO") -> Path:
    """`runs` maps a run's name to its per-step stats (`steps.jsonl` rows)."""
    shown = panels(runs)
    fig = Figure(figsize=(4 * len(shown), 3.4))
    axes = fig.subplots(1, len(shown))
    with_demos = any("demos" in s for steps in runs.values() for s in steps)  # a max_demos run is among them
    for name, steps in runs.items():
        xs = [s["step"] for s in steps]
        for ax, (_, key) in zip(axes, shown):
            ax.plot(xs, [s.get(key, 0.0) for s in steps], marker="o", label=name)
        if with_demos:  # the demos kept, next to the experiences
            axes[1].plot(xs, [len(s.get("demos", [])) for s in steps], marker="s", linestyle="--",
                         label=f"{name}: demos")
    for ax, (label, _) in zip(axes, shown):
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-0.05, 1.05)
    for ax in axes[1:]:  # counts: from zero, whole numbers
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    if with_demos:
        axes[1].set_title("experiences (solid) and demos (dashed)\nafter the step", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def score_against_cost(points: list[tuple[str, float, float, float, float]], path: Path, title: str) -> Path:
    """`points`: (arm, compile calls, held-out score, CI low, CI high) per arm. Each arm has its own colour and is
    named in the legend (highest score first), never beside its point, where close arms' names would overlap:
    squares are tfgrpo's arms, circles DSPy's optimizers, the diamond the uncompiled baseline."""
    fig = Figure(figsize=(10, 4.8))
    ax = fig.subplots()
    colors = [f"C{i}" for i in range(10) if i != 7] + ["black", "navy", "magenta", "lime", "darkgoldenrod", "teal",
                                                          "olive"]  # C7 is the baseline's gray
    arms = sorted(points, key=lambda p: -p[2])
    palette = iter(colors * len(arms))
    for arm, calls, mean, lo, hi in arms:
        marker = "D" if arm == "baseline" else "s" if arm.startswith("tfgrpo") else "o"
        ax.errorbar([calls], [mean], yerr=[[mean - lo], [hi - mean]], fmt=marker, capsize=4, markersize=7,
                    color="gray" if arm == "baseline" else next(palette), label=f"{arm} ({mean:.2f})")
    ax.set_xlabel("LM calls to compile (mean per seed)")
    ax.set_ylabel("held-out score\n(share solved, 95% CI over problems)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title="arm (held-out score)", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1),
              borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
