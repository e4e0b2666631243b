"""The MLflow run page of a tracked compile, opened in a real browser (issue 37): a tiny compile (scripted LM) logs
into a SQLite store in tmp_path, `mlflow server` serves it on 127.0.0.1 only, and headless Chromium loads the run's
overview, its library.md and its learning_curve.png. Each page's screenshot is saved (under tmp_path, or the folder
$TFGRPO_BROWSER_SHOTS names) and its rendered text (--dump-dom) is checked, beside MLflow's REST API.

Chromium comes from Debian's packages (`apt-get install -y chromium`); without it the test is skipped, unless
TFGRPO_REQUIRE_BROWSER is set (CI, where a skip would hide that the check never ran)."""

import contextlib
import html
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before MLflow is imported: no usage reports

import dspy  # noqa: E402
import mlflow  # noqa: E402
import pytest  # noqa: E402

from scripted_lm import ScriptedLM  # noqa: E402
from test_optimizer import make_trainset, metric  # noqa: E402
from test_resume import learner  # noqa: E402
from tfgrpo.optimizers import TrainingFreeGRPO  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            "--window-size=1400,1000", "--virtual-time-budget=15000"]  # virtual time: the page's data is fetched


def tiny_compile(tmp_path: Path):
    """Two epochs of two steps on a scripted LM, logged to a new store; (run ID, experiment ID, compiled)."""
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.create_experiment("browser", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=experiment)
    dspy.configure(lm=ScriptedLM(learner))
    with mlflow.start_run(run_name="tiny") as run:
        compiled = TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=2, batch_size=2, num_threads=1,
                                    progress=lambda *_: None).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset(4), valset=make_trainset(2))
    return run.info.run_id, experiment, compiled


@contextlib.contextmanager
def mlflow_server(store: Path, log: Path):
    """`mlflow server` over `store`, listening on 127.0.0.1 only; its base URL. Stopped (its process group) on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{store}",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def rest(base: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/{path}", timeout=30) as reply:
        return json.load(reply)


def browse(url: str, screenshot: Path) -> str:
    """The page's DOM once rendered, with a screenshot saved; one headless Chromium with a new profile."""
    profile = screenshot.with_suffix(".profile")
    done = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", f"--screenshot={screenshot}",
                           "--dump-dom", url], capture_output=True, text=True, timeout=180)
    shutil.rmtree(profile, ignore_errors=True)
    assert done.returncode == 0 and screenshot.stat().st_size > 10_000, done.stderr[-3000:]
    return done.stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def test_the_mlflow_run_page_shows_the_learning_curve_and_the_library(tmp_path):
    if CHROMIUM is None:
        if os.environ.get("TFGRPO_REQUIRE_BROWSER"):
            pytest.fail("TFGRPO_REQUIRE_BROWSER is set but chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); TFGRPO_REQUIRE_BROWSER makes this fail")
    run_id, experiment, compiled = tiny_compile(tmp_path)
    steps = compiled.detailed_results.to_dict()["steps"]
    shots = Path(os.environ.get("TFGRPO_BROWSER_SHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with mlflow_server(tmp_path / "mlflow.db", tmp_path / "server.log") as base:
        curve = rest(base, f"metrics/get-history?run_id={run_id}&metric_key=train/mean_reward")["metrics"]
        artifacts = {f["path"] for f in rest(base, f"artifacts/list?run_id={run_id}")["files"]}
        page = f"{base}/#/experiments/{experiment}/runs/{run_id}"
        doms = {name: browse(page + path, shots / f"{name}.png") for name, path in
                [("overview", ""), ("library", "/artifacts/library.md"), ("curve", "/artifacts/learning_curve.png")]}
    assert sorted((m["step"], m["value"]) for m in curve) == [(s["step"], s["mean_reward"]) for s in steps]
    assert len(steps) == 4 and {"library.md", "learning_curve.png"} <= artifacts

    overview = visible_text(doms["overview"])
    assert "train/mean_reward" in overview and "val/best_score" in overview and "Finished" in overview, overview
    assert "tfgrpo.kept_epoch" in overview
    library = visible_text(doms["library"])
    experiences = list(compiled.experience_library.active.values())
    assert "Experience library: 4 experiences" in library and experiences, library
    assert all(f"{e.id} {e.text}" in library for e in experiences), library
    assert re.search(r'<img[^>]*alt="learning_curve.png"', doms["curve"]), visible_text(doms["curve"])
