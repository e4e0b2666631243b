"""The experience library: the only thing Training-Free GRPO learns.

An experience is one short, general piece of advice ("When a problem asks for ..., first ..."). The library
gives each one a stable ID that is never reused, remembers where it came from (the step and the training
queries) and every edit made to it. Deleted and merged experiences are retired, not forgotten, so provenance
survives. Edits arrive as `Operation`s and are applied all-or-nothing: a plan is checked and carried out on
a scratch copy, and the library only changes once the whole plan has gone through.

What is learned must read back the same by every load path, including the one that has only the rendering in a
program's instructions (`parse_rendered`). So an experience's text is kept on one line: its whitespace, newlines
included, is collapsed to single spaces as it is added (a newline followed by "[E9] ..." would read back as a second
experience); and a text or excerpt that holds the block's own markup (`<experiences>`, `</experiences>`, or an
excerpt line that is only a fence) is refused, as a duplicate is: it would end the block early in the prompt and in
the saved file. Refusing is simpler than escaping, which every reader of the block would have to undo.

An experience that reads like an instruction to the model rather than a lesson ("ignore all previous
instructions", `injection_like`) is kept but logged as a WARNING that names it: learned rules come from text a model
wrote, sometimes after reading pages written by strangers (docs/long-runs.md says why this warns, not refuses).

In a program of several predictors an experience names the predictors it is for (`predictors`; none: every one), and
each predictor carries only its own (`for_predictor`). A new experience that says what one already says (their content
words overlap by `fold_at` or more, `overlap`) is folded into it instead of added: the old wording stays, the sources
of both are kept. `fit` keeps each predictor's library within a budget of tokens, retiring the experience left
unedited longest first.
"""

from __future__ import annotations

import copy
import logging
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Callable

from dspy.predict.parameter import Parameter
from pydantic import BaseModel, Field

from tfgrpo.signatures.operations import EVERY, Operation

logger = logging.getLogger(__name__)


class Edit(BaseModel):
    """One entry of an experience's history."""

    step: int
    action: str  # add | modify | merge | delete | merged_into | fold (a new one said the same) | narrowed (left a
    # predictor's library, over its budget) | recovered (read back from a program's instructions)
    text: str = ""  # the wording after the edit (before it, for delete)
    related: list[str] = Field(default_factory=list)  # merged-from IDs, or the ID this one was merged into


class Experience(BaseModel):
    id: str
    text: str
    excerpt: str = ""  # lines copied from a winning attempt that show the advice carried out (optional)
    created_step: int
    sources: list[str] = Field(default_factory=list)  # keys of the training queries it was learned from
    history: list[Edit] = Field(default_factory=list)
    predictors: list[str] = Field(default_factory=list)  # the predictors it is for, by name; none: every one

    def dump(self) -> dict:
        """The experience as a saved library holds it (`predictors` only where it names some)."""
        return self.model_dump(exclude=set() if self.predictors else {"predictors"})

    def is_for(self, predictor: str) -> bool:
        return not self.predictors or predictor in self.predictors


@dataclass
class ApplyReport:
    """What happened to a plan: the operations applied by action, those refused (with the reason) and the new
    experiences folded into one that already said the same (with its ID)."""

    applied: dict[str, int] = field(default_factory=lambda: {"add": 0, "modify": 0, "merge": 0, "delete": 0})
    rejected: list[tuple[Operation, str]] = field(default_factory=list)
    folded: list[tuple[Operation, str]] = field(default_factory=list)

    @property
    def num_applied(self) -> int:
        return sum(self.applied.values())


OPEN_TAG, CLOSE_TAG = "<experiences>", "</experiences>"  # the block that holds the library in instructions
FORMAT = "tfgrpo.experience_library/1"  # the tag of a saved library's state (`dump_state`)
ID = re.compile(r"E[1-9]\d*")  # an experience's ID: E1, E2, ...
MAX_EXCERPT_LINES = 40  # an excerpt longer than this is refused: it is a whole program, not an excerpt


def _fenced(excerpt: str) -> str:
    return "\n" + "\n".join("    " + line for line in [FENCE, *excerpt.splitlines(), FENCE])


FENCE = "```"
_LINE = re.compile(r"^\[([A-Za-z]*\d+)\] (.*)$")  # an experience as `render` writes it (or an ID that only looks
# like one, [X1] or [e2]: refused, not read as more text of the experience before)


