"""MLflow tracking against a real local MLflow store (SQLite), read back with the MLflow client: DSPy's
autolog captures a compile whatever the import order, tfgrpo's own figures land in the same run, a resume
continues its run, the CLI logs compile and evaluation into one run in the run dir, and no key reaches the
store. Autolog patches classes process-wide, so those tests run their compile in a fresh interpreter."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before MLflow is imported: no usage reports

import dspy  # noqa: E402
import mlflow  # noqa: E402
import pytest  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from scripted_lm import ScriptedLM  # noqa: E402
from test_optimizer import make_trainset, metric  # noqa: E402
from test_resume import Crash, crashing, learner  # noqa: E402
from tfgrpo.cli import app  # noqa: E402
from tfgrpo.config import Config, ConfigError  # noqa: E402
from tfgrpo.optimizers import TrainingFreeGRPO  # noqa: E402
from tfgrpo.tracking import step_metrics, stored_run_id  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the benchmarks package
from tfgrpo.testing import FakeLMServer  # noqa: E402

SECRET = "sk-tfgrpo-test-SECRET-4242"
OUR_ARTIFACTS = {"library.json", "library.md", "program.json", "steps.jsonl", "learning_curve.png"}


@pytest.fixture(scope="module")
def server():
    with FakeLMServer(latency=0.0) as s:
        yield s


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """MLflow puts a SQLite store's artifacts under ./mlruns unless told otherwise: here, not in the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """A new SQLite store, made once: MLflow builds its tables in seconds, a copy takes milliseconds."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def new_store(empty_store: Path, path: Path) -> str:
    """A fresh store at `path` (a copy of the empty one); its URI."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(empty_store, path)
    return f"sqlite:///{path}"


def mentions_secret(folder: Path) -> list[str]:
    """Files under `folder` (the SQLite store, artifacts, checkpoints) whose bytes contain the key."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def the_run(uri: str, experiment: str):
    """The one live run of `experiment` (failing when there are more), and the client."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0], client


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


AUTOLOG_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[4])
    import mlflow
    order, api_base, log_dir = sys.argv[1:4]
    mlflow.set_experiment(f"autolog-{order}")
    autolog = lambda: mlflow.dspy.autolog(log_compiles=True, log_evals=True, log_traces_from_compile=True)
    if order == "before":
        autolog()
    import dspy
    from tfgrpo.optimizers import TrainingFreeGRPO
    if order == "after":
        autolog()

    def metric(example, pred, trace=None):
        return float(str(pred.answer).strip() == example.answer)

    pairs = [(12, 7), (3, 45), (51, 6), (7, 80)]
    data = [dspy.Example(question=f"What is {a} + {b}?", answer=str(a + b)).with_inputs("question") for a, b in pairs]
    dspy.configure(lm=dspy.LM("openai/fake", api_base=api_base, api_key=sys.argv[5], cache=False))
    for attempt in ("first", "resumed"):  # the second compile resumes the finished log_dir
        optimizer = TrainingFreeGRPO(metric, num_generations=3, batch_size=2, num_train_epochs=2, num_threads=4,
                                     log_dir=log_dir, progress=lambda *_: None)
        compiled = optimizer.compile(dspy.Predict("question -> answer"), trainset=data, valset=data[:2])
    print(json.dumps({"run_id": mlflow.last_active_run().info.run_id, "steps": compiled.detailed_results.to_dict()["steps"],
                      "epochs": compiled.detailed_results.to_dict()["epochs"], "patched": "mlflow" in sys.modules}))
""")


