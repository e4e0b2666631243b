"""The command line as a user reads it (issue 37, item 11): help with no `<bool>` placeholders on flags and no
braces in the usage line, `-h` as `--help` on every command (issue 55), a described --verbose, --version, the
reference config shipped inside the package, "did you mean ...?" for a misspelled config key, and an unpriced
model's cost shown as unknown (n/a), not $0. Issue 77: upper-case placeholders, one description of the dry run,
help that says what a command does."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before MLflow is imported: no usage reports

import click  # noqa: E402
import pytest  # noqa: E402
import typer  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tfgrpo.cli import app  # noqa: E402
from tfgrpo.config import Config, ConfigError  # noqa: E402
from tfgrpo.testing import FakeLMServer  # noqa: E402
from tfgrpo.tracking import step_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "160", "TERMINAL_WIDTH": "160"})


def every_command(group=None, path=()) -> list[list[str]]:
    """Each command and group of the CLI as the words that name it ([] for `tfgrpo` itself), found in the app."""
    group = group or typer.main.get_command(app)
    found = [list(path)]
    for name, command in getattr(group, "commands", {}).items():
        found += every_command(command, (*path, name)) if hasattr(command, "commands") else [[*path, name]]
    return found


@pytest.mark.parametrize("command", every_command(), ids=lambda c: " ".join(c) or "tfgrpo")
def test_help_has_no_type_placeholder_on_a_flag_nor_braces_in_its_usage_line(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage, usage


@pytest.mark.parametrize("command", every_command(), ids=lambda c: " ".join(c) or "tfgrpo")
def test_h_is_help(command):
    short, long = invoke(*command, "-h"), invoke(*command, "--help")
    assert short.exit_code == 0 and short.output == long.output and "Usage:" in short.output, short.output


def test_the_usage_names_the_config_and_every_option_says_what_it_does():
    for command, argument in (("compile", "CONFIG"), ("evaluate", "CONFIG|NAME"), ("run", "CONFIG")):
        result = invoke(command, "--help")
        usage = next(line for line in result.output.splitlines() if "Usage:" in line)
        assert usage.rstrip().endswith(f"[OPTIONS] {argument}"), usage
        verbose = next(line for line in result.output.splitlines() if "--verbose" in line)
        assert "debug messages" in verbose, verbose
    assert "RUN_DIR..." in invoke("report", "--help").output


def test_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"tfgrpo {version('tfgrpo')}"


def test_the_reference_config_ships_inside_the_package(tmp_path):
    """`tfgrpo config --reference` prints configs/reference.toml, and a build of the package holds it (a link in
    the checkout, so there is one file to keep up to date); the help points to the command, not to a path an
    installed package lacks."""
    reference = (ROOT / "configs" / "reference.toml").read_text(encoding="utf-8")
    result = invoke("config", "--reference")
    assert result.exit_code == 0 and result.output == reference
    assert invoke("config").exit_code == 2  # nothing asked for
    top = invoke("--help").output
    assert "tfgrpo config --reference" in top and "configs/reference.toml" not in top
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                            "--build-lib", str(tmp_path / "lib")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    built = tmp_path / "lib" / "tfgrpo" / "reference.toml"
    assert not built.is_symlink() and built.read_text(encoding="utf-8") == reference


@pytest.mark.parametrize("toml, wanted", [
    ("[optimizer]\nnum_generation = 4\n", "optimizer.num_generation: unknown key; did you mean num_generations"),
    ('run_dri = "runs/x"\n', "run_dri: unknown key; did you mean run_dir?"),
    ('[reflection]\nmodle = "x"\n', "reflection.modle: unknown key; did you mean model?"),
    ("[trackin]\n", "trackin: unknown key; did you mean tracking?"),
    ("[evaluate]\nzzz = 1\n", "evaluate.zzz: unknown key; the keys of [evaluate]: num_runs, num_threads, seed"),
])
def test_a_misspelled_key_says_which_key_was_meant(tmp_path, toml, wanted):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        Config.load(path)
    assert wanted in str(caught.value) and "Extra inputs are not permitted" not in str(caught.value)


def test_step_metrics_leave_out_a_cost_that_is_not_known():
    stats = {"step": 0, "groups": 2, "groups_kept": 1, "library_size": 1,
             "usage": {"rollout": {"calls": 4, "prompt_tokens": 100, "completion_tokens": 20, "cost": 0.0},
                       "summary": {"calls": 2, "prompt_tokens": 50, "completion_tokens": 10, "cost": 0.002},
                       "advantage": {"calls": 1, "prompt_tokens": 40, "completion_tokens": 5},  # no history kept
                       "consolidation": {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0}}}
    metrics = step_metrics(stats)
    assert metrics["usage/rollout/tokens"] == 120 and "usage/rollout/cost" not in metrics  # unpriced: not a flat 0
    assert metrics["usage/summary/cost"] == 0.002 and "usage/advantage/cost" not in metrics
    assert metrics["usage/consolidation/calls"] == 0 and "usage/consolidation/cost" not in metrics  # no call: a gap


CONFIG = """
run_dir = "{run_dir}"
[policy]
backend = "litellm"
model = "openai/fake"
api_base = "{api_base}"
api_key_env = "TFGRPO_TEST_KEY"
max_tokens = 256
num_retries = 1
cache = false
[task]
trainset = "{data}"
train_limit = 2
evalset = "{data}"
[optimizer]
num_generations = 2
num_train_epochs = 1
batch_size = 2
num_threads = 4
[tracking]
"""


def test_an_unpriced_model_shows_its_cost_as_unknown(tmp_path, monkeypatch):
    """A model LiteLLM has no price for (a fake OpenAI-compatible server): the compile's usage lines say the cost
    is not known instead of $0.0000, and the MLflow run has no flat-zero cost curve."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TFGRPO_TEST_KEY", "unused")
    data, run_dir, config = tmp_path / "sums.jsonl", tmp_path / "run", tmp_path / "c.toml"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a, b in [(12, 7), (3, 45)]))
    with FakeLMServer() as server:
        config.write_text(CONFIG.format(run_dir=run_dir, api_base=server.api_base, data=data))
        result = invoke("compile", str(config))
    assert result.exit_code == 0, result.output
    usage_lines = [line for line in result.output.splitlines() if "new calls" in line]
    assert len(usage_lines) == 2 and all("cost n/a" in line for line in usage_lines), usage_lines
    assert "$0.0000" not in result.output
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tfgrpo").experiment_id])[0]
    assert "usage/rollout/calls" in run.data.metrics
    assert not [k for k in run.data.metrics if k.endswith("/cost")]


