"""Issue 37, items 1, 3 and 10: runs you can stop and trust, with the scripted LM (and the fake server for the CLI).

- one compile at a time per log_dir: a second is refused at once, naming the holder; a dead holder's lock is
  taken over and its finished work reused (item 1);
- Ctrl-C stops a run whose metric hangs at once, keeping the finished work; `metric_timeout_s` turns a hung metric
  call into a counted failure (item 3);
- progress: one bar for the run, fresh stage bars each step, a resume line, an interrupt line and exit code 130
  (item 10).
"""

import logging
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dspy
import pytest
from rich.console import Console
from typer.testing import CliRunner

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import make_trainset
from test_resume import learner
from tfgrpo.cli import app
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.checkpoint import RunLock, RunLockedError
from tfgrpo.progress import RunBars, progress_display
from tfgrpo.testing import FakeLMServer

TESTS, ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
HANGS_ON = "What is 1 + 11?"  # the question the metric of the children blocks on
OPTS = dict(num_generations=4, num_train_epochs=1, batch_size=2, num_threads=4)

CHILD = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import dspy
from scripted_lm import ScriptedLM
from test_optimizer import make_trainset
from test_resume import learner
from test_run_control import exact
from tfgrpo.optimizers import TrainingFreeGRPO

dspy.configure(lm=ScriptedLM(learner))
TrainingFreeGRPO(exact, log_dir=sys.argv[1], progress=lambda *_: None, **{OPTS!r}).compile(
    dspy.Predict("question -> answer"), trainset=make_trainset())