@pytest.mark.parametrize("order", ["before", "after"])
def test_dspy_autolog_captures_a_compile_whatever_the_import_order(tmp_path, server, empty_store, order):
    """mlflow.dspy.autolog() called before or after importing tfgrpo: one run holds autolog's own logging and
    tfgrpo's, and compiling the same log_dir again goes on in that run."""
    store = tmp_path / "store"
    uri = new_store(empty_store, store / "mlflow.db")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    log_dir = tmp_path / "log"
    done = subprocess.run([sys.executable, "-c", AUTOLOG_SCRIPT, order, server.api_base, str(log_dir), str(ROOT),
                           SECRET], cwd=store, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    run, client = the_run(uri, f"autolog-{order}")  # the resumed compile made no second live run
    assert run.info.run_id == out["run_id"] == stored_run_id(log_dir)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.autologging"] == "dspy"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"best_model.json", "trainset.json", "valset.json"} <= artifacts  # autolog's own
    assert OUR_ARTIFACTS <= artifacts  # tfgrpo's
    steps = out["steps"]
    assert len(steps) == 4
    assert history(client, run.info.run_id, "train/mean_reward") == [(s["step"], s["mean_reward"]) for s in steps]
    assert history(client, run.info.run_id, "library/size") == [(s["step"], s["library_size"]) for s in steps]
    assert history(client, run.info.run_id, "usage/rollout/calls") == [(s["step"], 6.0) for s in steps]  # 2 x G=3
    assert history(client, run.info.run_id, "val/score") == [(1, out["epochs"][0]["val_score"]),
                                                             (3, out["epochs"][1]["val_score"])]
    params = run.data.params
    assert params["num_generations"] == "3" and params["reflection_lm"] == params["policy_lm"] == "openai/fake"
    assert mentions_secret(tmp_path) == []


def test_a_users_own_run_gets_the_compile_and_stays_open(tmp_path, empty_store):
    mlflow.set_tracking_uri(new_store(empty_store, tmp_path / "mlflow.db"))
    mlflow.set_experiment("own")
    dspy.configure(lm=ScriptedLM(learner))
    with mlflow.start_run() as run:
        compiled = TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=2, num_threads=1,
                                    max_demos=1).compile(dspy.Predict("question -> answer"), trainset=make_trainset())
        assert mlflow.active_run().info.run_id == run.info.run_id  # the compile did not end the user's run
    client = MlflowClient()
    steps = compiled.detailed_results.to_dict()["steps"]
    data = client.get_run(run.info.run_id).data
    assert data.metrics["library/size"] == len(compiled.experience_library) == 4
    assert data.metrics["learning/operations_proposed"] == steps[-1]["operations_proposed"]
    assert data.metrics["train/groups_skipped"] == steps[-1]["groups"] - steps[-1]["groups_kept"]
    assert data.metrics["library/demos"] == len(steps[-1]["demos"])
    assert data.params["max_demos"] == "1" and data.params["use_mlflow"] == "False"
    text = (Path(client.download_artifacts(run.info.run_id, "library.md", str(tmp_path))).read_text())
    assert all(f"{e.id}** {e.text}" in text for e in compiled.experience_library.active.values())


def test_use_mlflow_starts_a_run_and_a_resume_after_a_crash_continues_it(tmp_path, empty_store):
    uri = new_store(empty_store, tmp_path / "mlflow.db")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("resume")
    log_dir = tmp_path / "log"

    def compile_with(lm):
        dspy.configure(lm=lm)
        return TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1, batch_size=2, num_threads=1,
                                log_dir=str(log_dir), use_mlflow=True).compile(dspy.Predict("question -> answer"),
                                                                               trainset=make_trainset())

    with pytest.raises(Crash):
        compile_with(ScriptedLM(crashing("advantage", 3)))  # in step 1: step 0 is done and logged
    assert mlflow.active_run() is None  # the run it started was ended
    crashed, client = the_run(uri, "resume")
    assert crashed.info.status == "FAILED" and stored_run_id(log_dir) == crashed.info.run_id
    assert [s for s, _ in history(client, crashed.info.run_id, "train/mean_reward")] == [0]

    compiled = compile_with(ScriptedLM(learner))
    run, _ = the_run(uri, "resume")
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "train/mean_reward") == \
        [(s["step"], s["mean_reward"]) for s in compiled.detailed_results.to_dict()["steps"]]  # step 0 once
    assert mlflow.active_run() is None


def test_a_log_dir_whose_run_is_in_another_experiment_starts_a_new_run(tmp_path, empty_store, caplog):
    mlflow.set_tracking_uri(new_store(empty_store, tmp_path / "mlflow.db"))
    dspy.configure(lm=ScriptedLM(learner))
    runs = []
    for experiment in ("first", "second"):
        mlflow.set_experiment(experiment)
        TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=1, batch_size=4, num_threads=1,
                         log_dir=str(tmp_path / "log"), use_mlflow=True).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset())
        runs.append(stored_run_id(tmp_path / "log"))
    assert runs[0] != runs[1] and "cannot be resumed here" in caplog.text
    assert MlflowClient().get_run(runs[1]).info.status == "FINISHED"


CLI_CONFIG = """
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
train_limit = 4
valset = "{data}"
val_limit = 2
evalset = "{data}"
eval_limit = 6
attribution_set = "{data}"
attribution_offset = 2
attribution_limit = 4
[optimizer]
num_generations = 3
num_train_epochs = 1
batch_size = 2
num_threads = 4
attribution = true
[evaluate]
num_runs = 2
num_threads = 4
[tracking]
"""


