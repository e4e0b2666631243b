"""The plots: learning dynamics per step (mean train reward, library size, and tool calls for a task that has
tools), one line per run; and the benchmarks' held-out score against compile cost, one point per optimizer."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure  # a figure of its own, not pyplot's: no backend is chosen for the process
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox

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
    """`points`: (arm, compile calls, held-out score, CI low, CI high) per arm. Drawn to be read on a phone as on a
    laptop: a figure 5.5 in wide whose text is 11-13 pt (about 11 px high when the image is shown 360 px wide), each
    point numbered by its rank (1: the highest held-out score) beside it, where the number covers no other number and
    no marker, and below the axes a key in one column, in rank order: number, arm, held-out score. Points that
    nearly coincide share one number label ("3,5"). Squares are tfgrpo's arms, circles DSPy's optimizers, the
    diamond the uncompiled baseline. The PNG names the arms it draws in its metadata (`arms`, one per line, in rank
    order), so a check can compare them with a table's rows."""
    arms = sorted(points, key=lambda p: (-p[2], p[1], p[0]))
    rows = len(arms) + 1  # the key's lines, its title included
    axes_h, key_h = 3.8, 0.25 * rows  # inches; 0.25 in a line of 12 pt text
    fig = Figure(figsize=(5.5, axes_h + key_h + 1.1))
    FigureCanvasAgg(fig)  # a renderer, to measure the number labels
    height = fig.get_figheight()
    ax = fig.add_axes((0.16, (key_h + 0.7) / height, 0.8, axes_h / height))
    colors = [f"C{i}" for i in range(10) if i != 7] + ["black", "navy", "magenta", "lime", "darkgoldenrod", "teal",
                                                          "olive"]  # C7 is the baseline's gray
    palette = iter(colors * len(arms))
    for rank, (arm, calls, mean, lo, hi) in enumerate(arms, 1):
        marker = "D" if arm == "baseline" else "s" if arm.startswith("tfgrpo") else "o"
        ax.errorbar([calls], [mean], yerr=[[mean - lo], [hi - mean]], fmt=marker, capsize=3, markersize=7,
                    color="gray" if arm == "baseline" else next(palette), label=f"{rank}. {arm} ({mean:.2f})")
    ax.set_xlabel("LM calls to compile (mean per seed)", fontsize=12)
    ax.set_ylabel("held-out score (share solved,\n95% CI over problems)", fontsize=12)
    ax.set_title(title, fontsize=13)
    ax.tick_params(labelsize=11)
    ax.grid(alpha=0.3)
    ax.set_xlim(ax.get_xlim())  # the limits fixed before the labels are placed in them
    ax.set_ylim(ax.get_ylim())
    _number_points(ax, [(calls, mean) for _, calls, mean, _, _ in arms])
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, title="rank. arm (held-out score)", fontsize=12, title_fontsize=12, loc="upper left",
               bbox_to_anchor=(0.02, key_h / height), borderaxespad=0, frameon=False, handletextpad=0.4,
               labelspacing=0.35, alignment="left")
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1,
                metadata={"arms": "\n".join(arm for arm, *_ in arms)})
    return path


# Where a point's number may go, in points from the point: beside it first, then above or below it, then diagonally.
_PLACES = [((7, 0), "left", "center"), ((-7, 0), "right", "center"), ((0, 7), "center", "bottom"),
           ((0, -7), "center", "top"), ((6, 6), "left", "bottom"), ((6, -6), "left", "top"),
           ((-6, 6), "right", "bottom"), ((-6, -6), "right", "top")]


def _number_points(ax, xy: list[tuple[float, float]]) -> None:
    """Write each point's rank (1..n, in the order of `xy`) beside it. A point within a marker's width of an earlier
    one shares its label ("3,5"). Each label takes the first place of `_PLACES` where it overlaps no marker, no
    label written before and nothing outside the axes; where every place overlaps, the one that overlaps least."""
    renderer = ax.figure.canvas.get_renderer()
    at = [tuple(ax.transData.transform(p)) for p in xy]  # in pixels
    groups: list[list[int]] = []
    for i, (x, y) in enumerate(at):
        near = next((g for g in groups if abs(at[g[0]][0] - x) < 8 and abs(at[g[0]][1] - y) < 8), None)
        if near:
            near.append(i)
        else:
            groups.append([i])
    half = 6  # half a marker's width, in pixels
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in at]
    frame = ax.get_window_extent(renderer)

    def overlap(box: Bbox) -> float:
        inside = Bbox.intersection(box, frame)
        outside = box.width * box.height - (inside.width * inside.height if inside else 0)
        return outside + sum(b.width * b.height for b in (Bbox.intersection(box, t) for t in taken) if b)

    for group in groups:
        best = None
        for offset, ha, va in _PLACES:
            label = ax.annotate(",".join(str(i + 1) for i in group), xy[group[0]], xytext=offset,
                                textcoords="offset points", fontsize=11, fontweight="bold", ha=ha, va=va)
            cost = overlap(label.get_window_extent(renderer))
            if best is None or cost < best[0]:
                if best:
                    best[1].remove()
                best = (cost, label)
            else:
                label.remove()
            if cost == 0:
                break
        taken.append(best[1].get_window_extent(renderer))
