"""Excerpts: lines copied from a winning attempt that show an experience carried out.

A small reflection model states a procedure vaguely ("use an efficient search"), but it selects code well, and a
small policy model copies a working example faithfully. So an experience may carry an excerpt: the reflection LM
picks the lines (`PickExcerpt`), and this module checks in code that they were copied, not invented: most lines
must occur in the attempt as written (a few may be generalised, a value replaced by a variable), and the query's own
values (its names, its numbers) are masked as `<?>`, so the excerpt shows where another query's values go. (Dropping
those lines instead left a whole solver calling a list it never defined: `permutations_of_numbers = permutations([3,
3, 4, 6])` is the line that holds the query's numbers.)
"""

from __future__ import annotations

import re
from collections import Counter

from tfgrpo.programs.generality import number_values, specific_terms

MIN_COPIED = 0.7  # share of an excerpt's lines that must occur in the attempt as written
MASK = "<?>"  # stands for a value of the query in an excerpt
MIN_LISTED = 3  # a bracketed list of this many of the query's numbers is its values, whatever the numbers
_LISTED = re.compile(r"[\[(]\s*[-\d.]+(?:\s*,\s*[-\d.]+)+\s*,?\s*[\])]")  # [3, 7, 7, 7] or (3, 7, 7, 7)


def _code_lines(text: str) -> list[str]:
    """Non-blank lines of `text`, without Markdown fences and field labels, right-stripped."""
    fenced = re.findall(r"```[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", text, flags=re.S)
    body = max(fenced, key=len) if fenced else text
    return [line.rstrip() for line in body.splitlines() if line.strip() and not line.strip().startswith("```")]


def masked(line: str, task: str, *, allowed: str = "") -> str:
    """`line` with each of the query's own values it holds replaced by `MASK`: a bracketed list of its numbers as a
    whole (even one-digit numbers, or ones the instructions also hold: `[3, 7, 7, 7]` is a puzzle, "Python 3" is
    not), then its names and numbers as `specific_terms` finds them."""
    query = Counter(number_values(task))

    def listed(m: re.Match) -> str:
        values = number_values(m.group())
        if len(values) < MIN_LISTED or Counter(values) - query:  # an index, a range, or numbers of its own
            return m.group()
        return re.sub(r"[-\d.]+", MASK, m.group())

    line = _LISTED.sub(listed, line)
    for term in specific_terms(line, task, allowed=allowed):
        if not term.startswith('"'):  # a run of the query's words is not a value to mask
            line = re.sub(rf"(?<![\w.]){re.escape(term)}(?![\w])", MASK, line)
    return line


def checked_excerpt(excerpt: str, attempt: str, task: str, *, max_lines: int, allowed: str = "") -> tuple[str, str | None]:
    """(the excerpt, with the query's values masked, None), or ("", why it was refused)."""
    lines = [masked(line, task, allowed=allowed) for line in _code_lines(excerpt)]
    lines = [line for line in lines if not specific_terms(line, task, allowed=allowed)]
    if not lines:
        return "", "empty excerpt"
    if all(MASK in line for line in lines):
        return "", "only the query's own values"
    if len(lines) > max_lines:
        return "", f"{len(lines)} lines, over max_excerpt_lines={max_lines}"
    source = {masked(line, task, allowed=allowed).strip() for line in attempt.splitlines()}
    copied = sum(line.strip() in source for line in lines) / len(lines)
    if copied < MIN_COPIED:
        return "", f"only {copied:.0%} of its lines occur in the attempt: not copied"
    return "\n".join(lines), None
