"""Nine ways a user could lose work or learn the wrong thing without a word (issue 65), each now loud (a warning or a
refusal that names the problem) or correct, and each clean control silent. Runs against the fake LM server or the
scripted LM, from the outside, as a user would."""

import functools
import logging
import re

import dspy
import pytest
from typer.testing import CliRunner

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import LESSON, learner, make_trainset, metric
from test_trust_resume import cli_config, resume, user_module
from tfgrpo.cli import app
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.checkpoint import RunMismatchError
from tfgrpo.testing import FakeLMServer

runner = CliRunner()


def warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def compile_quietly(lm, program=None, trainset=None, **kw):
    dspy.configure(lm=lm)
    opts = dict(num_generations=4, num_train_epochs=1, batch_size=4, num_threads=2, auto=None, **kw)
    valset = opts.pop("valset", None)
    return TrainingFreeGRPO(metric, **opts).compile(program or dspy.Predict("question -> answer"),
                                                    trainset=trainset or make_trainset(), valset=valset)


# 1 -----------------------------------------------------------------------------------------------------------------
def test_duplicates_and_a_valset_that_overlaps_the_trainset_are_said(caplog):
    trainset = make_trainset(4)
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compile_quietly(ScriptedLM(learner()), trainset=trainset + trainset[:1], valset=trainset[:2])
    said = warnings(caplog)
    assert "the trainset holds 1 duplicate example(s)" in said
    assert "2 of the 2 valset example(s) are also in the trainset: their score is not held out" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compile_quietly(ScriptedLM(learner()), trainset=trainset, valset=make_trainset(6)[4:])
    assert "duplicate" not in warnings(caplog) and "not held out" not in warnings(caplog)


def test_the_cli_does_not_call_an_evaluation_on_training_problems_held_out(tmp_path):
    with FakeLMServer() as server:
        overlap = cli_config(tmp_path, server.api_base, "num_generations = 2").read_text().replace(
            'evalset = "gsm8k_test"', 'evalset = "gsm8k_train"')
        (tmp_path / "fake.toml").write_text(overlap)
        result = runner.invoke(app, ["run", str(tmp_path / "fake.toml")])
    text = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "also training problems: the scores below are not held out" in text and "held-out evaluation" not in text


# 2 -----------------------------------------------------------------------------------------------------------------
class DirectCall(dspy.Module):
    """A program that also asks the LM itself, outside its predictor."""

    def __init__(self):
        super().__init__()
        self.solve = dspy.Predict("question -> answer")

    def forward(self, question):
        dspy.settings.lm(messages=[{"role": "user", "content": f"Restate: {question}"}])
        return self.solve(question=question)


def test_a_call_outside_the_predictors_is_said_once(caplog):
    with FakeLMServer() as server:
        with caplog.at_level(logging.WARNING, logger="tfgrpo"):
            compile_quietly(server.lm(), DirectCall())
        said = warnings(caplog)
        assert said.count("called an LM outside its predictors") == 1
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tfgrpo"):
            compile_quietly(server.lm())
        assert "outside its predictors" not in warnings(caplog)


# 3 -----------------------------------------------------------------------------------------------------------------
class AsyncOnly(dspy.Module):
    def __init__(self):
        super().__init__()
        self.solve = dspy.Predict("question -> answer")

    async def aforward(self, question):
        return await self.solve.acall(question=question)


def test_an_async_only_program_is_simply_run():
    with FakeLMServer() as server:
        compiled = compile_quietly(server.lm(), AsyncOnly())
    step = compiled.detailed_results.steps[0]
    assert step.rollout_failures == 0 and step.metric_calls == 16 and step.groups_kept > 0


# 4, 5 --------------------------------------------------------------------------------------------------------------
def scaled(example, pred, trace=None, scale=1.0):
    return metric(example, pred).score * scale


def test_a_resume_with_other_metric_arguments_is_refused_and_the_same_resumes(tmp_path):
    resume(tmp_path, ScriptedLM(learner()), functools.partial(scaled, scale=1.0), max_steps=1)
    lm = ScriptedLM(learner())
    with pytest.raises(RunMismatchError, match="metric's code"):
        resume(tmp_path, lm, functools.partial(scaled, scale=0.5), max_steps=1)
    assert lm.calls == []
    assert resume(tmp_path, ScriptedLM(learner()), functools.partial(scaled, scale=1.0)).experience_library.texts() \
        == [LESSON]


AGENT = """
import dspy

PREFIX = "{prefix}"

def framed(question):
    return PREFIX + question

class Agent(dspy.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.solve = dspy.Predict("question -> answer")

    def forward(self, question):
        return self.solve(question=framed(question) if self.mode == "framed" else question)
"""


