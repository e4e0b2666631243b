"""Is an experience general, or does it repeat the training query it was learned from?

Small models copy what they see: asked for a lesson, they often restate the problem ("When Betty saves for
a wallet, ..."). Prompts alone do not stop this, so it is checked in code against the query's distinctive
tokens: its names (capitalized words that are not common sentence openers), its numbers, long runs of its
words, and (`restated_words`) its content words when they make up most of the experience ("Each person ate
twice as many chicken nuggets as the person before them."). Tokens that also appear in the program's own
instructions (say "24" in the Game of 24) are part of the task, not of one query, and are allowed.
"""

from __future__ import annotations

import re

# Words of the learning prompt itself: a "rule" that uses them talks about the comparison, not the task.
PROMPT_PHRASES = ("better attempt", "worse attempt", "new rule", "this rule", "the rule", "future attempts",
                  "the library", "this task", "similar tasks")
COPIED_RUN = 6  # this many consecutive words shared with the query: the experience copies the problem
# Capitalized words that start sentences of word problems without naming anything.
_OPENERS = {"a", "an", "the", "if", "how", "what", "when", "where", "which", "who", "why", "in", "on", "at", "for",
            "after", "before", "each", "every", "there", "this", "that", "these", "those", "she", "he", "it", "they",
            "we", "you", "i", "then", "find", "let", "given", "suppose", "compute", "calculate", "determine", "what's",
            "use", "write", "solve", "all", "one", "two", "three", "four", "some", "his", "her", "their", "its", "if,",
            "is", "are", "was", "were", "do", "does", "can", "assume", "show", "prove", "note", "also", "but", "and",
            "so", "to", "of", "from", "with", "by", "as", "during", "while", "since", "because", "however"}
# Words any lesson about quantities may use whatever the problem: they never count as the problem's own.
_GENERIC = _OPENERS | {"not", "than", "more", "less", "many", "much", "number", "numbers", "total", "sum",
                       "difference", "product", "times", "twice", "half", "double", "amount", "value", "values",
                       "first", "second", "last", "other", "same", "another", "get", "add",
                       "subtract", "multiply", "divide", "result", "answer", "answers", "problem", "question",
                       "step", "steps", "have", "has", "had", "will", "would", "should", "must", "need", "needs",
                       "into", "over", "under", "per", "out", "about", "any", "only", "them", "him", "our", "your",
                       "make", "makes", "made", "take", "takes", "uses", "using", "finds", "left"}
RESTATED_SHARE, MIN_RESTATED = 1 / 3, 3  # this share of an experience's content words, and this many, from its query
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


def number_values(text: str) -> list[str]:
    """The numbers of `text` in order, normalized (`07` and `7.0` read as `7`)."""
    return [n.rstrip("0").rstrip(".") if "." in n else n.lstrip("0") or "0" for n in _NUMBER.findall(text)]


def _numbers(text: str) -> set[str]:
    return set(number_values(text))


def _names(text: str) -> set[str]:
    lowercase_words = {w for w in _WORD.findall(text) if w[0].islower()}
    return {w for w in _WORD.findall(text) if w[0].isupper() and len(w) >= 3 and w.lower() not in _OPENERS
            and w.lower() not in lowercase_words}


def specific_terms(experience: str, query: str, *, allowed: str = "") -> list[str]:
    """The query-specific terms `experience` repeats; empty when it reads as general advice.

    - any name of the query (a capitalized word that is not a common opener);
    - any number of the query with two or more digits, or two or more of its one-digit numbers together;
    - a run of `COPIED_RUN` or more consecutive words of the query.
    Words and numbers that occur in `allowed` (the program's instructions) never count.
    """
    allowed_words = {w.lower() for w in _WORD.findall(allowed)}
    allowed_numbers = _numbers(allowed)
    found = sorted(n for n in _names(query) - {w for w in _names(query) if w.lower() in allowed_words}
                   if re.search(rf"\b{re.escape(n)}\b", experience))
    shared = sorted((_numbers(query) & _numbers(experience)) - allowed_numbers, key=lambda n: (len(n), n))
    long_ones = [n for n in shared if len(n.replace(".", "")) >= 2]
    found += long_ones if long_ones else (shared if len(shared) >= 2 else [])
    q_words = [w.lower() for w in _WORD.findall(query)]
    e_text = " ".join(w.lower() for w in _WORD.findall(experience))
    for i in range(len(q_words) - COPIED_RUN + 1):
        run = " ".join(q_words[i: i + COPIED_RUN])
        if f" {run} " in f" {e_text} ":
            found.append(f'"{run}"')
            break
    return found


def _content_words(text: str, ignored: set[str]) -> set[str]:
    """The words of `text` that carry content (three letters or more, not generic), a plural `s` dropped, less
    `ignored` (words in the same form)."""
    words = {w.lower().strip("'-") for w in _WORD.findall(text)}
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in words if len(w) >= 3 and w not in _GENERIC} - ignored


def restated_words(experience: str, query: str, *, allowed: str = "") -> list[str]:
    """The query's content words `experience` repeats, when they are at least `MIN_RESTATED` (or all of its own, if it
    has fewer: "Add goats to the total number of goats.") and `RESTATED_SHARE` of its own: it restates the problem
    ("Each pack contains 5 uncommon cards.") instead of teaching a method. Empty otherwise. Words of `allowed` (the
    program's instructions) never count. Quoted, as `specific_terms` quotes a run of words: they are words to avoid,
    not values to mask."""
    ignored = _content_words(allowed, set())
    own = _content_words(experience, ignored)
    shared = own & _content_words(query, ignored)
    if shared and len(shared) >= min(MIN_RESTATED, len(own)) and len(shared) >= RESTATED_SHARE * len(own):
        return [f'"{w}"' for w in sorted(shared)]
    return []


def parroted_phrases(experience: str) -> list[str]:
    """Phrases of the learning prompt that an experience repeats (it describes the comparison, not a method)."""
    low = experience.lower()
    return [f'"{p}"' for p in PROMPT_PHRASES if p in low]
