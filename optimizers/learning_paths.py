"""Learning paths: how one step's informative groups become a plan of library operations.

A path is a plug-in with a small contract, so that a new way of learning needs nothing of the optimizer's insides:

    class MyPath(LearningPath):
        stages = ("lesson",)                       # the stages its LM calls are metered and checked under

        def learn(self, ctx, group):               # one group's calls, in order (groups run side by side)
            (reply,) = ctx.map("lesson", lambda _: ctx.call(f"lessons/{group.index}", ask), [None])
            return reply                           # the group's result, handed to finish()

        def finish(self, ctx, results):            # once every group is done: [(group, its result)] -> the plan
            return Lessons(plan=[...], proposals=[(group.key, op), ...])

`ctx.map(stage, fn, items)` runs a stage's units on the step's bounded pool and returns their results in order;
`ctx.call` makes a checkpointed LM call that returns a `Failed` instead of raising; `ctx.count_failures` reports a
stage's failures, and `ctx.wait(stage)` holds the group until every group has reached that stage and the stage's
failure check has passed (the step stops there when more than `max_failure_rate` of its units failed). The paper's
path is `paper_path.PaperPath` (summaries -> group advantage -> one consolidation call); `contrast.ContrastPath` is
the path for small reflection models. Pass an instance as `learning_path=` to plug in your own; `learn_from_groups`
runs a path on groups scored elsewhere (saved rollouts, say).
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import dspy

from tfgrpo.optimizers.attempts import Group
from tfgrpo.optimizers.checkpoint import Checkpoint
from tfgrpo.optimizers.parallel import Failed, Gates, StageBars, TooManyFailuresError, Workers
from tfgrpo.optimizers.usage import metered_stages, stage_usage
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation

if TYPE_CHECKING:
    from tfgrpo.optimizers.knobs import Knobs

logger = logging.getLogger(__name__)

EMPTY_LIBRARY = "(no experiences yet: only 'add' is possible)"
SMALL_REFLECTOR_B = 8  # learning_path="auto" picks "contrast" for reflection LMs of at most this many billion parameters


def model_size_b(model: str) -> float:
    """Parameter count in billions read from a model name ("qwen2.5-coder-1.5b" -> 1.5); inf if none is given."""
    sizes = [float(x) for x in re.findall(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", model.lower())]
    return max(sizes) if sizes else float("inf")


def path_name(setting: str | LearningPath, reflection_model: str) -> str:
    """The name of the learning path the `learning_path` knob picks for a reflection LM of this name ("auto":
    contrast for models of at most SMALL_REFLECTOR_B billion parameters, the paper's path otherwise)."""
    if isinstance(setting, LearningPath):
        return type(setting).__name__
    if setting != "auto":
        return setting
    return "contrast" if model_size_b(reflection_model) <= SMALL_REFLECTOR_B else "paper"


@dataclass
class Lessons:
    """What a path makes of a step: the plan, every proposal with the key of the query it came from, and counts
    (learning_failures and operations_proposed at least; path-specific ones besides)."""

    plan: list[Operation]
    proposals: list[tuple[str, Operation]] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    consolidation: str = ""


class StepContext:
    """What a learning path may use during one step: its settings (the knobs), the library as the step started (read
    it, never edit it), the trainset, the program's instructions, the reflection LM and one private copy of it per
    stage (`lm(stage)`, so each stage's usage is priced apart), the step's pool (`map`), checkpointed calls and the
    failure guard (`count_failures`, `wait`)."""

    def __init__(self, *, step: int, settings: Knobs, reflection_lm: dspy.BaseLM, library: ExperienceLibrary,
                 trainset: list, instructions: str, ckpt: Checkpoint, key: str, work: Workers, gates: Gates,
                 saved: Callable[[], None] | None = None):
        self.step, self.settings, self.reflection_lm, self.library = step, settings, reflection_lm, library
        self.trainset, self.instructions = trainset, instructions
        self._ckpt, self._key, self._work, self._gates = ckpt, key, work, gates
        self._saved = saved or (lambda: None)  # told after each saved call (the step keeps what it has spent)
        self._lms: dict[str, dspy.BaseLM] = {}
        self._failures: dict[str, tuple[list[str], int]] = {}

    def lm(self, stage: str) -> dspy.BaseLM:
        """The stage's own copy of the reflection LM (the same one for every call of the stage)."""
        if stage not in self._lms:
            self._lms[stage] = self.reflection_lm.copy()
        return self._lms[stage]

    def stage_lms(self, stage: str) -> list[dspy.BaseLM]:
        return [self._lms[stage]] if stage in self._lms else []

    def map(self, stage: str, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]` on the step's pool, metered and shown as `stage`."""
        return self._work.map(stage, fn, items)

    def call(self, unit: str, fn: Callable[[], Any]) -> Any:
        """A checkpointed learning call: the saved result, or `fn()` saved; a call that raises is a `Failed`."""
        try:
            return self._ckpt.unit(f"{self._key}/{unit}", fn, then=self._saved)
        except Exception as exc:  # a failed learning call is counted, not fatal
            return Failed(exc)

    def count_failures(self, stage: str, errors: list[str], total: int) -> None:
        """Report `total` more units of `stage`, of which `errors` failed."""
        seen, n = self._failures.get(stage, ([], 0))
        self._failures[stage] = (seen + list(errors), n + total)

    def arrive(self, stage: str, group: int) -> None:
        self._gates.arrive(stage, group)

    def wait(self, stage: str) -> None:
        """Hold until every group of the step has reached `stage` and its failure check (`check`) has passed."""
        self._gates.wait(stage)

    def check(self, stage: str) -> None:
        """Stop the step, unfinished, when more than `max_failure_rate` of the stage's units failed: an outage must
        not pass for "nothing to learn". A resume redoes the failed units."""
        errors, total = self._failures.get(stage, ([], 0))
        if total and len(errors) > self.settings.max_failure_rate * total:
            units = "attempts" if stage == "rollout" else f"{stage} calls"
            log_dir = str(self._ckpt.root) if self._ckpt.root is not None else None
            raise TooManyFailuresError(f"step {self.step}: {len(errors)} of {total} {units} failed "
                                       f"(first: {errors[0]}); finished work is kept in log_dir={log_dir!r}")

    @contextmanager
    def metered(self, stage: str):
        """Run calls outside the pool (a batch-wide call such as a consolidation) under their stage's meter."""
        with dspy.context(usage_tracker=self._work.meters[stage]):
            yield


class LearningPath:
    """The contract of a learning path (see the module docstring). Instances hold settings only; everything of one
    step lives in the `StepContext` and in the values `learn` returns, so one instance serves every step."""

    stages: tuple[str, ...] = ()

    def learn(self, ctx: StepContext, group: Group) -> Any:
        raise NotImplementedError

    def finish(self, ctx: StepContext, results: list[tuple[Group, Any]]) -> Lessons:
        raise NotImplementedError


def learn_from_groups(path: LearningPath, groups: list[Group], *, settings: Knobs, reflection_lm: dspy.BaseLM,
                      library: ExperienceLibrary, instructions: str = "") -> tuple[Lessons, dict[str, dict]]:
    """Run `path` on groups scored elsewhere (saved rollouts, say), as a step would, with nothing saved: its lessons
    and the usage of each of its stages. The library is not changed (apply the plan to a copy); `ctx.trainset` holds
    the groups' examples, by query index; `instructions`, the program's (what a rule may repeat)."""
    with metered_stages(path.stages) as meters, Workers(settings.num_threads, meters=meters,
                                                        progress=StageBars()) as work:
        informative = [g for g in groups if g.informative]
        gates = Gates([g.index for g in informative], check=lambda stage: ctx.check(stage))
        ctx = StepContext(step=0, settings=settings, reflection_lm=reflection_lm, library=library,
                          trainset={g.index: g.example for g in groups}, instructions=instructions,
                          ckpt=Checkpoint(None), key="steps/0000", work=work, gates=gates)

        def one(group):
            try:
                return path.learn(ctx, group)
            finally:
                gates.finish(group.index)

        results = work.each(one, informative)
        for stage in path.stages:
            ctx.check(stage)
        lessons = path.finish(ctx, list(zip(informative, results)))
    return lessons, {stage: stage_usage(meters[stage], ctx.stage_lms(stage)) for stage in path.stages}
