"""The end of a tracked compile, and what a later command does to its run (issue 37, item 9): the best validation
score, the epoch whose library was kept and a budget's reason reach the run with no false warning, and a command
refused on its inputs leaves a finished run FINISHED. MLflow's own local store (a SQLite file) in tmp_path; the
file-system store is refused by MLflow 3 unless MLFLOW_ALLOW_FILE_STORE is set."""

import json
import logging
import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before MLflow is imported: no usage reports

import dspy  # noqa: E402
import mlflow  # noqa: E402
import pytest  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from scripted_lm import ScriptedLM  # noqa: E402
from test_optimizer import make_trainset, metric  # noqa: E402
from test_resume import learner  # noqa: E402
from test_tracking import _in_tmp, empty_store, new_store  # noqa: E402,F401 (fixtures: a store per test, in tmp_path)
from tfgrpo.cli import app  # noqa: E402
from tfgrpo.config import Config  # noqa: E402
from tfgrpo.optimizers import TrainingFreeGRPO  # noqa: E402
from tfgrpo.tracking import config_run, stored_run_id  # noqa: E402


@pytest.mark.parametrize("case", ["valset", "budget"])
def test_the_end_of_a_compile_is_logged_with_no_false_warning(tmp_path, empty_store, caplog, case):
    """With a valset: val/best_score and the kept epoch (the best); stopped by a budget: the reason, and the last
    epoch as the kept one. Before the fix every compile warned "'TrainingFreeGRPOResult' object has no attribute
    'get'" and logged neither."""
    mlflow.set_tracking_uri(new_store(empty_store, tmp_path / "mlflow.db"))
    mlflow.set_experiment(f"end-{case}")
    dspy.configure(lm=ScriptedLM(learner))
    budget = {"max_metric_calls": 4} if case == "budget" else {}  # step 0's 2 x 2 attempts, then no more
    optimizer = TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=2, batch_size=2, num_threads=1,
                                 log_dir=str(tmp_path / "log"), use_mlflow=True, **budget)
    with caplog.at_level(logging.WARNING):
        compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=make_trainset(2),
                                     valset=make_trainset(2) if case == "valset" else None)
    results = compiled.detailed_results
    assert [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()] == []
    run = MlflowClient().get_run(stored_run_id(tmp_path / "log"))
    assert run.info.status == "FINISHED"
    tags, metrics = run.data.tags, run.data.metrics
    if case == "valset":
        assert results.best_epoch == 1 and len(results.epochs) == 2  # ties go to the later epoch
        assert metrics["val/best_score"] == results.best_val_score
        assert tags["tfgrpo.kept_epoch"].startswith("1 (best val/score")
        assert "tfgrpo.stopped_early" not in tags
    else:
        assert "max_metric_calls" in results.stopped_early and len(results.steps) == 1
        assert tags["tfgrpo.stopped_early"] == results.stopped_early
        assert tags["tfgrpo.kept_epoch"] == "0 (the last; no valset)"
        assert "val/best_score" not in metrics


CONFIG = """
run_dir = "{run_dir}"
[policy]
backend = "litellm"
model = "openai/fake"
api_base = "http://127.0.0.1:9/v1"
api_key_env = "TFGRPO_TEST_KEY"
[task]
trainset = "{data}"
evalset = "{data}"
[tracking]
"""


def test_a_command_refused_on_its_inputs_leaves_a_finished_run_finished(tmp_path, empty_store, monkeypatch):
    """`tfgrpo evaluate --program missing.json` fails before it evaluates anything: the run_dir's MLflow run,
    finished by an earlier command, stays FINISHED (it was marked FAILED)."""
    monkeypatch.setenv("TFGRPO_TEST_KEY", "unused")
    data, run_dir = tmp_path / "sums.jsonl", tmp_path / "run"
    data.write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.format(run_dir=run_dir, data=data))
    uri = new_store(empty_store, run_dir / "mlflow" / "mlflow.db")  # where the CLI's default store goes
    cfg = Config.load(config)
    with config_run(cfg.tracking, run_dir, log_dir=run_dir / "checkpoint") as run:  # an earlier command's run
        mlflow.log_metric("eval/paired/difference", 0.25)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run.info.run_id).info.status == "FINISHED"

    result = CliRunner().invoke(app, ["evaluate", str(config), "--program", str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and "missing.json" in result.output, result.output
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