@pytest.mark.parametrize("change", ["constructor argument", "module constant"])
def test_a_resume_after_the_program_changed_outside_forward_is_refused(tmp_path, change):
    """`Agent("plain")` -> `Agent("framed")`, or the module constant a helper of `forward` reads: the finished steps
    were made by another program (the fingerprint holds the module's settings, and the helpers' code and constants)."""
    mode = "plain" if change == "constructor argument" else "framed"
    first = user_module(tmp_path, "issue65_agent", AGENT.format(prefix="Q: "))
    resume(tmp_path, ScriptedLM(learner()), metric, first.Agent(mode), max_steps=1)
    edited = first.Agent("framed") if change == "constructor argument" else \
        user_module(tmp_path, "issue65_agent", AGENT.format(prefix="Question: ")).Agent(mode)
    lm = ScriptedLM(learner())
    with pytest.raises(RunMismatchError, match="program's code"):
        resume(tmp_path, lm, metric, edited, max_steps=1)
    assert lm.calls == []
    again = user_module(tmp_path, "issue65_agent", AGENT.format(prefix="Q: "))
    assert resume(tmp_path, ScriptedLM(learner()), metric, again.Agent(mode)).experience_library.texts() == [LESSON]


def test_a_resume_scores_the_unfinished_step_with_todays_metric(tmp_path):
    """A metric that reads a setting from an object the fingerprint does not look into: a resume runs the metric
    again on what the program returns now (no copy of an attempt is scored), so the unfinished step is scored by
    today's setting, its rollouts answered from the record."""
    class Strictness:
        strict = False

    def graded(example, pred, trace=None, setting=Strictness):
        return metric(example, pred).score if setting.strict else 1.0

    first = resume(tmp_path, ScriptedLM(learner()), graded, num_train_epochs=1)
    assert [s.mean_reward for s in first.detailed_results.steps] == [1.0, 1.0]  # lenient: every attempt right
    (tmp_path / "ckpt" / "steps" / "0001.json").unlink()  # step 1 unfinished, as after a kill at its very end
    Strictness.strict = True
    lm = ScriptedLM(learner())
    again = resume(tmp_path, lm, graded, num_train_epochs=1)
    assert again.detailed_results.steps[1].mean_reward < 1.0  # today's strict metric on step 1's attempts
    assert not any(kind_of(c["messages"]) == "student" for c in lm.calls)  # the rollouts answered from the record


# 6 -----------------------------------------------------------------------------------------------------------------
def test_the_dry_run_refuses_a_run_dir_that_compile_refuses(tmp_path):
    with FakeLMServer() as server:
        config = cli_config(tmp_path, server.api_base, "num_generations = 2")
        assert runner.invoke(app, ["compile", str(config)]).exit_code == 0
        assert runner.invoke(app, ["compile", str(config), "--dry-run"]).exit_code == 0  # the same run: a resume
        config.write_text(config.read_text().replace("num_generations = 2", "num_generations = 3"))
        calls = server.stats()["calls"]
        dry = runner.invoke(app, ["compile", str(config), "--dry-run"])
        assert server.stats()["calls"] == calls
    assert dry.exit_code == 2 and "knob num_generations: 2 -> 3" in dry.output


# 7 -----------------------------------------------------------------------------------------------------------------
def test_a_long_demo_is_kept_whole(tmp_path):
    reasoning = "step " * 900  # 4,500 characters of reasoning in the winning attempt

    def respond(messages, kwargs):
        values = learner()(messages, kwargs)
        if isinstance(values, dict) and "answer" in values:
            values["reasoning"] = reasoning
        return values

    compiled = compile_quietly(ScriptedLM(respond), dspy.ChainOfThought("question -> answer"), max_demos=1)
    (demo,) = compiled.predict.demos
    assert demo.reasoning == reasoning.strip() and "characters cut" not in str(demo)


# 8 -----------------------------------------------------------------------------------------------------------------
def test_an_empty_valset_is_said_and_none_is_not(caplog):
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compile_quietly(ScriptedLM(learner()), valset=[])
    assert "valset is empty: no epoch is validated" in warnings(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compile_quietly(ScriptedLM(learner()), valset=None)
    assert "valset" not in warnings(caplog)


# 9 -----------------------------------------------------------------------------------------------------------------
def test_the_docs_save_a_compiled_program_only_the_atomic_way():
    """DSPy's own `compiled.save(path)` writes in place (a kill mid-write leaves a torn file and loses the old one);
    the README and the usage page show `save_program`, which writes a temporary file and renames it."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for page in ("README.md", "docs/usage.md"):
        text = (root / page).read_text()
        assert not re.search(r"compiled\.save\(", text.replace("`compiled.save` writes in place", "")), page
        assert "save_program(compiled" in text, page
