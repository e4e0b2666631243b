"""Issue 18: the CLI runs the user's own program, metric and data from a config that names them (against the fake
OpenAI-compatible server), documents every config field, and ends errors with one clear line."""

import json
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package

from tfgrpo.testing import FakeLMServer  # noqa: E402
from tfgrpo.cli import app  # noqa: E402
from tfgrpo.config import Config  # noqa: E402

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

AGENT = '''
import dspy


class Agent(dspy.Module):
    """The user's program: a chain of thought behind a step of its own."""

    def __init__(self):
        super().__init__()
        self.solve = dspy.ChainOfThought("question -> answer")

    def forward(self, question):
        return self.solve(question=question.strip())


def metric(example, pred):  # two arguments, as dspy.Evaluate calls it
    return pred.answer.strip() == example.answer
'''


def user_project(tmp_path: Path, module: str) -> dict:
    """A module file and two data files written by the user, and the module's folder on sys.path."""
    (tmp_path / f"{module}.py").write_text(AGENT)
    data = tmp_path / "data"
    data.mkdir()
    for name, numbers in (("train", range(4)), ("eval", range(10, 15))):
        rows = [{"id": f"{name}-{i}", "question": f"What is {i} + {2 * i}?", "answer": str(3 * i)} for i in numbers]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": data / "train.jsonl", "eval": data / "eval.jsonl"}


def config(tmp_path: Path, api_base: str, program: str, files: dict, *, optimizer: str = "", task: str = "",
           threads: int = 4) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent(f"""
        run_dir = "{tmp_path / 'run'}"
        [policy]
        backend = "litellm"
        model = "openai/fake"
        api_base = "{api_base}"
        num_retries = 1
        cache = false
        [task]
        program = "{program}"
        metric = "{program.rsplit(':', 1)[0]}:metric"
        trainset = "{files['train']}"
        evalset = "{files['eval']}"
        input_keys = ["question"]
        {task}
        [optimizer]
        num_generations = 3
        num_train_epochs = 1
        batch_size = 4
        num_threads = {threads}
        {optimizer}
        [evaluate]
        num_threads = 4
        """))
    return path


def test_run_and_compile_a_users_own_program_from_a_config(tmp_path, monkeypatch):
    files = user_project(tmp_path, "issue18_agent")
    monkeypatch.syspath_prepend(str(tmp_path))
    with FakeLMServer(latency=0.001) as server:
        path = config(tmp_path, server.api_base, "issue18_agent:Agent", files)
        assert Config.load(path).task.name == "custom"  # picked because program names a module
        result = runner.invoke(app, ["run", str(path)])
        assert result.exit_code == 0, result.output
        calls = server.stats()["calls"]
        again = runner.invoke(app, ["compile", str(path)])  # finished: everything is reused
        assert again.exit_code == 0, again.output
        assert server.stats()["calls"] == calls, "a finished compile sends nothing"
    run = tmp_path / "run"
    saved = json.loads((run / "program.json").read_text())
    assert "solve.predict" in saved, "the user's own program was compiled"
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["baseline"]["problems"] == summary["compiled"]["problems"] == 5
    assert "compiled - baseline" in result.output
    assert "policy: 0 new calls (12 more in the run's record)" in again.output
    assert "\x1b[" not in result.output, "no escape codes in a log"


def test_a_program_given_as_a_file_path_and_a_data_error_naming_the_row(tmp_path):
    files = user_project(tmp_path, "issue18_agent_file")
    with FakeLMServer() as server:
        path = config(tmp_path, server.api_base, f"{tmp_path / 'issue18_agent_file.py'}:Agent", files,
                      optimizer="max_total_tokens = 5000")
        dry = runner.invoke(app, ["compile", str(path), "--dry-run"])
        assert dry.exit_code == 0, dry.output
        assert "max_total_tokens = 5,000: charged before each unit of work" in " ".join(dry.output.split())
        files["train"].write_text('{"query": "What is 1 + 2?", "answer": "3"}\n')
        bad = runner.invoke(app, ["compile", str(path)])
        assert server.stats()["calls"] == 0
    assert bad.exit_code == 2 and "line 1: no field ['question'] (task.input_keys)" in bad.output
    assert "Traceback" not in bad.output


def test_errors_are_one_line_with_exit_code_2_and_a_traceback_only_with_debug(tmp_path):
    files = user_project(tmp_path, "issue18_unused")
    path = config(tmp_path, "http://127.0.0.1:9/v1", "issue18_no_such_module:Agent", files)
    result = runner.invoke(app, ["compile", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "task.program = 'issue18_no_such_module:Agent': cannot import 'issue18_no_such_module'" in result.output
    debug = runner.invoke(app, ["compile", str(path), "--debug"])
    assert debug.exit_code == 1 and isinstance(debug.exception, ValueError)

    (tmp_path / "notes.json").write_text("these are not JSON")
    shown = runner.invoke(app, ["show", str(tmp_path / "notes.json")])
    assert shown.exit_code == 2 and "not a JSON file" in shown.output and "Traceback" not in shown.output
    assert len(shown.output.strip().splitlines()) == 2  # the error, and how to see the traceback


def test_a_changed_config_is_refused_naming_the_run_dir_and_each_field(tmp_path, monkeypatch):
    files = user_project(tmp_path, "issue18_agent_changed")
    monkeypatch.syspath_prepend(str(tmp_path))
    with FakeLMServer(latency=0.001) as server:
        path = config(tmp_path, server.api_base, "issue18_agent_changed:Agent", files)
        assert runner.invoke(app, ["compile", str(path)]).exit_code == 0
        calls = server.stats()["calls"]
        path = config(tmp_path, server.api_base, "issue18_agent_changed:Agent", files, optimizer="temperature = 1.5")
        changed = runner.invoke(app, ["compile", str(path)])
        assert server.stats()["calls"] == calls
        path = config(tmp_path, server.api_base, "issue18_agent_changed:Agent", files, threads=2,
                      optimizer="max_failure_rate = 0.9")
        resumed = runner.invoke(app, ["compile", str(path)])
        assert resumed.exit_code == 0, resumed.output  # execution settings may change on resume
        assert server.stats()["calls"] == calls
    assert changed.exit_code == 2 and f"run_dir {tmp_path / 'run'} already holds work of a run made with other settings" in changed.output
    assert "temperature: 0.7 -> 1.5" in changed.output and str(tmp_path / "run" / "checkpoint") in changed.output


def test_the_reference_config_loads_and_documents_every_field():
    path = ROOT / "configs" / "reference.toml"
    Config.load(path)
    text = path.read_text()
    sections = {"": Config, **{name: field.annotation for name, field in Config.model_fields.items()
                               if name not in ("reflection", "judge", "tracking", "run_dir")}}
    for section, model in sections.items():
        body = text.split(f"\n[{section}]", 1)[-1].split("\n[", 1)[0] if section else text.split("\n[", 1)[0]
        for field in model.model_fields:
            if section == "" and field not in ("run_dir",):
                continue
            assert f"\n{field} =" in body or f"\n# {field} =" in body, f"[{section}] {field} is not documented"
    assert "# [reflection]" in text and "# [judge]" in text and "# [tracking]" in text
    with pytest.raises(tomllib.TOMLDecodeError):  # the commented fields are examples, not live values
        tomllib.loads(text.replace("# metric =", "metric =").replace("# train_metric =", "metric ="))
