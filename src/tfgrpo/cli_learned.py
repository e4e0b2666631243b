"""`tfgrpo show NAME` and `tfgrpo evaluate NAME`: a shipped learned program (tfgrpo/learned.py) at the terminal,
and the demos of any program file."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tfgrpo.learned import Learned, describe, evaluate, find, names
from tfgrpo.progress import RunBars, progress_display


CONFIG_OR_NAME = typer.Argument(..., metavar="CONFIG|NAME", help="the run's TOML config, or the name of a shipped "
                                "learned program (tfgrpo show NAME)")
FILE_OR_NAME = typer.Argument(..., metavar="FILE|NAME", help="a library.json or program.json, or the name of a "
                              "shipped learned program: " + ", ".join(names()))
API_BASE = typer.Option(None, "--api-base", metavar="URL", help="with a NAME: an OpenAI-compatible endpoint that "
                        "serves the program's model, instead of the embedded server")


def shipped(argument: Path) -> Learned | None:
    """The shipped program a command's argument names; None when it names a file, a ValueError when neither."""
    if argument.exists():
        return None
    if (learned := find(str(argument))) is None:
        raise ValueError(f"{argument}: no such file, and no shipped program of that name (there are: "
                         f"{', '.join(names())})")
    return learned


def print_provenance(learned: Learned, console: Console) -> None:
    console.print("\n".join(describe(learned)), markup=False, highlight=False, soft_wrap=True)


def print_demos(state: dict, console: Console) -> None:
    """The demos a saved program carries, per predictor, each field on its own line (code as written)."""
    demos = [(name, demo) for name, part in state.items() if isinstance(part, dict)
             for demo in part.get("demos", []) if isinstance(demo, dict)]
    if not demos:
        return
    table = Table(title=f"demos ({len(demos)})", show_lines=True)
    for col in ("predictor", "demo"):
        table.add_column(col, overflow="fold")
    for name, demo in demos:
        table.add_row(Text(name), Text("\n".join(f"{k}: {v}" for k, v in demo.items() if not k.startswith("_"))))
    console.print(table)


def evaluate_shipped(learned: Learned, api_base: str | None, console: Console) -> dict:
    """Score the program on its held-out split with the sampling its provenance states, and say how this run
    compares with the stated score."""
    print_provenance(learned, console)
    with progress_display(console) as progress:
        result = evaluate(learned, api_base=api_base, progress=RunBars(progress, 1, plain_lines=not console.is_terminal))
    stated, (low, high) = result["stated"], result["ci95"]
    inside = "inside" if low <= stated["solved"] / stated["problems"] <= high else "outside"
    console.print(f"{learned.name}: solved {result['solved']:g} of {result['problems']} ({result['score']:.3f}, 95% "
                  f"bootstrap CI {low:.3f} .. {high:.3f} over problems) in {result['rows'][0]['wall_s']:.0f} s; "
                  f"stated: {stated['solved']} of {stated['problems']}, {inside} this run's CI", markup=False,
                  highlight=False, soft_wrap=True)
    return result
