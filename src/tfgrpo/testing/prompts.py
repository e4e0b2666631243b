"""How a fake LM reads a DSPy chat prompt: which fields it must answer and which call of tfgrpo it is.

One set of rules for every fake LM of the project (the fake OpenAI-compatible server here, and the scripted LM
of the tests), so that both tell the calls apart the same way.
"""

from __future__ import annotations

import re

# the kinds of call, told apart by the output field each learning signature asks for
KINDS = ("student", "summary", "advantage", "consolidation", "contrast", "rewrite", "direct")
_KIND_BY_FIELD = {"operations": "advantage", "plan": "consolidation", "difference": "contrast",
                  "general_rule": "rewrite", "experiences": "direct"}
_FIELD = re.compile(r"\[\[ ## (\w+) ## \]\]\n?")


def output_fields(system: str) -> list[str]:
    """The output field names DSPy's chat adapter lists in a system message, in order."""
    section = system.split("Your output fields are:", 1)[-1].split("All interactions", 1)[0]
    return re.findall(r"^\d+\. `(\w+)`", section, flags=re.MULTILINE)


def kind_of(fields: list[str]) -> str:
    """Which call a request is, from the output fields it asks for (extra fields such as `reasoning` are
    allowed): a learning call by the field of its signature, else the student's own call."""
    for field, kind in _KIND_BY_FIELD.items():
        if field in fields:
            return kind
    return "summary" if "summary" in fields and "answer" not in fields else "student"


def field_values(text: str) -> dict[str, str]:
    """The `[[ ## name ## ]]` sections of a message, by name."""
    parts = _FIELD.split(text)
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}