def _check_excerpt(excerpt: str) -> str | None:
    """Why an excerpt cannot be kept, or None: it is too long, or holds the block's own markup (a tag, or a line of
    only the fence, which would end the excerpt early when read back)."""
    lines = excerpt.splitlines()
    if len(lines) > MAX_EXCERPT_LINES:
        return f"an excerpt of {len(lines)} lines, over the limit of {MAX_EXCERPT_LINES}"
    if OPEN_TAG in excerpt or CLOSE_TAG in excerpt or FENCE in lines:
        return (f"the excerpt holds the library's own markup ({OPEN_TAG}, {CLOSE_TAG} or a line of only {FENCE}), "
                "which would end its block early")
    return None


def parse_rendered(lines: list[str]) -> list[tuple[str, str, str]]:
    """The (ID, text, excerpt) triples of lines that `ExperienceLibrary.render` wrote. A line that does not start a
    new `[E<n>] ` item continues the text of the one before (multi-line texts), except an indented fenced block
    right after it, which is its excerpt. A ValueError for a malformed or repeated ID, or text before the first."""
    items: list[list] = []  # [id, text, excerpt lines or None, inside the excerpt's fence]
    for line in lines:
        if items and items[-1][3]:
            if line == "    " + FENCE:
                items[-1][3] = False
            else:
                items[-1][2].append(line[4:] if line.startswith("    ") else line)
        elif (found := _LINE.match(line)) is not None:
            exp_id = found.group(1)
            if not ID.fullmatch(exp_id):
                raise ValueError(f"malformed experience ID [{exp_id}] in {line[:80]!r}: IDs are E1, E2, ...")
            if any(item[0] == exp_id for item in items):
                raise ValueError(f"the experience block gives the ID {exp_id} to more than one experience")
            items.append([exp_id, found.group(2), None, False])
        elif items and line == "    " + FENCE and items[-1][2] is None:
            items[-1][2], items[-1][3] = [], True
        elif items:
            items[-1][1] += "\n" + line
        elif line.strip():
            raise ValueError(f"the experience block does not start with an '[E<n>] text' line: {line[:80]!r}")
    return [(i, text, "\n".join(excerpt or [])) for i, text, excerpt, _ in items]


_ORDER = r"\b(?:ignore|disregard|forget|override)(?:\W+(?:all|any|of|the|your|my|these|those|everything))*\W+"
_INJECTION = re.compile(
    _ORDER + r"(?:previous|prior|above|earlier|preceding|original|system|other)\W+(?:\w+\W+)?(?:instructions?|rules?|"
    r"prompts?|directions?|guidelines?|messages?|context|commands?|orders?)\b"  # "ignore all previous instructions"
    r"|" + _ORDER + r"(?:above|before)\b"  # "disregard the above"
    r"|\byou\s+are\s+now\b|\bsystem\s+prompt\b|\bnew\s+instructions\b", re.IGNORECASE)


def injection_like(text: str) -> str | None:
    """The words of `text` that read like a prompt injection (an order to drop the prompt's own instructions, or to
    become someone else: "ignore all previous instructions", "disregard the above", "you are now", "system
    prompt"), or None. A heuristic for a warning: it flags, it never refuses."""
    found = _INJECTION.search(text)
    return found.group(0) if found else None


# Chinese and Japanese put no spaces between words: each of these characters counts as one word
_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff]")
CHARS_PER_WORD = 10  # and any text counts at least one word per this many characters (Thai, a long URL, ...)