def command_of(words: list[str]):
    """The click command that `words` name in the app (the group itself for [])."""
    command = typer.main.get_command(app)
    for word in words:
        command = command.commands[word]
    return command


@pytest.mark.parametrize("command", every_command(), ids=lambda c: " ".join(c) or "tfgrpo")
def test_help_placeholders_are_upper_case_words(command):
    """Issue 77: no lower-case type placeholder (`<path>`, `<str>`, `<list[Path]>`); an option's value is one
    upper-case word beside it (`--api-base URL`), an argument only its name (CONFIG, RUN_DIR)."""
    output = invoke(*command, "-h").output
    assert not re.search(r"<[\w\[\], |]+>", output), output
    for param in command_of(command).get_params(click.Context(command_of(command))):
        if isinstance(param, click.Option) and not param.is_flag:
            assert param.metavar and param.metavar.isupper(), (param.name, param.metavar)
            assert re.search(rf"{param.opts[0]}\s+{param.metavar}\s", output), output


DRY_RUN = "print the plan (calls, tokens, dollars) and make no LM call"


def test_the_dry_run_is_described_one_way():
    """Issue 77: the --dry-run help, the reference config and the CLI page say the same words."""
    assert DRY_RUN in " ".join(invoke("compile", "-h").output.split())
    assert f"--dry-run: {DRY_RUN}" in invoke("config", "--reference").output
    assert f"`tfgrpo compile CONFIG --dry-run`: {DRY_RUN}" in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for text in ("call nothing", "nothing is called", "upper bounds of calls and tokens"):
        assert text not in invoke("compile", "-h").output + invoke("config", "--reference").output


def test_run_help_says_what_it_does_and_the_reference_points_to_pages_that_exist():
    """Issue 77: no "the README's main job" in any help; the reference config's pointers name files of docs/."""
    for command in every_command():
        assert "README" not in invoke(*command, "-h").output, command
    run = " ".join(invoke("run", "-h").output.split())
    assert "evaluate the compiled program against the uncompiled baseline on the same held-out problems" in run
    reference = invoke("config", "--reference").output
    assert "Tracking with MLflow" not in reference and "docs/tracking.md" in reference
    for page in re.findall(r"docs/[\w/-]+\.md", reference):
        assert (ROOT / page).is_file(), page


def test_the_cli_page_lists_every_command_with_its_options():
    """docs/cli.md's options section is what the commands themselves declare: a new option, or a changed help text,
    fails here until the page is written again."""
    from tfgrpo.cli import app
    from tfgrpo.cli_help import options_reference

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- options[^>]*-->\n(.*?)<!-- /options -->", text, flags=re.DOTALL).group(1)
    assert found == options_reference(typer.main.get_command(app)), (
        "write docs/cli.md's options section again with: python -c 'import typer; from tfgrpo.cli import app; "
        "from tfgrpo.cli_help import options_reference; print(options_reference(typer.main.get_command(app)))'")
