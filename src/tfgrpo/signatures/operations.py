"""Typed edits to the experience library.

Every learning call that wants to change the library speaks in `Operation`s. The pydantic model fixes the
shape (what the LM must return); whether an operation makes sense against the current library (does the ID
exist, is the text short enough, is it a duplicate) is checked by `ExperienceLibrary.apply`, one operation
at a time, so one bad operation never sinks the others.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, create_model, field_validator

Action = Literal["add", "modify", "merge", "delete"]
SYNONYMS = {"update": "modify", "edit": "modify", "revise": "modify", "replace": "modify", "remove": "delete",
            "drop": "delete", "insert": "add", "new": "add", "create": "add", "combine": "merge"}


class Operation(BaseModel):
    """One proposed edit of the experience library."""

    action: Action = Field(description="add a new experience, modify one, merge several into one, or delete one")
    ids: list[str] = Field(
        default_factory=list,
        description="IDs of existing experiences the edit targets: none for add, one for modify/delete, two or more for merge",
    )
    text: str = Field(default="", description="the experience's new wording (add, modify, merge); empty for delete")

    @field_validator("action", mode="before")
    @classmethod
    def _lower_action(cls, value):
        if not isinstance(value, str):
            return value
        value = value.strip().lower()
        return SYNONYMS.get(value, value)

    @field_validator("ids", mode="before")
    @classmethod
    def _normalize_ids(cls, value):
        if value is None:
            return []
        if isinstance(value, (str, int)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"ids must be a list of experience IDs, not {type(value).__name__}")
        return [normalize_id(v) for v in value]

    @field_validator("text", mode="before")
    @classmethod
    def _strip_text(cls, value):
        return "" if value is None else str(value).strip()


class ExcerptOperation(Operation):
    """An operation whose experience carries an excerpt copied from a winning attempt (code, a formula, a tool-call
    pattern). Built in code from a checked excerpt, never asked of an LM as a whole, so `Operation`'s schema, which
    the paper's learning calls fill, stays as it is."""

    excerpt: str = ""


def normalize_id(raw) -> str:
    """Accept the spellings a model uses for an ID ("E3", "[e3]", "3", 3) and return the canonical "E3"."""
    text = str(raw).strip().strip("[]()<>{}\"'`").strip().upper()
    if re.fullmatch(r"\d+", text):
        return f"E{int(text)}"
    match = re.fullmatch(r"E\s*-?\s*0*(\d+)", text)
    return f"E{int(match.group(1))}" if match else text


EVERY = "all"  # what a placed operation names for an experience that is for every predictor


def placed(names: list[str]) -> type[Operation]:
    """`Operation` with `predictors`, which of the program's predictors (`names`, or "all") its experience is for,
    typed as a `Literal` of those names, so that a model decoding under the schema can name no other; a name the
    model makes up anyway is dropped as the reply is read (none left: every predictor, counted by the step)."""
    choice = Literal[tuple(names) + (EVERY,)]
    return create_model(
        "PlacedOperation", __base__=Operation,
        predictors=(list[choice], Field(default_factory=list, description=(
            f'the predictors the experience is for: a lesson about one step of the program goes to that step\'s '
            f'predictor only; "{EVERY}" for every one'))),
        __validators__={"_known": field_validator("predictors", mode="before")(_known_names(set(names)))})


def _known_names(names: set[str]):
    def known(cls, value):
        value = [value] if isinstance(value, str) else list(value or [])
        return [str(v).strip() for v in value if str(v).strip() in names | {EVERY}]
    return classmethod(known)
