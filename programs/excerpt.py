"""Excerpts: lines copied from a winning attempt that show an experience carried out.

A small reflection model states a procedure vaguely ("use an efficient search"), but it selects code well, and a
small policy model copies a working example faithfully. So an experience may carry an excerpt: the reflection LM
picks the lines (`PickExcerpt`), and this module checks in code that they were copied, not invented: most lines
must occur in the attempt as written (a few may be generalised, a value replaced by a variable), and a line that
still holds the query's own values (its names, its numbers) is dropped, as a rule that repeats them is refused.
"""

from __future__ import annotations

import re

from tfgrpo.programs.generality import specific_terms

MIN_COPIED = 0.7  # share of an excerpt's lines that must occur in the attempt as written


def _code_lines(text: str) -> list[str]:
    """Non-blank lines of `text`, without Markdown fences and field labels, right-stripped."""
    fenced = re.findall(r"```[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", text, flags=re.S)
    body = max(fenced, key=len) if fenced else text
    return [line.rstrip() for line in body.splitlines() if line.strip() and not line.strip().startswith("```")]


def checked_excerpt(excerpt: str, attempt: str, task: str, *, max_lines: int, allowed: str = "") -> tuple[str, str | None]:
    """(the excerpt to keep, None), or ("", why it was refused)."""
    lines = [line for line in _code_lines(excerpt) if not specific_terms(line, task, allowed=allowed)]
    if not lines:
        return "", "empty excerpt"
    if len(lines) > max_lines:
        return "", f"{len(lines)} lines, over max_excerpt_lines={max_lines}"
    source = {line.strip() for line in attempt.splitlines()}
    copied = sum(line.strip() in source for line in lines) / len(lines)
    if copied < MIN_COPIED:
        return "", f"only {copied:.0%} of its lines occur in the attempt: not copied"
    return "\n".join(lines), None
