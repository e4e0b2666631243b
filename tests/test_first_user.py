"""What a first user meets: a plan that expects no step sends nothing, a log_dir that cannot be written gets one line
with the fix (and a finished run on read-only storage is still read), and a predictor built inside forward() gets a
message that names the fix."""

import contextlib
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import dspy
import pytest

from scripted_lm import ScriptedLM
from test_optimizer import make_trainset, metric
from test_resume import learner
from tfgrpo.base.util import write_atomic
from tfgrpo.optimizers import TrainingFreeGRPO


def student(messages, kwargs):
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", messages[-1]["content"])[-1]
    return {"answer": str(int(a) + int(b))}


def test_a_budget_that_pays_for_no_step_sends_nothing_and_says_why(tmp_path, caplog):
    """max_metric_calls=5 against steps of 16 attempts, with a valset and attribution: no call at all (a step, a
    validation or an attribution would each spend what the budget cannot pay for a step)."""
    lm = ScriptedLM(student)
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(metric, num_generations=4, batch_size=4, max_metric_calls=5, attribution=True,
                                 log_dir=str(tmp_path / "run"))
    plan = optimizer.plan(dspy.Predict("question -> answer"), trainset=make_trainset(8), valset=make_trainset(4))
    assert plan.expected["total"]["steps"] == 0 and "0 step(s)" in plan.summary()
    assert "no step: budget max_metric_calls=5 cannot pay for a step (16 attempts" in plan.summary()
    assert "compile sends nothing" in plan.summary()
    compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(8),
                                 valset=make_trainset(4))
    assert lm.calls == []  # not one call: no step, no validation, no attribution
    stopped = compiled.detailed_results.stopped_early
    assert "max_metric_calls=5 cannot pay for another step" in stopped and "(16 attempts" in stopped
    assert "nothing was sent" in stopped and stopped in caplog.text


def test_a_token_budget_below_the_first_step_s_estimate_is_said_as_the_run_meets_it(tmp_path):
    """Before its first call a run knows a step's cost in metric calls only: a token budget that the estimate says the
    first step passes is not "0 steps" in the plan but a first step that the budget stops, which is what compile
    does (and a resume with a larger budget goes on from its calls)."""
    lm = ScriptedLM(learner)
    dspy.configure(lm=lm)
    optimizer = TrainingFreeGRPO(metric, num_generations=4, batch_size=4, max_total_tokens=2000,
                                 log_dir=str(tmp_path / "run"))
    plan = optimizer.plan(dspy.Predict("question -> answer"), trainset=make_trainset(8))
    summary = plan.summary()
    assert plan.expected["total"]["steps"] == 1 and "1 step(s) (of" in summary and "0 step(s)" not in summary
    assert re.search(r"first step: budget max_total_tokens=2000 is below what its 16 attempts are expected to need "
                     r"\(~[\d,]+, an estimate", summary), summary
    compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(8))
    assert lm.calls and "budget max_total_tokens=2000 reached" in compiled.detailed_results.stopped_early
    assert not compiled.detailed_results.steps  # the first step did not finish