def _words(text: str) -> int:
    """The length of `text` in words, for every script: words between spaces, a CJK character as one word, and at
    least one word per CHARS_PER_WORD characters."""
    return max(len(_CJK.sub(" ", text).split()) + len(_CJK.findall(text)), len(text) // CHARS_PER_WORD)


def _kept(char: str) -> bool:
    """Whether a character is content for `_canonical`: a letter or digit of any script, a combining mark (the
    vowel signs of Hindi or Arabic), or a symbol beyond ASCII (an emoji)."""
    kind = unicodedata.category(char)
    return char.isalnum() or kind[0] == "M" or (kind[0] == "S" and not char.isascii())


# words that say nothing of a rule's content, left out of `overlap`
_STOP = {"a", "an", "the", "to", "of", "and", "or", "in", "on", "for", "with", "by", "is", "are", "be", "it", "its",
         "each", "every", "all", "any", "that", "this", "when", "then", "as", "at", "from", "into", "if", "use"}


def overlap(a: str, b: str) -> float:
    """How much two texts say the same: the Jaccard overlap of their content words (case-folded, `_STOP` words left
    out), from 0 (no word shared) to 1 (the same words)."""
    wa, wb = ({w for w in re.findall(r"\w+", _canonical(t)) if w not in _STOP} for t in (a, b))
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


def _named(op: Operation) -> list[str]:
    """The predictors a (placed) operation's experience is for; none where it names none, or every one ("all")."""
    named = list(dict.fromkeys(getattr(op, "predictors", None) or []))
    return [] if EVERY in named else named


def _canonical(text: str) -> str:
    """The text as duplicates are compared: Unicode-normalised (NFKC), case-folded, its content characters kept and
    every run of others (spaces, punctuation) made one space."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join("".join(c if _kept(c) else " " for c in text).split())


class ExperienceLibrary(Parameter):
    """An ordered set of experiences with stable IDs, limits and history.

    It is a DSPy `Parameter`, so a program that carries it as an attribute saves it with `program.save(...)`
    and restores it with `program.load(...)`; stock DSPy ignores it when the attribute is absent.
    """

    def __init__(self, *, max_words: int = 32, max_experiences: int | None = None):
        self.max_words = max_words  # an experience longer than this is refused
        self.max_experiences = max_experiences  # None: no cap on the library's size
        self.active: dict[str, Experience] = {}  # in insertion order, rendered in this order
        self.retired: dict[str, Experience] = {}  # deleted or merged away; kept for provenance
        self.next_id = 1

    # -- reading -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.active)

    def __iter__(self):
        return iter(self.active.values())

    def texts(self) -> list[str]:
        """The active experiences' texts, in order."""
        return [e.text for e in self.active.values()]

    def __repr__(self) -> str:
        """`ExperienceLibrary(2 experiences, 1 retired)` and one `[E1] text` line per active experience."""
        head = f"ExperienceLibrary({len(self.active)} experience{'s' if len(self.active) != 1 else ''}" + \
            (f", {len(self.retired)} retired" if self.retired else "") + ")"
        return "\n  ".join([head] + [f"[{e.id}] {e.text}" for e in self.active.values()])

    def render(self, *, tagged: bool = False) -> str:
        """The library as the numbered lines that go into prompts: `[E3] When ..., ...`, each followed by its
        excerpt, if it has one, as an indented fenced block. `tagged` (what the learning calls read): an experience
        for some predictors only says which, `[E3] (for plan) When ...`."""
        return "\n".join(f"[{e.id}] " + (f"(for {', '.join(e.predictors)}) " if tagged and e.predictors else "")
                         + e.text + (_fenced(e.excerpt) if e.excerpt else "") for e in self.active.values())

    def for_predictor(self, name: str) -> "ExperienceLibrary":
        """The experiences the predictor `name` carries (those for it, and those for every predictor), as a library
        of their own."""
        state = self.dump_state()
        state["experiences"] = [x for x in state["experiences"] if not x.get("predictors") or name in x["predictors"]]
        return self.from_state(state)

    # -- writing -------------------------------------------------------------------------------------------
    def apply(self, operations: list[Operation], *, step: int, sources: list[str] | None = None,
              quiet: bool = False, fold_at: float | None = None) -> ApplyReport:
        """Carry out a plan. Invalid operations are refused one by one (logged, unless `quiet`: a trial on a copy
        that was logged before); the rest take effect at once. With `fold_at`, a new experience whose content words
        overlap an existing one's by that much or more is folded into it (`overlap`), its sources and predictors
        joining the existing one's.

        The work happens on a scratch copy that replaces this library's state only at the end, so an
        unexpected error leaves the library exactly as it was.
        """
        scratch = copy.deepcopy(self)
        report = ApplyReport()
        for op in operations:
            if op.action == "add" and fold_at is not None and (same := scratch._saying(op, fold_at)) is not None:
                same.sources = list(dict.fromkeys(same.sources + (sources or [])))
                named = _named(op)  # (for the predictors of both)
                same.predictors = [] if not named or not same.predictors else list(dict.fromkeys(same.predictors
                                                                                                 + named))
                same.history.append(Edit(step=step, action="fold", text=" ".join(op.text.split())))
                report.folded.append((op, same.id))
                if not quiet:
                    logger.info("Folded add %r into %s, which says the same: %r", op.text[:80], same.id, same.text[:80])
                continue
            reason = scratch._apply_one(op, step=step, sources=sources or [], quiet=quiet)
            if reason is None:
                report.applied[op.action] += 1
            else:
                report.rejected.append((op, reason))
                if not quiet:
                    logger.warning("Refused %s %s %r: %s", op.action, op.ids, op.text[:80], reason)
        self.__dict__.update(scratch.__dict__)
        return report

    def _saying(self, op: Operation, fold_at: float) -> Experience | None:
        """The active experience that says what `op`'s text says (overlap at least `fold_at`), or None."""
        return next((e for e in self.active.values() if overlap(op.text, e.text) >= fold_at), None)

    def fit(self, budget: int, count: Callable[[str], int], predictors: list[str], *, step: int) -> list[dict]:
        """Retire experiences until each of `predictors` carries at most `budget` tokens of them (`count(text)`: the
        tokens of its `render()`), the one left unedited longest first (the probe, where a run has one, already retires
        those the program does as well without). One that is for other predictors too leaves only this one's library.
        Returns each retirement: {"id", "predictor", "tokens" (the predictor's before), "reason"}."""
        retired = []
        for name in predictors:
            while (tokens := count(self.for_predictor(name).render())) > budget:
                exp = min((e for e in self.active.values() if e.is_for(name)),
                          key=lambda e: (e.history[-1].step, int(e.id[1:])))
                others = [p for p in (exp.predictors or predictors) if p != name]
                if others:
                    exp.predictors = others
                    exp.history.append(Edit(step=step, action="narrowed", text=exp.text, related=others))
                else:
                    del self.active[exp.id]
                    exp.history.append(Edit(step=step, action="delete", text=exp.text))
                    self.retired[exp.id] = exp
                retired.append({"id": exp.id, "predictor": name, "tokens": tokens, "reason": f"{name}'s library held {tokens} tokens, over max_library_tokens={budget}"})
        return retired

    def _apply_one(self, op: Operation, *, step: int, sources: list[str], quiet: bool = False) -> str | None:
        """Apply one operation in place; return None on success, else why it was refused (nothing changed)."""
        needed = {"add": (0, 0), "modify": (1, 1), "delete": (1, 1), "merge": (2, None)}[op.action]
        if len(op.ids) < needed[0] or (needed[1] is not None and len(op.ids) > needed[1]):
            return f"{op.action} takes {needed[0] if needed[0] == needed[1] else 'at least %d' % needed[0]} ID(s), got {op.ids}"
        if len(set(op.ids)) != len(op.ids):
            return f"repeated IDs {op.ids}"
        for i in op.ids:
            if i not in self.active:
                return f"unknown ID {i}" if i not in self.retired else f"ID {i} was already retired"
        text = " ".join(op.text.split())  # one line: a newline and "[E9] ..." would read back as another experience
        excerpt = "\n".join(getattr(op, "excerpt", "").splitlines())  # its lines as the rendering reads them back
        if op.action != "delete":
            problem = self._check_text(text, ignore=op.ids) or _check_excerpt(excerpt)
            if problem:
                return problem
        named = _named(op)
        if op.action == "add":
            if self.max_experiences is not None and len(self.active) >= self.max_experiences:
                return f"library is full ({self.max_experiences} experiences)"
            exp = self._add(text, step=step, sources=sources, history=Edit(step=step, action="add", text=text),
                            excerpt=excerpt)
            exp.predictors = named
        elif op.action == "modify":
            exp = self.active[op.ids[0]]
            exp.text, exp.excerpt = text, excerpt or exp.excerpt
            exp.sources = list(dict.fromkeys(exp.sources + sources))
            exp.history.append(Edit(step=step, action="modify", text=text))
            exp.predictors = named or exp.predictors
        elif op.action == "delete":
            exp = self.active.pop(op.ids[0])
            exp.history.append(Edit(step=step, action="delete", text=exp.text))
            self.retired[exp.id] = exp
        else:  # merge: the merged ones retire, a new experience carries their sources
            merged = [self.active.pop(i) for i in op.ids]
            merged_sources = [s for e in merged for s in e.sources]
            exp = self._add(text, step=step, sources=list(dict.fromkeys(merged_sources + sources)),
                            history=Edit(step=step, action="merge", text=text, related=list(op.ids)))
            exp.predictors = named or ([] if any(not e.predictors for e in merged) else
                                       list(dict.fromkeys(p for e in merged for p in e.predictors)))
            for e in merged:
                e.history.append(Edit(step=step, action="merged_into", text=e.text, related=[exp.id]))
                self.retired[e.id] = e
        if op.action != "delete" and (words := injection_like(text)) and not quiet:
            logger.warning("Experience %s reads like a prompt injection (%r) rather than a lesson: %r. It is not "
                           "refused; check it before you deploy the program (tfgrpo show marks it)", exp.id, words,
                           text[:200])
        return None

    def _check_text(self, text: str, *, ignore: list[str]) -> str | None:
        if not text:
            return "empty text"
        if "..." in text or "\u2026" in text:
            return "placeholder text ('...')"
        if OPEN_TAG in text or CLOSE_TAG in text:
            return f"the text holds the library's own markup ({OPEN_TAG} or {CLOSE_TAG}), which would end its " \
                "block early"
        if (words := _words(text)) > self.max_words:
            how = "" if words == len(text.split()) else \
                f" (a CJK character counts as one, and every {CHARS_PER_WORD} characters as at least one)"
            return f"{words} words{how}, over the limit of {self.max_words}"
        key = _canonical(text)
        for e in self.active.values():
            if e.id not in ignore and _canonical(e.text) == key:
                return f"duplicate of {e.id}"
        return None

    def _add(self, text: str, *, step: int, sources: list[str], history: Edit, excerpt: str = "") -> Experience:
        exp = Experience(id=f"E{self.next_id}", text=text, excerpt=excerpt, created_step=step, sources=list(sources),
                         history=[history])
        self.next_id += 1
        self.active[exp.id] = exp
        return exp

    # -- persistence (the dspy Parameter protocol) ----------------------------------------------------------
    def dump_state(self, json_mode: bool = True) -> dict:
        return {
            "format": FORMAT,
            "max_words": self.max_words,
            "max_experiences": self.max_experiences,
            "next_id": self.next_id,
            "experiences": [e.dump() for e in self.active.values()],
            "retired": [e.dump() for e in self.retired.values()],
        }

    def load_state(self, state: dict) -> "ExperienceLibrary":
        fresh = self.from_state(state)
        self.__dict__.update(fresh.__dict__)
        return self

    @classmethod
    def from_state(cls, state: dict) -> "ExperienceLibrary":
        """Rebuild a library from `dump_state()` output; raise ValueError with the reason on bad input."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("not a tfgrpo experience library (missing or unknown 'format')")
        try:
            lib = cls(max_words=int(state["max_words"]), max_experiences=state.get("max_experiences"))
            active = [Experience.model_validate(x) for x in state["experiences"]]
            retired = [Experience.model_validate(x) for x in state.get("retired", [])]
            lib.next_id = int(state["next_id"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"corrupt experience library: {exc}") from exc
        for e in active + retired:
            if not ID.fullmatch(e.id):
                raise ValueError(f"corrupt experience library: the ID {e.id!r} is not of the form E1, E2, ...")
        for group in (active, retired):  # one in both lists is refused below
            if twice := sorted({e.id for e in group if [x.id for x in group].count(e.id) > 1}):
                raise ValueError(f"corrupt experience library: the ID {', '.join(twice)} is given to more than one "
                                 "experience; each needs an ID of its own")
        lib.active, lib.retired = {e.id: e for e in active}, {e.id: e for e in retired}
        cap = lib.max_experiences
        if lib.max_words < 1 or not (cap is None or (type(cap) is int and cap >= 0)):
            raise ValueError("corrupt experience library: max_words must be >= 1 and max_experiences null or an integer >= 0")
        used = [int(i[1:]) for i in [*lib.active, *lib.retired]]
        if len(set(lib.active) | set(lib.retired)) != len(lib.active) + len(lib.retired):
            raise ValueError("corrupt experience library: an ID is both active and retired")
        if used and lib.next_id <= max(used):
            raise ValueError("corrupt experience library: next_id would reuse an existing ID")
        return lib

    @classmethod
    def recovered(cls, items: list[tuple[str, str, str]], *, max_words: int = 32,
                  max_experiences: int | None = None) -> "ExperienceLibrary":
        """A library of the (ID, text, excerpt) triples read back from a rendering (`parse_rendered`): their
        provenance was not rendered, so each experience's history starts with a "recovered" entry."""
        return cls.from_state({
            "format": FORMAT, "max_words": max_words, "max_experiences": max_experiences,
            "next_id": max(int(i[1:]) for i, _, _ in items) + 1, "retired": [],
            "experiences": [{"id": i, "text": text, "excerpt": excerpt, "created_step": 0, "sources": [],
                             "history": [{"step": 0, "action": "recovered", "text": text}]}
                            for i, text, excerpt in items]})

    def copy(self) -> "ExperienceLibrary":
        """An independent copy: the same state, nothing shared (checked as a loaded state is)."""
        return self.from_state(self.dump_state())

    def reset(self) -> None:
        self.__init__(max_words=self.max_words, max_experiences=self.max_experiences)
