"""Learning paths are plug-ins: a user's own path runs through compile, and the record of a step has the same
fields whatever the path."""

import dspy
import pytest

from scripted_lm import ScriptedLM
from test_contrast import compile_contrast, contrast_learner
from test_optimizer import LESSON, compile_with, learner
from tfgrpo.optimizers.records import Failed, Lessons, StepResult, TrainingFreeGRPOResult
from tfgrpo.optimizers.runner import LearningPath
from tfgrpo.signatures.operations import Operation


class WorstAnswerPath(LearningPath):
    """A user's path: per group, one LM call asks what the worst attempt got wrong; every reply becomes a rule."""

    stages = ("why",)

    def learn(self, run, scope, library, group):
        worst = min(group.attempts, key=lambda a: a.reward)

        def call():
            with dspy.context(lm=run.reflection_lm):
                return dspy.Predict("attempt, feedback -> rule")(attempt=worst.text, feedback=worst.feedback).rule
        return scope.call("why", call)  # charged, recorded, counted

    def finish(self, run, scope, library, results):
        proposals = [(group.key, Operation(action="add", text=rule)) for group, rule in results
                     if not isinstance(rule, Failed)]
        return Lessons(plan=[op for _, op in proposals][:1], proposals=proposals,
                       learning_failures=sum(isinstance(r, Failed) for _, r in results))


def _rule_lm():
    student = learner()

    def respond(messages, kwargs):
        if "`rule`" in messages[0]["content"]:
            return {"rule": LESSON}
        return student(messages, kwargs)
    return ScriptedLM(respond)


def test_a_user_defined_path_runs_through_compile_and_resumes(tmp_path):
    lm = _rule_lm()
    compiled = compile_with(lm, dspy.Predict("question -> answer"), learning_path=WorstAnswerPath(),
                            log_dir=str(tmp_path / "ckpt"))
    assert compiled.experience_library.texts() == [LESSON]
    step = compiled.detailed_results.steps[0]
    assert step.learning_path == "WorstAnswerPath" and step.usage["why"]["calls"] == 4 and step.operations_proposed == 4
    calls = len(lm.calls)
    compile_with(lm, dspy.Predict("question -> answer"), learning_path=WorstAnswerPath(), log_dir=str(tmp_path / "ckpt"))
    assert len(lm.calls) == calls  # every finished step reused


def test_a_failing_user_path_stops_at_its_stage_check():
    def respond(messages, kwargs):
        if "`rule`" in messages[0]["content"]:
            raise RuntimeError("reflection endpoint down")
        return learner()(messages, kwargs)

    with pytest.raises(RuntimeError, match="4 of 4 why calls failed"):
        compile_with(ScriptedLM(respond), dspy.Predict("question -> answer"), learning_path=WorstAnswerPath())


def test_the_step_record_has_the_same_fields_on_both_paths():
    paper = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer")).detailed_results
    contrast = compile_contrast(ScriptedLM(contrast_learner())).detailed_results
    assert isinstance(paper, TrainingFreeGRPOResult) and isinstance(paper.steps[0], StepResult)
    assert paper.to_dict()["steps"][0].keys() == contrast.to_dict()["steps"][0].keys()
    assert paper.steps[0].learning_path == "paper" and contrast.steps[0].learning_path == "contrast"
    assert contrast.steps[0].details["redundant"] == 3 and paper.steps[0].details == {}


def test_a_teacher_is_refused():
    from tfgrpo.optimizers import TrainingFreeGRPO

    with pytest.raises(ValueError, match="no teacher"):
        TrainingFreeGRPO(lambda e, p, t=None: 1.0).compile(dspy.Predict("q -> a"), trainset=[1], teacher=object())


def test_a_path_learns_from_groups_it_is_given_and_the_plan_applies_to_a_copy():
    """What benchmarks/learning_paths.py does: a learning path alone, on groups scored elsewhere (no rollout)."""
    from test_optimizer import make_trainset
    from tfgrpo.optimizers.records import Group, Scored
    from tfgrpo.optimizers.contrast_path import ContrastPath
    from tfgrpo.optimizers.knobs import Knobs
    from tfgrpo.optimizers.step import learn_from_groups
    from tfgrpo.programs.library import ExperienceLibrary

    lm = ScriptedLM(contrast_learner())
    trainset = make_trainset(2)
    groups = [Group(index=i, key=f"train#{i}", example=ex, attempts=tuple(
        Scored(outputs={"answer": a}, error=None, trace=[], tool_calls=0, text=f"answer: {a}", reward=r, g=g)
        for g, (a, r) in enumerate(((ex.answer, 1.0), ("-1", 0.0))))) for i, ex in enumerate(trainset)]
    start = ExperienceLibrary()
    lessons, usage = learn_from_groups(ContrastPath(), groups, settings=Knobs(constrained_decoding="off",
                                       max_operations_per_group=1), reflection_lm=lm, library=start)
    assert [op.text for op in lessons.plan] == [LESSON] and usage["contrast"]["calls"] == 2
    library = start.copy()
    report = library.apply(lessons.plan, step=0)
    assert library.texts() == [LESSON] and report.num_applied == 1 and len(start) == 0  # the start is untouched
