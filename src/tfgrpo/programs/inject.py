"""Putting a library into a DSPy program, and saving/loading programs that carry one.

The experiences are appended to each target predictor's instructions inside one tagged block, each predictor's own
(an experience names the predictors it is for; none: every one). The same
block is used while learning and when deployed, re-applying it replaces the old block (idempotent), and the
instructions before it (for ReAct: the tool list) are left untouched. Because the block lives in the
signature's instructions, a program saved with `program.save(...)` carries it, and stock DSPy loads it with
`program.load(...)`; the structured library rides along in the same JSON under `experience_library`. A program
loaded without that attribute (stock DSPy's `load` into a fresh program) still carries the block, and
`library_from_instructions` reads the experiences back from it, so re-compiling never drops them. When a saved
program carries both, `load_program` checks that they agree.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import dspy

from tfgrpo.base.util import write_atomic
from tfgrpo.programs.library import CLOSE_TAG, OPEN_TAG, ExperienceLibrary, parse_rendered

logger = logging.getLogger(__name__)

PREAMBLE = "Lessons learned from earlier attempts at this task; apply the ones that fit the problem at hand."
LIBRARY_KEY = "experience_library"  # attribute on the program and key in the saved JSON
PROVENANCE_KEY = "provenance"  # attribute on a compiled program, and key in the saved JSON's metadata: where it learned

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


def rendered_experiences(instructions: str) -> list[tuple[str, str, str]] | None:
    """The (ID, text, excerpt) triples of the experience block at the end of `instructions` (read by the library's
    own `parse_rendered`); None when there is no block."""
    match = _BLOCK.search(instructions or "")
    tags = (instructions or "").count(OPEN_TAG), (instructions or "").count(CLOSE_TAG)
    if tags != ((1, 1) if match else (0, 0)):
        raise ValueError(f"the instructions hold {tags[0]} {OPEN_TAG} and {tags[1]} {CLOSE_TAG} tags; an experience "
                         "block is one of each, at the end of the instructions: mend the tags or remove the block")
    if match is None:
        return None
    lines = match.group(0).strip()[len(OPEN_TAG):-len(CLOSE_TAG)].strip("\n").split("\n")
    if lines and lines[0] == PREAMBLE:
        lines = lines[1:]
    return parse_rendered(lines)


def library_from_instructions(program: dspy.Module, targets: list[str], *, max_words: int = 32,
                              max_experiences: int | None = None) -> ExperienceLibrary | None:
    """The library rendered into the `targets`' instructions, read back (None when none of them has a block).

    Used when a program carries no `experience_library` attribute, e.g. after stock DSPy's `program.load(...)`
    into a fresh program: the IDs and texts come back, each experience for the predictors whose block holds it (for
    every one, where every target's does); the provenance was not in the instructions, so each experience's history
    starts with a "recovered" entry. A ValueError when two blocks give one ID different texts."""
    found: dict[str, tuple[str, str, str]] = {}  # ID -> (ID, text, excerpt), in the order first seen
    holders: dict[str, list[str]] = {}  # ID -> the predictors whose block holds it
    for name, predictor in program.named_predictors():
        if name in targets:
            try:
                items = rendered_experiences(predictor.signature.instructions) or []
            except ValueError as exc:
                raise ValueError(f"predictor {name!r}: {exc}") from None
            for item in items:
                if found.setdefault(item[0], item) != item:
                    raise ValueError(f"the experience blocks of predictors {holders[item[0]][0]!r} and {name!r} give "
                                     f"{item[0]} different texts; attach the library to recover "
                                     "(program.experience_library = ...) or strip the blocks "
                                     "(tfgrpo.programs.strip_experiences)")
                holders.setdefault(item[0], []).append(name)
    if not found:
        return None
    library = ExperienceLibrary.recovered(list(found.values()), max_words=max_words, max_experiences=max_experiences)
    for exp in library:
        exp.predictors = [] if len(holders[exp.id]) == len(targets) else holders[exp.id]
    return library


NO_PREDICTORS = ("the program has no predictors to carry experiences: DSPy finds a module's predictors (dspy.Predict, "
                 "dspy.ChainOfThought, ...) among its attributes, so declare each in __init__ (self.answer = "
                 "dspy.Predict(\"question -> answer\")) and call it in forward; one built inside forward() is made "
                 "anew on each call and nothing can carry what was learned into it")


def resolve_targets(program: dspy.Module, target_predictors: list[str] | None) -> list[str]:
    """Names of the predictors that receive experiences; a clear error for a name the program lacks."""
    names = [name for name, _ in program.named_predictors()]
    if not names:
        raise ValueError(NO_PREDICTORS)
    if target_predictors is None:
        return names
    missing = [t for t in target_predictors if t not in names]
    if missing:
        raise ValueError(f"target_predictors {missing} not found; the program's predictors are {names}")
    return list(target_predictors)


def apply_library(program: dspy.Module, library: ExperienceLibrary, target_predictors: list[str] | None = None) -> dspy.Module:
    """Write the library into the target predictors' instructions (in place), each predictor's own experiences
    (`ExperienceLibrary.for_predictor`), and attach it; returns `program`."""
    targets = set(resolve_targets(program, target_predictors))
    for name, predictor in program.named_predictors():
        if name in targets:
            new = with_experiences(predictor.signature.instructions, library.for_predictor(name))
            predictor.signature = predictor.signature.with_instructions(new)
    setattr(program, LIBRARY_KEY, library)
    return program


def predictor_roles(program: dspy.Module, targets: list[str]) -> dict[str, str]:
    """What each target predictor does, by name, as the learning calls are told it: its fields (inputs -> outputs)
    and the first sentence of its own instructions."""
    roles = {}
    for name, predictor in program.named_predictors():
        if name in targets:
            sig = predictor.signature
            first = strip_experiences(sig.instructions).strip().split("\n")[0].split(". ")[0].rstrip(".")
            roles[name] = f"{', '.join(sig.input_fields)} -> {', '.join(sig.output_fields)}" + (f": {first}" if first
                                                                                               else "")
    return roles


def apply_demos(program: dspy.Module, demos: list, targets: list[str]) -> dspy.Module:
    """Put each demo's predictor calls (its `trace`: name, inputs and outputs of each call) into the matching target
    predictors' `demos` (in place; returns `program`). Without demos the program's own demos are left as they are."""
    if not demos:
        return program
    for name, predictor in program.named_predictors():
        if name in targets:
            predictor.demos = [dspy.Example(**call["inputs"], **call["outputs"])
                               for demo in demos for call in demo.trace if call["predictor"] == name]
    return program


def with_learned(program: dspy.Module, targets: list[str], library, demos: list) -> dspy.Module:
    """A copy of `program` carrying what was learned: the library in the targets' instructions, and the demos."""
    return apply_demos(apply_library(program.deepcopy(), library, targets), demos, targets)


def starting_library(student: dspy.Module, program: dspy.Module, targets: list[str], *, max_words: int,
                     max_experiences: int | None) -> ExperienceLibrary:
    """The library to learn on from: the student's own (its `experience_library`), else the one rendered into the
    targets' instructions (a program loaded with stock DSPy's `load` carries only that), else an empty one."""
    start = getattr(student, LIBRARY_KEY, None)
    own = isinstance(start, ExperienceLibrary)
    if own and (len(start) or start.retired):
        library = start.copy()
    elif (library := library_from_instructions(program, targets, max_words=max_words,
                                               max_experiences=max_experiences)) is not None:
        logger.info("The program carries no experience_library, but its instructions hold %d experience(s) (%s): "
                    "recovered from there and kept; their provenance was not saved in the instructions",
                    len(library), ", ".join(e.id for e in library))
    else:
        library = start.copy() if own else ExperienceLibrary()
    library.max_words, library.max_experiences = max_words, max_experiences
    return library


def save_program(program: dspy.Module, path: str | Path) -> Path:
    """Save like `program.save(path)` but never write LM settings (model, base URL, keys): `lm` is null; a compiled
    program's `provenance` (the models it was learned with, its knobs, what each item was worth) goes into the
    metadata, which `load_program` reads back and stock DSPy reads past."""
    path = Path(path)
    state = program.dump_state()
    if isinstance(program, dspy.Predict):  # a bare predictor dumps a flat state, without its attributes
        state["lm"] = None
        if isinstance(getattr(program, LIBRARY_KEY, None), ExperienceLibrary):
            state[LIBRARY_KEY] = getattr(program, LIBRARY_KEY).dump_state()
    for value in state.values():
        if isinstance(value, dict) and "lm" in value:
            value["lm"] = None
    state["metadata"] = {"dependency_versions": _versions(), "saved_by": "tfgrpo", "field_types": field_types(program)}
    if isinstance(provenance := getattr(program, PROVENANCE_KEY, None), dict):  # stock DSPy reads past it
        state["metadata"][PROVENANCE_KEY] = provenance
    return write_atomic(path, json.dumps(state, indent=2, ensure_ascii=False))


def load_program(program: dspy.Module, path: str | Path, target_predictors: list[str] | None = None) -> dspy.Module:
    """Load a saved program into `program` (in place) and restore its structured library.

    Bad input gives a `ValueError` naming the file, never a half-loaded program; so do a file saved from another
    program (a predictor of the same name with other fields) and a hand edit that left the experience block in the
    instructions and the stored library saying different things (which one was meant cannot be told).
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
    metadata = state.get("metadata") if isinstance(state.get("metadata"), dict) else {}
    provenance, saved_types = metadata.get(PROVENANCE_KEY), metadata.get("field_types")
    if isinstance(program, dspy.Predict):  # a bare predictor was saved as one flat state
        state = {"self": {k: v for k, v in state.items() if k not in (LIBRARY_KEY, "metadata")}}
    names = [name for name, _ in program.named_predictors()]
    missing = [n for n in names if not isinstance(state.get(n), dict)]
    if missing:
        held = [k for k, v in state.items() if isinstance(v, dict) and "signature" in v]
        raise ValueError(f"{path}: no saved state for predictors {missing}; the file holds {held} and this program "
                         f"has {names}: was it saved from this program?")
    own_types = field_types(program)
    for name, predictor in program.named_predictors():
        if problem := _saved_disagrees(state[name], predictor, library.for_predictor(name) if library else None):
            raise ValueError(f"{path}: predictor {name!r}: {problem}")
        saved, own = saved_types.get(name) if isinstance(saved_types, dict) else None, own_types[name]
        if isinstance(saved, dict) and (changed := [f for f in own if f in saved and saved[f] != own[f]]):
            raise ValueError(f"{path}: predictor {name!r}: field {changed[0]!r} was saved as {saved[changed[0]]} and "
                             f"is {own[changed[0]]} in this program: its demos hold values of the type it had. Load it "
                             "into the program as it was saved, or compile the program again")
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
    if isinstance(provenance, dict):
        setattr(program, PROVENANCE_KEY, provenance)
    return program


def _saved_disagrees(saved: dict, predictor: dspy.Predict, library: ExperienceLibrary | None) -> str | None:
    """Why a predictor's saved state cannot be loaded as it stands, or None: its signature's fields differ from the
    predictor's (another program's predictor of the same name), its experience block is malformed, or the block
    and the stored library say different things (a hand edit of one of them: neither is taken over the other)."""
    signature = saved.get("signature")
    if not isinstance(signature, dict) or not isinstance(signature.get("instructions"), str):
        return None  # malformed: refused by the load itself
    fields = signature.get("fields")
    if isinstance(fields, list) and all(isinstance(f, dict) for f in fields):
        own = [f.json_schema_extra["prefix"] for f in predictor.signature.fields.values()]
        if (shown := [f.get("prefix") for f in fields]) != own:
            return (f"it was saved with the fields {shown}, and this program's predictor has {own}: the file holds "
                    "another program's predictor of the same name")
    try:
        items = rendered_experiences(signature["instructions"])
    except ValueError as exc:
        return str(exc)
    if library is None or items is None:
        return None
    if _BLOCK.search(signature["instructions"]).group(0).strip() == with_experiences("", library).strip():
        return None
    in_block, stored = {i: text for i, text, _ in items}, {e.id: e.text for e in library}
    if list(in_block) != list(stored):
        what = f"the block lists {list(in_block)} and the library {list(stored)}"
    else:
        changed = next((i for i in stored if in_block[i] != stored[i]), None)
        what = f"[{changed}] reads {in_block[changed]!r} in the block and {stored[changed]!r} in the library" \
            if changed else "their excerpts or layout differ"
    return (f"the experience block in its instructions and the stored experience_library disagree ({what}). Neither "
            f"is taken over the other: edit both alike, or delete the {LIBRARY_KEY!r} key to keep the block as "
            "written (the experiences' history is then lost)")


def field_types(program: dspy.Module) -> dict[str, dict[str, str]]:
    """Each predictor's fields with their types by name (`list[Answer]`, module paths left out: a class keeps its
    name when the file that defines it is run as a script), which a saved program records and a load compares."""
    return {name: {field: re.sub(r"\b(?:\w+\.)+(\w)", r"\1", t.__name__ if isinstance(t := info.annotation, type)
                                 else str(t)) for field, info in predictor.signature.fields.items()}
            for name, predictor in program.named_predictors()}


def _targets_with_block(program: dspy.Module) -> list[str] | None:
    names = [n for n, p in program.named_predictors() if OPEN_TAG in (p.signature.instructions or "")]
    return names or None


def _versions() -> dict:
    from dspy.utils.saving import get_dependency_versions

    return get_dependency_versions()
