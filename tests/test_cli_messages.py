"""What the command line prints (issue 77): a dry run that needs no API key and says what a run will
need, and warns of a batch larger than the trainset; report and library text printed as written, never read as rich
markup; config errors on one line in a TOML file's terms; a missing data file named by its key; a missing run
folder said so; the tool-calls column and panel only for a task with tools; retired experiences on request."""

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfgrpo.cli import app

UNSET = "TFGRPO_SURELY_UNSET_KEY"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "160", "TERMINAL_WIDTH": "160"})


def sums(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n"
                            for a in range(n)))
    return path


def config(tmp_path: Path, optimizer: str = "num_generations = 2\nbatch_size = 50", **task: str) -> Path:
    """A config of a provider LM whose key is in an unset variable, on two training problems (`task` replaces the
    [task] keys it names), batch 50 unless `optimizer` says otherwise."""
    data = str(sums(tmp_path / "sums.jsonl", 2))
    keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {"trainset": data, "evalset": data, **task}.items())
    path = tmp_path / "c.toml"
    path.write_text(f'run_dir = "{tmp_path / "run"}"\n[policy]\nbackend = "litellm"\nmodel = "openai/gpt-4o-mini"\n'
                    f'api_base = "http://127.0.0.1:9/v1"\napi_key_env = "{UNSET}"\n[task]\n{keys}'
                    f"[optimizer]\n{optimizer}\n")
    return path


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)


def test_a_dry_run_needs_no_api_key_and_says_a_run_does(tmp_path):
    path = config(tmp_path)
    dry = invoke("compile", str(path), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "dry run" in dry.output and "run total" in dry.output
    assert f"{UNSET} (policy.api_key_env) is not set in the environment: the dry run needs no key, a run does" \
        in dry.output
    real = invoke("compile", str(path))  # refused before anything starts
    assert real.exit_code == 2
    assert f"policy.api_key_env names '{UNSET}', which is not set in the environment" in real.output
    assert "an API key it needs is not in the environment" in real.output and "invalid config" not in real.output


def test_a_dry_run_warns_of_a_batch_larger_than_the_trainset(tmp_path):
    dry = invoke("compile", str(config(tmp_path)), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "warning: batch_size 50 is larger than the trainset (2 examples): each step uses all 2 examples" \
        in dry.output
    fits = invoke("compile", str(config(tmp_path, "num_generations = 2\nbatch_size = 2")), "--dry-run")
    assert fits.exit_code == 0 and "larger than the trainset" not in fits.output, fits.output


@pytest.mark.parametrize("optimizer, line", [
    ('auto = "bogus"', "optimizer.auto must be 'auto', 'off', 'light', 'medium', 'heavy' or 'paper', not 'bogus'"),
    ("max_cost = -1", "optimizer.max_cost must be a number > 0 (USD), not -1.0; or remove the key (its value is then "
                      "None)"),
    ("target_predictors = []", "optimizer.target_predictors must be a non-empty list of predictor names, not []; or "
                               "remove the key (its value is then None)"),
    ("num_generations = 0", "optimizer.num_generations must be an integer >= 1, not 0"),
])
def test_a_config_error_is_one_line_in_toml_terms(tmp_path, optimizer, line):
    result = invoke("compile", str(config(tmp_path, optimizer)), "--dry-run")
    assert result.exit_code == 2
    assert line in [row.strip() for row in result.output.splitlines()], result.output
    assert "Value error" not in result.output and "None or" not in result.output and "=None" not in result.output


def test_a_section_error_names_the_section_and_the_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[task]\nprogram = "agent:Agent"\n')
    result = invoke("compile", str(path), "--dry-run")
    assert result.exit_code == 2
    assert "task: your own program needs metric, input_keys, trainset, evalset too" in result.output, result.output


@pytest.mark.parametrize("key", ["trainset", "valset"])
def test_a_missing_data_file_is_named_by_its_key(tmp_path, key):
    result = invoke("compile", str(config(tmp_path, **{key: "missing.jsonl"})), "--dry-run")
    assert result.exit_code == 2
    assert f"error: task.{key}: unknown question set 'missing.jsonl'" in result.output, result.output


def test_a_missing_evalset_is_named_by_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv(UNSET, "unused")  # nothing is called: the evalset is read first
    (tmp_path / "program.json").write_text("{}")
    result = invoke("evaluate", str(config(tmp_path, evalset="gone.jsonl")), "--program", str(tmp_path / "program.json"))
    assert result.exit_code == 2
    assert "error: task.evalset: unknown question set 'gone.jsonl'" in result.output, result.output


def test_report_of_a_missing_folder_says_so(tmp_path):
    result = invoke("report", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "rep"))
    assert result.exit_code == 2
    assert f"no such folder: {tmp_path / 'nonexistent'}" in result.output and "eval/" not in result.output


def run_dir(tmp_path: Path, tool_calls: int) -> Path:
    """A run directory as a compile and an evaluation leave it: two problems, two steps."""
    run = tmp_path / f"run{tool_calls}"
    (run / "eval").mkdir(parents=True)
    for name, scores in (("baseline", (0.0, 1.0)), ("compiled", (1.0, 1.0))):
        (run / "eval" / f"{name}.jsonl").write_text("".join(
            json.dumps({"program": name, "problem": i, "run": 0, "score": s, "tool_calls": tool_calls}) + "\n"
            for i, s in enumerate(scores)))
    (run / "steps.jsonl").write_text("".join(
        json.dumps({"step": i, "mean_reward": 0.5, "library_size": i + 1, "tool_calls_mean": float(tool_calls)}) + "\n"
        for i in range(2)))
    return run


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_report_prints_its_markdown_as_written_without_tool_calls_for_a_task_without_tools(tmp_path):
    result = invoke("report", str(run_dir(tmp_path, 0)), "--out", str(tmp_path / "rep"))
    assert result.exit_code == 0, result.output
    assert "![learning dynamics](report.png)" in result.output and "!(report.png)" not in result.output
    assert "| Mean@k [95% CI] |" in result.output and "| vs baseline [95% CI] |" in result.output
    assert "tool calls" not in result.output and "tool calls" not in (tmp_path / "rep" / "report.md").read_text()
    assert png_width(tmp_path / "rep" / "report.png") == 8 * 110  # two panels: reward and library size


def test_report_shows_tool_calls_for_a_task_with_tools(tmp_path):
    result = invoke("report", str(run_dir(tmp_path, 3)), "--out", str(tmp_path / "rep"))
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("| run |"))
    row = next(line for line in result.output.splitlines() if line.startswith("| run3 | compiled |"))
    assert "| tool calls |" in header and "| 3.00 |" in row and header.count("|") == row.count("|")
    assert png_width(tmp_path / "rep" / "report.png") == 12 * 110  # and the tool-calls panel


