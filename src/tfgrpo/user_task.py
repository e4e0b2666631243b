"""Your own program, metric and data, named in a config's [task] section (`name = "custom"`):

    program = "mypkg.agent:Agent"       # a dspy.Module subclass, a function returning a dspy.Module, or an instance
    metric = "mypkg.agent:metric"       # metric(example, pred, trace=None) or metric(example, pred)
    trainset = "data/train.jsonl"       # JSONL (one object per line) or a JSON list of objects
    input_keys = ["question"]           # the fields of a row the program is called with; the rest are labels

`module:name` is imported with the current folder on `sys.path` (as `python -m` would); `path/to/file.py:name`
imports that file, with its folder on `sys.path`, as a module of its own named after its full path (two files both
called agent.py stay two modules). Data paths are relative to the current folder too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import dspy

from tfgrpo.optimizers.rewards import metric_takes_trace
from tfgrpo.base.util import USER_MODULE_PREFIX, read_jsonl_rows

FORMS = "'module:name' or 'path/to/file.py:name'"


def import_object(spec: str, field: str) -> Any:
    """The object `spec` names; a ValueError that names the config field `task.<field>` when it cannot be had."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"task.{field} = {spec!r}: expected {FORMS}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise ValueError(f"task.{field} = {spec!r}: no such file {path}")
            folder = str(path.parent)
        else:
            folder = os.getcwd()
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module = import_file(path) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as exc:  # ImportError, or whatever the module raises while it is imported
        raise ValueError(f"task.{field} = {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); run "
                         "tfgrpo from the folder that holds it, put it on PYTHONPATH, or give a file path") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"task.{field} = {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def import_file(path: Path) -> Any:
    """The module of the file at `path`, imported under a name made from its full path (once: the program and the
    metric may come from one file), so that another file of the same name elsewhere is never taken for it."""
    stem, tag = re.sub(r"\W", "_", path.stem), hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"{USER_MODULE_PREFIX}{stem}_{tag}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as `import` does (dataclasses and pickling look it up)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def program_factory(spec: str) -> Callable[[], dspy.Module]:
    """A function that builds a fresh copy of the program `spec` names (checked once here)."""
    obj = import_object(spec, "program")
    make = obj.deepcopy if isinstance(obj, dspy.Module) else obj
    if not callable(make):
        raise ValueError(f"task.program = {spec!r} is a {type(obj).__name__}; expected a dspy.Module subclass, a "
                         "function that returns a dspy.Module, or a dspy.Module instance")
    try:
        program = make()
    except Exception as exc:
        raise ValueError(f"task.program = {spec!r}: building the program with no arguments failed "
                         f"({type(exc).__name__}: {exc}); point at a class or function that needs none") from exc
    if not isinstance(program, dspy.Module):
        raise ValueError(f"task.program = {spec!r} gave a {type(program).__name__}, not a dspy.Module")
    return make


def metric_function(spec: str, field: str = "metric") -> Callable:
    metric = import_object(spec, field)
    if not callable(metric):
        raise ValueError(f"task.{field} = {spec!r} is a {type(metric).__name__}, not a function")
    try:
        metric_takes_trace(metric)
    except TypeError as exc:
        raise ValueError(f"task.{field} = {spec!r}: {exc}") from None
    return metric


def load_examples(path: str, *, input_keys: list[str], limit: int | None = None, offset: int = 0) -> list[dspy.Example]:
    """dspy.Examples from a JSONL file (one object per line) or a JSON file holding a list of objects, with
    `input_keys` marked as inputs; a ValueError naming the file and the row for anything else."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such data file (relative paths start from {os.getcwd()})")
    if file.suffix == ".json":
        try:
            rows = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json data file holds a list of objects")
        numbered = [(f"item {i}", row) for i, row in enumerate(rows)]
    else:  # JSON Lines
        try:
            numbered = [(f"line {n}", row) for n, row in read_jsonl_rows(file)]
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    examples = []
    for where, row in numbered[offset: None if limit is None else offset + limit]:
        if not isinstance(row, dict):
            raise ValueError(f"{path}, {where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in input_keys if k not in row]
        if missing:
            raise ValueError(f"{path}, {where}: no field {missing} (task.input_keys); the row has {sorted(row)}")
        examples.append(dspy.Example(**row).with_inputs(*input_keys))
    if not examples:
        raise ValueError(f"{path}: no examples (offset {offset}, limit {limit})")
    return examples
