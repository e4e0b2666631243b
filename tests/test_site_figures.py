"""The results page's plots show what its tables show. docs/results.md includes each task's table
(benchmarks/results/peers/<task>/table.md) and shows its plot (docs/assets/peers-<task>.png); the plot is
benchmarks/results/peers/<task>/peers.png, drawn by `python -m benchmarks.peers --task <task> --report --out
benchmarks/results/peers` from the saved results, one point per row of the table. The PNG names the arms it draws in
its metadata, so a plot drawn before the table or the results changed is found here."""

from __future__ import annotations

import filecmp
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "results" / "peers"
TASKS = ("game24", "gsm8k")
REDRAW = "redraw it: python -m benchmarks.peers --task {task} --report --out benchmarks/results/peers"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import peers
    finally:
        sys.path.remove(str(ROOT))
    return peers


@pytest.mark.parametrize("task", TASKS)
def test_the_plot_draws_the_arms_of_the_table_from_the_saved_results(task, peers):
    rows = peers.table_arms(PEERS / task / "table.md")
    assert rows and len(rows) == len(set(rows)), rows
    points = peers.plot_points(peers.load_results(PEERS, task), rows)  # every row has saved results
    ranked = [arm for arm, *_ in sorted(points, key=lambda p: (-p[2], p[1], p[0]))]
    drawn = Image.open(PEERS / task / "peers.png").text.get("arms", "").split("\n")
    assert drawn == ranked, f"peers.png draws {drawn}, the table and the saved results give {ranked}: " + REDRAW.format(
        task=task)


@pytest.mark.parametrize("task", TASKS)
def test_the_page_shows_the_plot_of_the_results_beside_its_table(task):
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert f'--8<-- "benchmarks/results/peers/{task}/table.md"' in page
    assert f"](assets/peers-{task}.png)" in page
    shown = ROOT / "docs" / "assets" / f"peers-{task}.png"
    assert filecmp.cmp(shown, PEERS / task / "peers.png", shallow=False), (
        f"{shown.relative_to(ROOT)} is not benchmarks/results/peers/{task}/peers.png")


def test_the_plot_reads_on_a_phone(tmp_path):
    """5.5 in wide (its 11-13 pt text about 11 px high at 360 px), the key under the axes, one line per arm."""
    from tfgrpo.plots import score_against_cost

    points = [(f"arm-{i}", 10.0 * i, i / 25, i / 25 - 0.1, i / 25 + 0.1) for i in range(21)]
    path = score_against_cost(points, tmp_path / "plot.png", "a title")
    image = Image.open(path)
    width, height = image.size
    assert width / image.info["dpi"][0] <= 6 and height > 1.5 * width
    assert image.text["arms"].split("\n") == [f"arm-{i}" for i in reversed(range(21))]  # by score, highest first