def test_the_cli_logs_compile_and_evaluation_into_one_run_in_the_run_dir(tmp_path, server, empty_store, monkeypatch):
    monkeypatch.setenv("TFGRPO_TEST_KEY", SECRET)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a, b in [(12, 7), (3, 45), (51, 6), (7, 80), (19, 23), (66, 12)]))
    config = tmp_path / "fake.toml"
    run_dir = tmp_path / "run"
    config.write_text(CLI_CONFIG.format(run_dir=run_dir, api_base=server.api_base, data=data))
    uri = new_store(empty_store, run_dir / "mlflow" / "mlflow.db")  # where the CLI's default store goes
    result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output
    assert "mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri" in " ".join(result.output.split())
    again = CliRunner().invoke(app, ["evaluate", str(config), "--program", str(run_dir / "program.json")])
    assert again.exit_code == 0, again.output

    run, client = the_run(uri, "tfgrpo")  # evaluate reused it
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    metrics = run.data.metrics
    assert metrics["eval/baseline/mean_at_k"] == summary["baseline"]["mean_at_k"]
    assert metrics["eval/compiled/pass_at_k"] == summary["compiled"]["pass_at_k"]
    assert metrics["eval/paired/difference"] == summary["paired"]["difference"]
    assert [metrics["eval/paired/ci95_low"], metrics["eval/paired/ci95_high"]] == summary["paired"]["ci95"]
    assert len(client.get_metric_history(run.info.run_id, "eval/paired/difference")) == 2  # run, then evaluate
    assert run.data.tags["eval.problems"] == "6" and run.data.tags["eval.k"] == "2"
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert history(client, run.info.run_id, "train/mean_reward") == [(s["step"], s["mean_reward"]) for s in steps]
    assert "val/score" in metrics and run.data.params["use_mlflow"] == "True"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert OUR_ARTIFACTS | {"eval", "worth.json", "worth.md", "worth_table.json"} <= artifacts
    worth = json.loads((run_dir / "worth.json").read_text())  # the attribution, on the 4 rows the config names
    assert worth["queries"] == 4 and "worth/library" in metrics
    shown = CliRunner().invoke(app, ["show", str(run_dir / "program.json")])
    assert shown.exit_code == 0 and "What each learned item is worth" in shown.output, shown.output
    assert {a.path for a in client.list_artifacts(run.info.run_id, "eval")} >= {"eval/summary.json"}
    library = json.loads((run_dir / "library.json").read_text())
    text = Path(client.download_artifacts(run.info.run_id, "library.md", str(tmp_path))).read_text()
    assert library["experiences"] and all(e["text"] in text for e in library["experiences"])
    assert mentions_secret(run_dir) == []  # store, artifacts, checkpoints, outputs


@dataclass
class _Stats:
    """A step's stats as an object, as `_step` may return them one day."""
    fields: dict

    def to_dict(self) -> dict:
        return dict(self.fields)


def test_step_metrics_read_a_dict_and_an_object_alike():
    stats = {"step": 3, "epoch": 0, "batch_size": 4, "groups": 4, "groups_kept": 1, "mean_reward": 0.25,
             "frac_skipped_zero_std": 0.75, "rollout_failures": 0, "tool_calls_mean": 1.5, "operations_proposed": 3,
             "learning_failures": 1, "said_none": 2, "operations_applied": {"add": 1, "modify": 1, "merge": 0},
             "operations_rejected": 1, "library_size": 5, "demos": ["q1", "q2"], "wall_s": 2.0,
             "seconds": {"rollout": 1.0}, "usage": {"rollout": {"calls": 8, "prompt_tokens": 100, "completion_tokens": 20}}}
    metrics = step_metrics(stats)
    assert metrics == step_metrics(_Stats(stats))
    assert metrics["train/groups_skipped"] == 3 and metrics["learning/operations_applied"] == 2
    assert metrics["learning/operations_refused"] == 1 and metrics["learning/said_none"] == 2
    assert metrics["library/size"] == 5 and metrics["library/demos"] == 2
    assert metrics["usage/rollout/tokens"] == 120 and metrics["usage/rollout/calls"] == 8
    assert not any(k.endswith(("/step", "/epoch", "/batch_size")) for k in metrics)


NOT_IMPORTED_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    import dspy
    from scripted_lm import ScriptedLM
    from test_resume import learner
    from test_optimizer import make_trainset, metric
    from tfgrpo.cli import _tracking
    from tfgrpo.config import Config
    from tfgrpo.optimizers import TrainingFreeGRPO
    dspy.configure(lm=ScriptedLM(learner))
    TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=1, batch_size=2, num_threads=1).compile(
        dspy.Predict("question -> answer"), trainset=make_trainset())
    with _tracking(Config()) as run:
        assert run is None
    print("mlflow" in sys.modules)
""")


def test_without_a_run_or_tracking_nothing_imports_mlflow():
    done = subprocess.run([sys.executable, "-c", NOT_IMPORTED_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_the_tracking_section_is_checked(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[tracking]\nuri = 'sqlite:///x.db'\n")
    with pytest.raises(ConfigError, match="tracking.uri"):
        Config.load(path)
    path.write_text("[tracking]\nenabled = false\n")
    assert Config.load(path).tracking.enabled is False


def test_use_mlflow_without_the_registered_tracker_is_a_clear_error(monkeypatch):
    from tfgrpo.base import hooks

    monkeypatch.setattr(hooks, "installed", lambda: {})  # a source tree used without installing tfgrpo
    with pytest.raises(RuntimeError, match="no MLflow tracker is registered"):
        TrainingFreeGRPO(lambda ex, pred, trace=None: 1.0, use_mlflow=True)
