"""mkdocs hook: where a reader gets the code. The address is pyproject.toml's `[project.urls]` (`Repository`, else
`Source`, else `Homepage`), declared there once: with one, the site links it (`repo_url`) and each `<!-- get the
code -->` line of a page becomes the clone command; with none, that line says so and how the commands below it are
run, and no address is made up."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MARKER = "<!-- get the code -->"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def address(pyproject: Path = PYPROJECT) -> str | None:
    """The repository's public address, or None where pyproject.toml names none."""
    urls = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("urls", {})
    return next((urls[k] for k in ("Repository", "Source", "Homepage") if urls.get(k)), None)


def get_the_code(url: str | None) -> str:
    """The Markdown a page shows in place of the marker."""
    if url:
        return f"Get the code with `git clone {url} tfgrpo && cd tfgrpo`, then, in that folder:"
    return ("tfgrpo is not published at a public address (its `pyproject.toml` names none under `[project.urls]`): "
            "run these in the root of the copy of its repository you were given:")


def on_config(config, **kwargs):
    if url := address():
        config["repo_url"] = url
    return config


def on_page_markdown(markdown: str, **kwargs) -> str:
    return markdown.replace(MARKER, get_the_code(address())) if MARKER in markdown else markdown
