"""Pieces of the small-reflector learning path ("contrast") of `TrainingFreeGRPO`.

Per group with reward contrast, the best attempts are paired with the worst ones (at most
`max_operations_per_group` pairs); each pair is one `ContrastLearner` call that proposes at most one
operation. The batch's proposals are folded in code instead of by a consolidation call: a proposal that
says what an existing experience (or an earlier proposal) already says is dropped as redundant.
"""

from __future__ import annotations

import re

from tfgrpo.signatures.operations import Operation

REDUNDANT_OVERLAP = 0.5  # Jaccard overlap of content words above which two experiences say the same thing
_STOP = {"a", "an", "the", "to", "of", "and", "or", "in", "on", "for", "with", "by", "is", "are", "be", "it", "its",
         "each", "every", "all", "any", "that", "this", "when", "then", "as", "at", "from", "into", "if", "use"}


def contrast_pairs(rewards: list[float], max_pairs: int) -> list[tuple[int, int]]:
    """(better, worse) attempt indices: the k-th best against the k-th worst while the first scored higher."""
    best = sorted(range(len(rewards)), key=lambda g: (-rewards[g], g))
    worst = sorted(range(len(rewards)), key=lambda g: (rewards[g], g))
    pairs = []
    for b, w in zip(best, worst):
        if len(pairs) >= max_pairs or rewards[b] <= rewards[w]:
            break
        pairs.append((b, w))
    return pairs


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOP}


def overlap(a: str, b: str) -> float:
    wa, wb = _content_words(a), _content_words(b)
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


def fold(existing: list[str], proposals: list[Operation]) -> tuple[list[Operation], int]:
    """The plan from one batch's proposals, and how many were dropped as redundant.

    An "add" close to an existing experience or to an earlier add of the plan is dropped; only the first
    "modify" of each experience is kept (the others came from the same batch and could not see it)."""
    plan, seen_texts, modified, redundant = [], list(existing), set(), 0
    for op in proposals:
        if op.action == "add" and any(overlap(op.text, t) >= REDUNDANT_OVERLAP for t in seen_texts):
            redundant += 1
            continue
        if op.action == "modify" and op.ids and op.ids[0] in modified:
            redundant += 1
            continue
        modified.update(op.ids if op.action == "modify" else [])
        seen_texts.append(op.text)
        plan.append(op)
    return plan, redundant
