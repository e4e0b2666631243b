"""Issue 37, item 8: the small things a run must say or clean up: a full disk names the file, a key pasted where a
variable's name belongs is never echoed, temporary files of a killed run are cleared, and attempts the LM refused
for context length are said on the console."""

import errno
import logging
import os

import dspy
import litellm
import pytest

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import make_trainset
from test_resume import learner
from tfgrpo.base import util
from tfgrpo.config import Config, ConfigError
from tfgrpo.optimizers import TrainingFreeGRPO

OPTS = dict(num_generations=4, num_train_epochs=1, batch_size=4, num_threads=4)
SECRET = "sk-proj-Ab3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW"


def exact(example, pred, trace=None):
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(util.os, "fsync", full)
    target = tmp_path / "steps" / "0000" / "done.json"
    with pytest.raises(OSError) as info:
        util.write_atomic(target, "{}")
    assert info.value.errno == errno.ENOSPC and str(target) in str(info.value)
    assert not list(target.parent.iterdir()), "no temporary file is left behind"


@pytest.mark.parametrize("section", ["policy", "web"])
def test_a_key_pasted_into_api_key_env_is_refused_without_being_shown(tmp_path, section):
    head = '[policy]\nbackend = "litellm"\nmodel = "openai/x"\n'
    path = tmp_path / "c.toml"
    path.write_text(head + (f'api_key_env = "{SECRET}"\n' if section == "policy" else
                            f'[web]\nsearch = "serper"\napi_key_env = "{SECRET}"\n'))
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    assert "looks like a key, not the name of an environment variable" in str(info.value)
    assert SECRET not in str(info.value) and SECRET[:8] not in str(info.value)


def test_an_unset_variable_name_is_still_named(tmp_path, monkeypatch):
    monkeypatch.delenv("MY_PROVIDER_KEY", raising=False)
    path = tmp_path / "c.toml"
    path.write_text('[policy]\nbackend = "litellm"\nmodel = "openai/x"\napi_key_env = "MY_PROVIDER_KEY"\n')
    with pytest.raises(ConfigError, match="api_key_env names 'MY_PROVIDER_KEY', which is not set"):
        Config.load(path)


def test_temporary_files_left_by_a_killed_run_are_removed_on_resume(tmp_path):
    dspy.configure(lm=ScriptedLM(learner))
    TrainingFreeGRPO(exact, log_dir=str(tmp_path), **OPTS).compile(dspy.Predict("question -> answer"),
                                                                  trainset=make_trainset())
    folder = tmp_path / "steps"
    stale = [folder / f".0000.json.{'a' * 32}.tmp", tmp_path / f".run.json.{'0' * 32}.tmp"]  # as SIGTERM leaves them
    for path in stale:
        path.write_text('{"half": ')
    theirs = folder / ".notes.tmp"  # not a name our writer makes: left alone
    theirs.write_text("mine")
    TrainingFreeGRPO(exact, log_dir=str(tmp_path), **OPTS).compile(dspy.Predict("question -> answer"),
                                                                  trainset=make_trainset())
    assert not any(p.exists() for p in stale) and theirs.exists()


def test_attempts_refused_for_context_length_are_said_on_the_console(caplog):
    def respond(messages, kwargs):
        if kind_of(messages) == "student" and "What is 2 + 12?" in messages[-1]["content"]:
            raise litellm.ContextWindowExceededError("This model's maximum context length is 8192 tokens",
                                                     model="fake", llm_provider="openai")
        return learner(messages, kwargs)

    dspy.configure(lm=ScriptedLM(respond))
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = TrainingFreeGRPO(exact, **OPTS).compile(dspy.Predict("question -> answer"),
                                                           trainset=make_trainset())
    assert compiled.detailed_results.to_dict()["steps"][0]["rollout_failures"] == 4
    assert "Step 0: 4 attempt(s) refused by the LM for context length" in caplog.text
