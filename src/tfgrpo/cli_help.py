"""How the `tfgrpo` command line reads: typer's help without its placeholders, `--version`, and the reference
config that ships inside the package (`tfgrpo config --reference`)."""

from __future__ import annotations

import importlib.metadata
import re
from importlib.resources import files

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

REFERENCE = "reference.toml"  # every config field with its default, beside this module (configs/reference.toml)
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}  # the Typers' context_settings: -h works as --help everywhere


# the click convention's word for an option value's type, where the option names none of its own (`--api-base URL`)
PLACEHOLDERS = {"path": "PATH", "str": "TEXT", "int": "INTEGER", "float": "FLOAT"}


def _no_type(ctx) -> None:
    """An argument's type in the help: none, its metavar (CONFIG, RUN_DIR) says what it is."""
    return None


class _Plain:
    """typer writes `<bool>` beside a flag, which takes no value, a lower-case type beside every other parameter
    (`CONFIG <path>`, `--api-base <str>`, `RUN_DIR <list[Path]>`) and braces around a required argument in the
    usage line (`compile [OPTIONS] {config}`); here a flag has no placeholder, an option's value one upper-case word
    (its metavar, else `PLACEHOLDERS`), an argument only its name, and the usage reads `compile [OPTIONS] CONFIG`."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if isinstance(param, TyperArgument):
                param.metavar = param.metavar or param.name.upper()
                param.display_type_rich = _no_type
            elif getattr(param, "is_bool_flag", False) and param.metavar is None:
                param.metavar = ""
            elif param.metavar is None:
                kind = param.display_type(ctx).strip("<>")
                param.metavar = PLACEHOLDERS.get(kind, kind.upper())
        return params

    def collect_usage_pieces(self, ctx):
        return [re.sub(r"^\{(.+)\}(\.\.\.)?$", r"\1\2", piece) for piece in super().collect_usage_pieces(ctx)]


class HelpCommand(_Plain, TyperCommand):
    pass


class HelpGroup(_Plain, TyperGroup):
    def get_command(self, ctx, name):
        """The command, its line in the list its docstring's first paragraph as one flowing text (the docstring's own
        line breaks would break the list's lines where the terminal's width does not)."""
        command = super().get_command(ctx, name)
        if command is not None and command.short_help is None and command.help:
            command.short_help = " ".join(command.help.split("\n\n")[0].split())
        return command


def reference_text() -> str:
    """The reference config: every section and field, with its default and what it does."""
    return files("tfgrpo").joinpath(REFERENCE).read_text(encoding="utf-8")


def version() -> str:
    try:
        return importlib.metadata.version("tfgrpo")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tfgrpo {version()}")
        raise typer.Exit()


VERSION = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="print the version and exit")


def options_reference(group) -> str:
    """Every command of the `tfgrpo` app (`group`, as typer builds it) with its arguments and options, as Markdown
    (docs/cli.md holds it between its `options` markers)."""
    lines = []

    def walk(command, path: list[str]) -> None:
        if getattr(command, "commands", None):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        ctx = command.context_class(command, info_name=" ".join(path))
        params = [p for p in command.get_params(ctx) if p.name != "help"]
        usage = " ".join([*path, *(p.metavar or p.name.upper() for p in params if isinstance(p, TyperArgument))])
        summary = (command.help or "").strip().split("\n\n")[0].replace("\n", " ")
        lines.extend([f"**`{usage}`**: {summary}", ""])
        for p in params:
            if isinstance(p, TyperArgument):
                lines.append(f"- `{p.metavar or p.name.upper()}`: {p.help or ''}".rstrip())
                continue
            flags = ", ".join(f"`{o}{' ' + p.metavar if p.metavar else ''}`" for o in [*p.opts, *p.secondary_opts])
            default = "" if getattr(p, "is_flag", False) or p.default in (None, "") else f" (default {p.default})"
            lines.append(f"- {flags}: {p.help or ''}{default}")
        if params:
            lines.append("")

    walk(group, ["tfgrpo"])
    return "\n".join(lines)