def test_show_prints_experience_text_as_written(tmp_path):
    text = "Read [learning dynamics] first, then [bold]check[/bold] the sum."
    entry = {"id": "E1", "text": text, "created_step": 0, "sources": ["train#0:[q1]"],
             "history": [{"step": 0, "action": "add", "text": text, "related": []}]}
    path = tmp_path / "library.json"
    path.write_text(json.dumps({"format": "tfgrpo.experience_library/1", "max_words": 32, "next_id": 2,
                                "experiences": [entry], "retired": []}))
    result = invoke("show", str(path))
    assert result.exit_code == 0, result.output
    assert text in result.output and "train#0:[q1]" in result.output
    assert "retired experience" not in result.output  # none to show


def test_a_message_with_brackets_keeps_them(tmp_path, monkeypatch):
    """A message that names the [tracking] section keeps its brackets: they are no rich markup."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    monkeypatch.setenv(UNSET, "unused")  # nothing is called: the check comes first
    path = config(tmp_path)
    path.write_text(path.read_text() + "[tracking]\n")
    result = invoke("compile", str(path))
    assert result.exit_code == 2
    assert "[tracking] needs MLflow: pip install -e '.[mlflow]'" in result.output, result.output


def test_show_lists_retired_experiences_on_request():
    hidden = invoke("show", "game24")
    assert hidden.exit_code == 0, hidden.output
    assert "experience library (0 active, 1 retired)" in hidden.output
    assert "1 retired experience(s) not shown: pass --retired to list them" in hidden.output
    assert "Add the '*' operator" not in hidden.output
    shown = invoke("show", "game24", "--retired")
    assert shown.exit_code == 0, shown.output
    assert "E1 (retired)" in shown.output and "Add the '*' operator" in shown.output and "add > delete" in shown.output
    assert "not shown" not in shown.output
