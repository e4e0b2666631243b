"""The learning curve of a run: mean train reward, library size and tool calls per step, as one PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def learning_curve(steps: list[dict], path: Path, title: str = "Training-Free GRPO") -> Path:
    xs = [s["step"] for s in steps]
    series = [("mean train reward", [s["mean_reward"] for s in steps]),
              ("library size", [s["library_size"] for s in steps]),
              ("tool calls per attempt", [s.get("tool_calls_mean", 0.0) for s in steps])]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (label, ys) in zip(axes, series):
        ax.plot(xs, ys, marker="o")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-0.05, 1.05)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