"""


def exact(example, pred, trace=None):
    """Right or wrong; in a child started with HANG_MARKER, it touches the marker and blocks on HANGS_ON. The child
    and this process share it, so a resume here is the same run (the run fingerprints the metric's code)."""
    if os.environ.get("HANG_MARKER") and example.question == HANGS_ON:
        Path(os.environ["HANG_MARKER"]).touch()
        threading.Event().wait()  # never returns
    return float(str(getattr(pred, "answer", "")).strip() == example.answer)


def start_hanging(tmp_path: Path, cmd: list[str], env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """Start `cmd` (whose metric touches the marker, then hangs) and wait until it hangs."""
    marker = tmp_path / "hanging"
    # as in a terminal, SIGINT must reach the child: a shell's background job (a CI runner's, say) starts with it
    # ignored, and an ignored signal stays ignored across exec, so Python would never raise KeyboardInterrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the child never reached the hanging metric:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    time.sleep(0.3)  # the other units of the stage finish meanwhile
    return proc, marker


def hanging_compile(tmp_path: Path, log_dir: Path) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return start_hanging(tmp_path, [sys.executable, str(script), str(log_dir)],
                         env={"HANG_MARKER": str(tmp_path / "hanging")})[0]


def recorded_calls(log_dir: Path) -> list[dict]:
    """The LM calls log_dir's record holds."""
    path = log_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"key"')] \
        if path.exists() else []


def interrupt(proc: subprocess.Popen, timeout: float = 15) -> tuple[int, str]:
    """Ctrl-C (SIGINT) the child; its exit code and output, or a failure when it does not end in `timeout` s."""
    os.kill(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"Ctrl-C did not stop the run within {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


# -- item 1: one compile per log_dir ---------------------------------------------------------------------------
def test_a_second_compile_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    log_dir = tmp_path / "log"
    holder = hanging_compile(tmp_path, log_dir)
    try:
        lm = ScriptedLM(learner)
        dspy.configure(lm=lm)
        started = time.time()
        with pytest.raises(RunLockedError, match=rf"in use by another compile \(pid {holder.pid} on .*child\.py"):
            TrainingFreeGRPO(exact, log_dir=str(log_dir), **OPTS).compile(dspy.Predict("question -> answer"),
                                                                         trainset=make_trainset())
        assert time.time() - started < 5 and lm.calls == [], "refused at once, before any call"
    finally:
        holder.kill()  # SIGKILL: no cleanup of any kind; the kernel drops its lock
        holder.communicate()
    assert recorded_calls(log_dir), "the dead holder's calls are kept"
    lm = ScriptedLM(learner)
    dspy.configure(lm=lm)
    compiled = TrainingFreeGRPO(exact, log_dir=str(log_dir), **OPTS).compile(dspy.Predict("question -> answer"),
                                                                            trainset=make_trainset())
    rollouts = sum(1 for c in lm.calls if kind_of(c["messages"]) == "student")
    assert compiled.detailed_results.to_dict()["reused_units"] > 0 and rollouts < 16, "the dead holder's finished work is kept"
    assert "pid" not in (log_dir / ".lock").read_text()  # released: the file says nobody holds it


def test_the_lock_is_reentrant_in_its_thread_only(tmp_path):
    with RunLock(tmp_path), RunLock(tmp_path):  # the CLI holds it, then the optimizer again
        errors = []
        thread = threading.Thread(target=lambda: errors.append(pytest.raises(RunLockedError, RunLock(tmp_path).__enter__)))
        thread.start()
        thread.join()
        assert errors and str(os.getpid()) in (tmp_path / ".lock").read_text()
    with RunLock(tmp_path):  # free again
        pass


def cli_config(tmp_path: Path, api_base: str) -> Path:
    (tmp_path / "agent.py").write_text(textwrap.dedent(f"""
        import os, threading
        from pathlib import Path
        import dspy

        class Agent(dspy.Module):
            def __init__(self):
                super().__init__()
                self.solve = dspy.Predict("question -> answer")

            def forward(self, question):
                return self.solve(question=question)

        def metric(example, pred, trace=None):
            if os.environ.get("HANG_MARKER") and example.question == {HANGS_ON!r}:
                Path(os.environ["HANG_MARKER"]).touch()
                threading.Event().wait()  # never returns
            return float(str(pred.answer).strip() == example.answer)
        """))
    rows = [f'{{"question": "What is {i} + {i + 10}?", "answer": "{2 * i + 10}"}}\n' for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(rows))
    path = tmp_path / "cfg.toml"
    path.write_text(textwrap.dedent(f"""
        run_dir = "{tmp_path / 'run'}"
        [policy]
        backend = "litellm"
        model = "openai/fake"
        api_base = "{api_base}"
        num_retries = 0
        cache = false
        [task]
        program = "{tmp_path / 'agent.py'}:Agent"
        metric = "{tmp_path / 'agent.py'}:metric"
        input_keys = ["question"]
        trainset = "{tmp_path / 'train.jsonl'}"
        evalset = "{tmp_path / 'train.jsonl'}"
        [optimizer]
        num_generations = 3
        num_train_epochs = 1
        batch_size = 2
        num_threads = 4
        """))
    return path


def test_the_cli_refuses_a_second_run_on_a_run_dir_in_use(tmp_path):
    with FakeLMServer(latency=0.001) as server:
        cfg = cli_config(tmp_path, server.api_base)
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from tfgrpo.optimizers.checkpoint import RunLock
            with RunLock({str(tmp_path / 'run' / 'checkpoint')!r}):
                print("locked", flush=True)
                time.sleep(60)
            """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            result = CliRunner().invoke(app, ["compile", str(cfg)])
        finally:
            holder.kill()
            holder.communicate()
        assert server.stats()["calls"] == 0
    assert result.exit_code == 2, result.output
    assert f"is in use by another run (pid {holder.pid}" in result.output


# -- item 3: Ctrl-C and the metric timeout --------------------------------------------------------------------
def test_ctrl_c_stops_a_compile_whose_metric_hangs_at_once_and_keeps_its_work(tmp_path):
    log_dir = tmp_path / "log"
    proc = hanging_compile(tmp_path, log_dir)
    code, out = interrupt(proc)
    assert code != 0 and "KeyboardInterrupt" in out
    assert any(c["stage"] == "rollout" for c in recorded_calls(log_dir)), "the rollouts' calls are kept"
    assert not list(log_dir.rglob(".*.tmp"))


def test_a_metric_timeout_turns_a_hung_call_into_a_counted_failure(tmp_path, caplog):
    release = threading.Event()

    def hangs_once(example, pred, trace=None):
        if example.question == HANGS_ON:
            release.wait()
        return exact(example, pred)

    trainset = make_trainset()
    dspy.configure(lm=ScriptedLM(learner))
    opt = TrainingFreeGRPO(hangs_once, metric_timeout_s=0.2, log_dir=str(tmp_path), **dict(OPTS, batch_size=4))
    try:
        with caplog.at_level(logging.WARNING, logger="tfgrpo"):
            compiled = opt.compile(dspy.Predict("question -> answer"), trainset=trainset, valset=trainset)
    finally:
        release.set()
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["details"]["metric_timeouts"] == OPTS["num_generations"]  # the hanging query's attempts, scored 0
    assert compiled.detailed_results.to_dict()["epochs"][0]["val_failures"] == 1
    assert "the metric failed (timed out or raised) on 4 of 16 attempts" in caplog.text
    assert "metric_timeout_s=0.2" in caplog.text


def test_too_many_metric_timeouts_stop_the_step_unfinished(tmp_path):
    def hangs(example, pred, trace=None):
        time.sleep(5)
        return 1.0

    dspy.configure(lm=ScriptedLM(learner))
    with pytest.raises(RuntimeError, match=r"of 8 metric calls failed \(first: metric 'hangs' .* did not return within "
                                           r"metric_timeout_s=0.1 s\)"):
        TrainingFreeGRPO(hangs, metric_timeout_s=0.1, log_dir=str(tmp_path), **OPTS).compile(
            dspy.Predict("question -> answer"), trainset=make_trainset())
    assert not list(tmp_path.glob("steps/*/done.json")) and not list(tmp_path.glob("steps/*/rewards/*.json"))


# -- item 10: progress that tells the truth ---------------------------------------------------------------------
def test_one_run_bar_and_fresh_stage_bars_each_step():
    progress = progress_display(Console(file=open(os.devnull, "w"), width=120))
    bars = RunBars(progress, num_train_epochs=2)
    bars("step", 1, 4)  # a resume: one step was done before
    run = progress.tasks[0]
    assert run.description == "run: epoch 1/2, steps" and run.completed == 1 and run.fields["first"] == 1
    for done in range(1, 5):
        bars("rollout", done, 4)
    first_rollout = bars.tasks["rollout"]
    bars("step", 2, 4)
    bars("rollout", 1, 4)
    assert bars.tasks["rollout"] != first_rollout, "a new bar for the new step"
    assert [t.description for t in progress.tasks] == ["run: epoch 2/2, steps", "rollout"]
    assert progress.tasks[1].completed == 1  # counts (and time) from this step's start


def test_the_optimizer_reports_the_whole_run_as_stage_step(tmp_path):
    seen = []
    dspy.configure(lm=ScriptedLM(learner))
    TrainingFreeGRPO(exact, progress=lambda *a: seen.append(a), log_dir=str(tmp_path), **OPTS).compile(
        dspy.Predict("question -> answer"), trainset=make_trainset())
    assert [a for a in seen if a[0] == "step"] == [("step", 0, 2), ("step", 1, 2), ("step", 2, 2)]
    seen.clear()
    TrainingFreeGRPO(exact, progress=lambda *a: seen.append(a), log_dir=str(tmp_path), **OPTS).compile(
        dspy.Predict("question -> answer"), trainset=make_trainset())
    assert seen[0] == ("step", 2, 2)  # a resume starts from the steps it reuses


def test_the_cli_says_interrupted_exits_130_and_a_rerun_says_it_resumes(tmp_path):
    with FakeLMServer(latency=0.001) as server:
        cfg = cli_config(tmp_path, server.api_base)
        marker = tmp_path / "hanging"
        proc, _ = start_hanging(tmp_path, [sys.executable, "-m", "tfgrpo.cli", "compile", str(cfg)],
                                env={"HANG_MARKER": str(marker)})
        code, out = interrupt(proc)
        checkpoint = tmp_path / "run" / "checkpoint"
        assert code == 130, out
        assert f"interrupted; every reply so far is kept in {checkpoint}; run the same command to resume" in \
            " ".join(out.split())
        assert recorded_calls(checkpoint)
        again = CliRunner().invoke(app, ["compile", str(cfg)])
    assert again.exit_code == 0, again.output
    said = " ".join(again.output.split())
    assert f"resuming from {checkpoint}: " in said and "recorded LM call(s)" in said
    assert "run: epoch 1/1, steps" in said


def test_the_cli_exits_130_on_ctrl_c_under_ray_too(tmp_path):
    """backend="ray" on a cluster of one `ray start` node: Ctrl-C ends the compile with the same line and code."""
    pytest.importorskip("ray")
    from tfgrpo.testing.ray_cluster import LocalRayCluster

    with FakeLMServer(latency=0.001) as server, LocalRayCluster(nodes=1) as cluster:
        cfg = cli_config(tmp_path, server.api_base)
        cfg.write_text(cfg.read_text() + 'backend = "ray"\n')
        proc, _ = start_hanging(tmp_path, [sys.executable, "-m", "tfgrpo.cli", "compile", str(cfg)],
                                env={"HANG_MARKER": str(tmp_path / "hanging"), "RAY_ADDRESS": cluster.address})
        code, out = interrupt(proc)
    assert code == 130, out
    assert "interrupted; every reply so far is kept in" in " ".join(out.split())
