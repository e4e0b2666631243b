"""Config files: every shipped config loads; errors name the file and the field; keys stay in the environment."""

from pathlib import Path

import pytest

from tfgrpo.config import Config, ConfigError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    monkeypatch.setenv("DEEPSEEK_API_KEY", "x")
    config = Config.load(path)
    assert config.policy.model and config.run_dir


def test_defaults_select_the_embedded_model(tmp_path):
    (tmp_path / "c.toml").write_text("")
    config = Config.load(tmp_path / "c.toml")
    assert config.policy.backend == "local" and config.reflection is None


@pytest.mark.parametrize("text, field", [
    ("[optimizer]\nnum_generations = 0", "optimizer.num_generations"),
    ("[optimizer]\nnum_generation = 4", "optimizer.num_generation"),  # misspelled knob
    ("[policy]\nbackend = 'cloud'", "policy.backend"),
    ("[task]\nprogram = 'tot'", "task.program"),
    ("[policy]\napi_key_env = 'TFGRPO_SURELY_UNSET_KEY'", "policy"),
])
def test_errors_name_the_file_and_the_field(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        Config.load(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config"):
        Config.load(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("[policy\nmodel=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(tmp_path / "broken.toml")


def test_the_key_is_read_from_the_environment_only(tmp_path, monkeypatch):
    from tfgrpo.lms import _build

    monkeypatch.setenv("MY_PROVIDER_KEY", "sk-test-secret")
    (tmp_path / "c.toml").write_text("[policy]\nbackend='litellm'\nmodel='openai/x'\napi_key_env='MY_PROVIDER_KEY'\n"
                                     "api_base='http://127.0.0.1:9/v1'")
    config = Config.load(tmp_path / "c.toml")
    assert "sk-test-secret" not in config.model_dump_json()
    lm = _build(config.policy, None, {})
    assert lm.kwargs["api_key"] == "sk-test-secret" and "api_key" not in str(lm.dump_state())
