"""What a step passes forward: attempts, their rewards, and the groups they form.

Each stage makes new values from the ones before it and never writes into them: a rollout makes an `Attempt`, the
reward stage a `Scored` attempt, and a query's scored attempts make a `Group`, which the learning paths read.
Checkpoints store the plain records (`to_record`) and rebuild the values from them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import dspy


@dataclass(frozen=True)
class Attempt:
    """One run of the program on a query: its outputs (None when it raised), the error, DSPy's trace of every
    predictor call, the tool calls it made, and the attempt as the learning calls read it."""

    outputs: dict | None
    error: str | None
    trace: list
    tool_calls: int
    text: str

    def to_record(self) -> dict:
        return {"outputs": self.outputs, "error": self.error, "trace": self.trace, "tool_calls": self.tool_calls,
                "attempt": self.text}

    @classmethod
    def from_record(cls, rec: dict) -> Attempt:
        return cls(outputs=rec["outputs"], error=rec["error"], trace=rec["trace"], tool_calls=rec["tool_calls"],
                   text=rec.get("attempt", ""))


@dataclass(frozen=True)
class Scored:
    """An attempt with its reward in [0, 1] and what the metric said of it."""

    attempt: Attempt
    reward: float
    feedback: str = ""

    # the attempt's fields, read through the scored attempt
    outputs = property(lambda self: self.attempt.outputs)
    error = property(lambda self: self.attempt.error)
    trace = property(lambda self: self.attempt.trace)
    text = property(lambda self: self.attempt.text)


@dataclass(frozen=True)
class Group:
    """The scored attempts of one training query in one step."""

    index: int  # the query's position in the trainset
    key: str  # how provenance and logs name the query (`render.query_key`)
    example: dspy.Example
    attempts: tuple[Scored, ...]

    @property
    def rewards(self) -> list[float]:
        return [a.reward for a in self.attempts]

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards)

    @property
    def informative(self) -> bool:
        """Whether the group carries a direction: its rewards differ, or it is a single attempt (G = 1, judged
        against the ground truth alone)."""
        return len(self.attempts) == 1 or len(set(self.rewards)) > 1



def solved_by(groups: list[Group], attempts: int, known: dict[int, bool]) -> dict[int, bool]:
    """What a step's groups say of the queries its program solves (query -> solved: most of the group's first
    `attempts` attempts, those that ran the program itself, fully succeeded), beside what was `known` before."""
    evidence = dict(known)
    for group in groups:
        own = group.rewards[:attempts]
        if own:
            evidence[group.index] = statistics.fmean(r >= 1 for r in own) >= 0.5
    return evidence
