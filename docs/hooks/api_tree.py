"""mkdocs hook: let mkdocstrings find the `tfgrpo.*` packages where pyproject.toml puts them.

pyproject.toml maps `tfgrpo.optimizers` to `optimizers/`, `tfgrpo.programs` to `programs/` and so on (the design
card's top-level folders). griffe, which reads the source for mkdocstrings, looks for a package's submodules inside
the package's own folder, where these are not. So before the build this hook lays out a temporary `tfgrpo/` made of
symbolic links (the files of `tfgrpo/`, plus one link per mapped folder) and points the python handler at it.
Nothing in the repository is written. It also registers runtime_docs.py, the one place where the build imports
tfgrpo: `TrainingFreeGRPO`'s knob docs exist only once the class is imported.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def _tree(root: Path) -> Path:
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tmp = Path(tempfile.mkdtemp(prefix="tfgrpo-api-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    package = tmp / "tfgrpo"
    package.mkdir()
    for entry in (root / mapping["tfgrpo"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry.resolve())
    for name, folder in mapping.items():
        if name.startswith("tfgrpo.") and name.count(".") == 1:
            (package / name.split(".", 1)[1]).symlink_to((root / folder).resolve())
    return tmp


@event_priority(100)  # before mkdocstrings' own on_config, which creates the handler
def on_config(config):
    root = Path(config.config_file_path).resolve().parent
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(_tree(root))]
    # TrainingFreeGRPO's knobs, documented as Python has them after import (runtime_docs.py)
    python.setdefault("options", {})["extensions"] = ["dataclasses", str(Path(__file__).with_name("runtime_docs.py"))]
    return config
