"""The paper's "directly generated experiences" baseline: ask the LM once for N tips, learn nothing.

It shows how much of Training-Free GRPO's gain comes from learning rather than from having advice in the
prompt at all: compare it with a TF-GRPO library of the same size.
"""

from __future__ import annotations

import logging

import dspy
from dspy.teleprompt.teleprompt import Teleprompter

from tfgrpo.base import hooks
from tfgrpo.programs.inject import apply_library, resolve_targets
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.programs.render import format_fields
from tfgrpo.signatures.learning import GenerateExperiences
from tfgrpo.signatures.operations import Operation

logger = logging.getLogger(__name__)


class DirectExperiences(Teleprompter):
    def __init__(self, *, num_experiences: int, lm: dspy.BaseLM | None = None, max_words_per_experience: int = 32,
                 num_examples_shown: int = 5, target_predictors: list[str] | None = None):
        self.num_experiences = num_experiences  # match the size of the learned library being compared
        self.lm = lm  # None: dspy.settings.lm
        self.max_words_per_experience = max_words_per_experience
        self.num_examples_shown = num_examples_shown  # example queries (inputs only, never answers) in the prompt
        self.target_predictors = target_predictors
        hooks.built(self)  # trackers learn of it (tfgrpo.base.hooks)

    def compile(self, student: dspy.Module, *, trainset: list, teacher=None, valset=None) -> dspy.Module:
        targets = resolve_targets(student, self.target_predictors)
        shown = "\n\n".join(format_fields(x.inputs()) for x in trainset[: self.num_examples_shown])
        generate = dspy.Predict(GenerateExperiences)
        with dspy.context(lm=self.lm or dspy.settings.lm):
            tips = generate(task_examples=shown, count=self.num_experiences,
                            max_words=self.max_words_per_experience).experiences or []
        library = ExperienceLibrary(max_words=self.max_words_per_experience, max_experiences=self.num_experiences)
        report = library.apply([Operation(action="add", text=t) for t in tips], step=0, sources=["generated"])
        if report.rejected:
            logger.warning("%d generated experiences refused (too long, empty or duplicate)", len(report.rejected))
        compiled = apply_library(student.deepcopy(), library, targets)
        compiled.detailed_results = {"generated": len(tips), "kept": len(library)}
        compiled._compiled = True
        return compiled
