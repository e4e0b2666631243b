"""Putting a library into a DSPy program, and saving/loading programs that carry one.

The experiences are appended to each target predictor's instructions inside one tagged block. The same
block is used while learning and when deployed, re-applying it replaces the old block (idempotent), and the
instructions before it (for ReAct: the tool list) are left untouched. Because the block lives in the
signature's instructions, a program saved with `program.save(...)` carries it, and stock DSPy loads it with
`program.load(...)`; the structured library rides along in the same JSON under `experience_library`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import dspy

from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.util import write_atomic

OPEN_TAG, CLOSE_TAG = "<experiences>", "</experiences>"
PREAMBLE = "Lessons learned from earlier attempts at this task; apply the ones that fit the problem at hand."
LIBRARY_KEY = "experience_library"  # attribute on the program and key in the saved JSON

_BLOCK = re.compile(r"\s*" + re.escape(OPEN_TAG) + r".*?" + re.escape(CLOSE_TAG) + r"\s*$", re.DOTALL)


def strip_experiences(instructions: str) -> str:
    """The instructions without a trailing experience block."""
    return _BLOCK.sub("", instructions or "")


def with_experiences(instructions: str, library: ExperienceLibrary) -> str:
    """The instructions with exactly one experience block for `library` at the end (none if it is empty)."""
    base = strip_experiences(instructions)
    if len(library) == 0:
        return base
    return f"{base}\n\n{OPEN_TAG}\n{PREAMBLE}\n{library.render()}\n{CLOSE_TAG}"


def resolve_targets(program: dspy.Module, target_predictors: list[str] | None) -> list[str]:
    """Names of the predictors that receive experiences; a clear error for a name the program lacks."""
    names = [name for name, _ in program.named_predictors()]
    if not names:
        raise ValueError("the program has no predictors (dspy.Predict or subclasses) to carry experiences")
    if target_predictors is None:
        return names
    missing = [t for t in target_predictors if t not in names]
    if missing:
        raise ValueError(f"target_predictors {missing} not found; the program's predictors are {names}")
    return list(target_predictors)


def apply_library(program: dspy.Module, library: ExperienceLibrary, target_predictors: list[str] | None = None) -> dspy.Module:
    """Write the library into the target predictors' instructions (in place) and attach it; returns `program`."""
    targets = set(resolve_targets(program, target_predictors))
    for name, predictor in program.named_predictors():
        if name in targets:
            new = with_experiences(predictor.signature.instructions, library)
            predictor.signature = predictor.signature.with_instructions(new)
    setattr(program, LIBRARY_KEY, library)
    return program


def save_program(program: dspy.Module, path: str | Path) -> Path:
    """Save like `program.save(path)` but never write LM settings (model, base URL, keys): `lm` is null."""
    path = Path(path)
    state = program.dump_state()
    if isinstance(program, dspy.Predict):  # a bare predictor dumps a flat state, without its attributes
        state["lm"] = None
        if isinstance(getattr(program, LIBRARY_KEY, None), ExperienceLibrary):
            state[LIBRARY_KEY] = getattr(program, LIBRARY_KEY).dump_state()
    for value in state.values():
        if isinstance(value, dict) and "lm" in value:
            value["lm"] = None
    state["metadata"] = {"dependency_versions": _versions(), "saved_by": "tfgrpo"}
    return write_atomic(path, json.dumps(state, indent=2, ensure_ascii=False))


def load_program(program: dspy.Module, path: str | Path, target_predictors: list[str] | None = None) -> dspy.Module:
    """Load a saved program into `program` (in place) and restore its structured library.

    Bad input gives a `ValueError` naming the file, never a half-loaded program.
    """
    path = Path(path)
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: cannot read a saved program ({exc})") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{path}: a saved program is a JSON object")
    library = None
    if LIBRARY_KEY in state:
        try:
            library = ExperienceLibrary.from_state(state[LIBRARY_KEY])
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    if isinstance(program, dspy.Predict):  # a bare predictor was saved as one flat state
        state = {"self": {k: v for k, v in state.items() if k not in (LIBRARY_KEY, "metadata")}}
    names = [name for name, _ in program.named_predictors()]
    missing = [n for n in names if not isinstance(state.get(n), dict)]
    if missing:
        raise ValueError(f"{path}: no saved state for predictors {missing}; was it saved from this program?")
    def load_into(target: dspy.Module) -> None:
        for name, predictor in target.named_predictors():
            predictor.load_state(state[name])
            if not isinstance(predictor.signature.instructions, str):
                raise TypeError("instructions are not text")
            predictor.dump_state()  # what was loaded must save again: dspy checks neither demos nor fields
        if library is not None:
            apply_library(target, library, target_predictors or _targets_with_block(target))

    try:  # the whole load runs on a copy first, so a malformed file never leaves the program half-loaded
        load_into(program.deepcopy())
    except Exception as exc:  # dspy raises many types on malformed state
        raise ValueError(f"{path}: malformed predictor state ({type(exc).__name__}: {exc})") from exc
    load_into(program)
    return program


def _targets_with_block(program: dspy.Module) -> list[str] | None:
    names = [n for n, p in program.named_predictors() if OPEN_TAG in (p.signature.instructions or "")]
    return names or None


def _versions() -> dict:
    from dspy.utils.saving import get_dependency_versions

    return get_dependency_versions()
