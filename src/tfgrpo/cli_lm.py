"""`tfgrpo lm ...`: the embedded model's server kept up between runs."""
from __future__ import annotations

import typer
from rich.console import Console

from tfgrpo.cli_help import HELP_OPTIONS, HelpCommand, HelpGroup
from tfgrpo.local_model import DEFAULT_SPECULATIVE, SPECULATIVE, start_detached, status, stop_detached
from tfgrpo.local_weights import DEFAULT_MODEL, MODELS

lm_app = typer.Typer(no_args_is_help=True, cls=HelpGroup, context_settings=HELP_OPTIONS,
                     help="Manage the embedded local model server.")
console = Console()


@lm_app.command("start", cls=HelpCommand)
def lm_start(model: str = typer.Option(DEFAULT_MODEL, metavar="NAME", help=f"the model: {' | '.join(MODELS)}"),
             n_ctx: int = typer.Option(8192, metavar="TOKENS", help="the context window"),
             speculative: str = typer.Option(DEFAULT_SPECULATIVE, metavar="MODE",
                                             help=f"how tokens are drafted: {' | '.join(SPECULATIVE)}"),
             parallel: int = typer.Option(None, metavar="N", help="requests decoded together (llama-server; default: "
                                          "cores/2, at most 4)")) -> None:
    """Start the embedded model server in the background (reused by later runs until `tfgrpo lm stop`)."""
    info = start_detached(model, n_ctx=n_ctx, speculative=speculative, parallel=parallel)
    console.print(f"serving {info.model} at {info.api_base} by {info.engine}, {info.parallel} slot(s), speculative "
                  f"{info.speculative} (pid {info.pid}, log {info.log_path})", markup=False, highlight=False)


@lm_app.command("stop", cls=HelpCommand)
def lm_stop() -> None:
    """Stop the background server."""
    console.print("stopped" if stop_detached() else "no server was running")


@lm_app.command("status", cls=HelpCommand)
def lm_status() -> None:
    """Is a background server running, and where?"""
    info = status()
    console.print(f"{info.model} at {info.api_base}, {info.parallel} slot(s), speculative {info.speculative} (pid {info.pid})"
                  if info else "no server running", markup=False, highlight=False)