def test_a_log_dir_that_cannot_be_written_is_one_line_with_the_fix():
    folder = Path("/sys/tfgrpo-log-dir")  # (not writable even by root: the kernel's own file system)
    try:
        folder.mkdir()
    except OSError:
        pass
    else:
        folder.rmdir()
        pytest.skip("/sys is writable here")
    dspy.configure(lm=ScriptedLM(student))
    with pytest.raises(OSError, match=r"log_dir /sys/tfgrpo-log-dir cannot be written \(.*\): a compile keeps its "
                                      r"record .* Pass a writable log_dir"):
        TrainingFreeGRPO(metric, num_generations=2, log_dir=str(folder)).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset(2))


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` as read-only storage: through a read-only bind mount (root writes through permission bits), else with
    its write bits cleared."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield folder
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    view = folder.with_name(folder.name + "-ro")
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode == 0
    try:
        if not mounted:
            pytest.skip("root here cannot make a read-only bind mount")
        yield view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)
        view.rmdir()


def test_a_finished_run_on_read_only_storage_is_read_and_an_unfinished_one_names_the_fix(tmp_path):
    """A second compile on a finished run's log_dir, now on read-only storage, returns the learned program with no call
    (its steps reused); one with a step still to run stops where it would write, with the one-line fix."""
    trainset, done, half = make_trainset(4), tmp_path / "done", tmp_path / "half"

    def compile(log_dir, lm):
        dspy.configure(lm=lm)
        return TrainingFreeGRPO(metric, num_generations=2, batch_size=2, num_train_epochs=1,
                                log_dir=str(log_dir)).compile(dspy.Predict("question -> answer"), trainset=trainset)

    first = compile(done, ScriptedLM(learner))
    assert "check the carry" in first.predictors()[0].signature.instructions  # (it learned: there is a library)
    shutil.copytree(done, half)
    for path in half.glob("steps/0001*"):
        path.unlink()
    with read_only(tmp_path) as view:
        again = compile(view / "done", lm := ScriptedLM(learner))
        assert lm.calls == [] and again.predictors()[0].signature.instructions == \
            first.predictors()[0].signature.instructions
        with pytest.raises(OSError, match=r"log_dir .*half cannot be written \(.*\): .* copy the folder somewhere "
                                          r"writable and pass the copy"):
            compile(view / "half", ScriptedLM(learner))
        with pytest.raises(OSError) as refused:  # what the CLI then saves is named, not its temporary file
            write_atomic(view / "done" / "program.json", "{}")
        assert refused.value.filename == str(view / "done" / "program.json")


class BuiltInForward(dspy.Module):
    def forward(self, question):
        return dspy.Predict("question -> answer")(question=question)


class BesideOne(dspy.Module):
    def __init__(self):
        super().__init__()
        self.first = dspy.Predict("question -> answer")

    def forward(self, question):
        draft = self.first(question=question).answer
        return dspy.ChainOfThought("question, draft -> answer")(question=question, draft=draft)


def test_a_predictor_built_inside_forward_gets_the_fix_named(tmp_path, caplog, monkeypatch):
    dspy.configure(lm=ScriptedLM(lambda m, k: {"reasoning": "ok", **student(m, k)}))
    with pytest.raises(ValueError, match=r"no predictors to carry experiences: .* declare each in __init__ "
                                         r"\(self.answer = dspy.Predict\(\"question -> answer\"\)\)"):
        TrainingFreeGRPO(metric, log_dir=str(tmp_path / "a")).compile(BuiltInForward(), trainset=make_trainset(2))
    monkeypatch.setattr("tfgrpo.optimizers.workers._SAID", set())  # (said once a process: another test may have)
    with caplog.at_level(logging.WARNING):
        TrainingFreeGRPO(metric, num_generations=2, batch_size=2, num_train_epochs=1,
                         log_dir=str(tmp_path / "b")).compile(BesideOne(), trainset=make_trainset(2))
    assert "neither the library nor a demo reaches it. Declare it in __init__" in caplog.text


def test_a_metric_that_raises_on_some_attempts_scores_them_0_and_goes_on(tmp_path, caplog):
    """As dspy.Evaluate scores an example whose metric raised with its failure_score: one query's attempts of four
    raise (a judge's parser, say), the rest are scored, and the step goes on, counting them."""

    def flaky(example, pred, trace=None):
        if "What is 2 +" in example.question:
            raise SystemError("the judge's parser gave up")
        return metric(example, pred, trace)

    dspy.configure(lm=ScriptedLM(learner))  # (right on even rollout IDs: every group has contrast)
    compiled = TrainingFreeGRPO(metric=flaky, num_generations=4, batch_size=4, num_train_epochs=1,
                                log_dir=str(tmp_path / "run")).compile(dspy.Predict("question -> answer"),
                                                                       trainset=make_trainset(4))
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["details"]["metric_errors"] == 4 and step["groups"] == 4
    assert "the metric failed (timed out or raised) on 4 of 16 attempts" in caplog.text
    assert "SystemError: the judge's parser gave up" in caplog.text


def test_show_prints_no_empty_library_table():
    from typer.testing import CliRunner

    from tfgrpo.cli import app

    shown = CliRunner().invoke(app, ["show", "game24"])
    assert shown.exit_code == 0, shown.output
    assert "experience library (0 active, 1 retired): none active; 1 retired experience(s) not shown: pass --retired " \
        "to list them" in shown.output
    assert "experience " not in shown.output.split("none active")[1].split("demos (2)")[0]  # no table between


def test_a_dry_run_refuses_an_unknown_embedded_model(tmp_path):
    from typer.testing import CliRunner

    from tfgrpo.cli import app

    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "math"\n[policy]\nbackend = "local"\nmodel = "qwen2.5-coder-7b"\n')
    result = CliRunner().invoke(app, ["compile", str(config), "--dry-run"])
    assert result.exit_code != 0
    assert "'qwen2.5-coder-7b' is no embedded model" in result.output and "qwen2.5-coder-1.5b" in result.output


def test_a_config_value_of_the_wrong_type_is_refused_as_a_typo_is(tmp_path):
    from tfgrpo.config import Config, ConfigError

    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "math"\ntrain_limit = "12"\n')
    with pytest.raises(ConfigError, match=r"train_limit.*(integer|int)"):
        Config.load(config)


def test_the_command_list_flows_at_80_columns():
    """`tfgrpo -h` in an 80-column terminal: each command's description wraps where the line is full, never where its
    docstring's own lines broke."""
    from typer.testing import CliRunner

    from tfgrpo.cli import app

    shown = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["-h"], terminal_width=80)
    panel = shown.output.split("Commands")[1].split("╰")[0].splitlines()[1:]
    entries, width = [], 80 - 4 - 10  # (the borders; the commands' column)
    for line in panel:
        body = line.strip("│").rstrip()
        if body[:2].strip():  # " name  text": a new entry
            entries.append([body[10:].strip()])
        elif entries:
            entries[-1].append(body.strip())
    assert len(entries) >= 8
    for lines in entries:
        assert all(len(line) > width - 16 for line in lines[:-1]), lines
