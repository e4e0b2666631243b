"""The CLI end to end against the fake OpenAI-compatible server: run (compile + evaluate), show, report,
dry run; plus the evaluation statistics on hand-made rows."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfgrpo.cli import app
from tfgrpo.evaluate import paired_difference, summarize
from tfgrpo.testing import FakeLMServer

runner = CliRunner()


def config(tmp_path: Path, api_base: str, **extra) -> Path:
    path = tmp_path / "fake.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[policy]
backend = "litellm"
model = "openai/fake"
api_base = "{api_base}"
max_tokens = 256
num_retries = 1
cache = false
[task]
trainset = "gsm8k_train"
train_limit = 4
evalset = "gsm8k_test"
eval_limit = 5
[optimizer]
num_generations = 3
num_train_epochs = 1
batch_size = 4
num_threads = 8
[evaluate]
num_runs = 2
num_threads = 8
{extra.get('tail', '')}
""")
    return path


def test_run_writes_every_artifact_and_report_rebuilds_from_them(tmp_path):
    with FakeLMServer(latency=0.001) as server:
        result = runner.invoke(app, ["run", str(config(tmp_path, server.api_base))])
        assert result.exit_code == 0, result.output
        calls = server.stats()["calls"]
    run = tmp_path / "run"
    for name in ("program.json", "library.json", "steps.jsonl", "limits.json", "learning_curve.png",
                 "eval/baseline.jsonl", "eval/compiled.jsonl", "eval/summary.json"):
        assert (run / name).exists(), name
    assert "compiled - baseline" in result.output and "95% bootstrap CI" in result.output
    assert "tool calls" not in result.output  # chain of thought calls no tool: no column of zeros
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["baseline"]["problems"] == 5 and summary["baseline"]["k"] == 2
    saved = json.loads((run / "program.json").read_text())
    assert saved["predict"]["lm"] is None and server.api_base not in json.dumps(saved)

    shown = runner.invoke(app, ["show", str(run / "library.json")])
    assert shown.exit_code == 0 and "experience library" in shown.output

    report = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])  # saved results only
    assert report.exit_code == 0, report.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| run | baseline | 5 x 2 |" in md and "| run | compiled | 5 x 2 |" in md
    limits = json.loads((run / "limits.json").read_text())  # what limited the run, in a line of the report
    assert f"- run: {limits['attempts_solved'][0]} of {limits['attempts_solved'][1]} attempts solved" in md
    assert f"Stopped: {limits['stopped']}." in md and limits["verdict"] in md
    assert (tmp_path / "rep" / "report.png").exists()
    assert calls > 0  # the fake server did answer the run
    # a saved file cut short, edited or written by another version: a clear error that names it, and exit code 2
    for name, text, said in (("limits.json", '{"verdict": "x"}', "lacks summary, stopped"),
                             ("worth.json", "{not json", "not readable as JSON"),
                             ("steps.jsonl", '{"step": 0}\n{"step": 1, "mean', "steps.jsonl, line 2")):
        good = (run / name).read_text() if (run / name).exists() else None
        (run / name).write_text(text)
        bad = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep2")])
        assert bad.exit_code == 2 and name in bad.output and said in bad.output, bad.output
        (run / name).write_text(good) if good is not None else (run / name).unlink()


def test_dry_run_calls_nothing(tmp_path):
    with FakeLMServer() as server:
        result = runner.invoke(app, ["compile", str(config(tmp_path, server.api_base)), "--dry-run"])
        assert server.stats()["calls"] == 0
    assert result.exit_code == 0 and "dry run" in result.output and "run total" in result.output


def test_a_dry_run_with_a_pilot_sizes_the_plan_from_the_programs_calls(tmp_path):
    """`--dry-run --pilot 2` sends the program's calls on 2 training queries, and nothing else; `--pilot` alone is
    refused."""
    with FakeLMServer() as server:
        result = runner.invoke(app, ["compile", str(config(tmp_path, server.api_base)), "--dry-run", "--pilot", "2"])
        calls = server.stats()["calls"]
    assert result.exit_code == 0 and "sized by 2 pilot queries" in result.output, result.output
    assert 2 <= calls <= 4 and "from 2 pilot call(s)" in result.output and "the pilot: " in result.output
    alone = runner.invoke(app, ["compile", str(config(tmp_path, "http://127.0.0.1:9/v1")), "--pilot", "2"])
    assert alone.exit_code == 2 and "give --dry-run too" in alone.output


def test_config_errors_exit_2_and_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nnum_generations = -1\n")
    result = runner.invoke(app, ["compile", str(bad)])
    assert result.exit_code == 2 and "optimizer.num_generations" in result.output


def rows(scores_by_problem):
    return [{"problem": p, "run": r, "score": s} for p, runs in enumerate(scores_by_problem) for r, s in enumerate(runs)]


def test_mean_at_k_pass_at_k_and_paired_ci():
    base = rows([[0, 0], [1, 0], [1, 1], [0, 0]] * 5)
    better = rows([[1, 0], [1, 1], [1, 1], [0, 1]] * 5)
    s = summarize(base)
    assert s["k"] == 2 and s["mean_at_k"] == pytest.approx(0.375) and s["pass_at_k"] == pytest.approx(0.5)
    p = paired_difference(base, better, seed=1)
    assert p["difference"] == pytest.approx(0.375) and 0 < p["ci95"][0] <= p["difference"] <= p["ci95"][1]
    same = paired_difference(base, base)
    assert same["difference"] == 0 and same["ci95"] == [0, 0]
    with pytest.raises(ValueError):
        paired_difference(base, [])
