"""Every benchmark in benchmarks/ runs, at its smallest size, and ends with the lines its docstring promises.

A benchmark that no longer runs (an import that moved, a part whose type changed) fails here instead of at the
next measurement. Each runs as a subprocess, the way the README's commands run it. Where a benchmark can be
pointed at an OpenAI-compatible endpoint, the fake LM server answers (its Game of 24 student sometimes writes a
working search, so the learning calls and demos are exercised too); `local_throughput` measures the embedded
model's own server (its slots, its /metrics), so it runs on the real 0.5B model (`local_model`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tfgrpo.cli import app
from tfgrpo.testing import FakeLMServer

ROOT = Path(__file__).resolve().parent.parent
X = r"[+-]?\d+\.\d+"  # a figure as the benchmarks print them
COVERED = {"api_run.py", "faults.py", "learning_paths.py", "local_learning.py", "local_math.py", "local_throughput.py",
           "local_web.py", "peers.py", "replay.py", "rule_ceiling.py", "step_latency.py", "worth.py", "ceiling.py",
           "same_run.py", "carry.py", "ray_backend.py", "async_backend.py", "judge_billing.py",
           "rate_limit.py", "library_budget.py"}  # each has a test below
NOT_BENCHMARKS = {"__init__.py", "common.py", "fault_child.py", "log_dir_checks.py", "stop_rows.py",
                  "trust_rows.py"}  # helpers of the benchmarks


def run(script: str, *args: str, timeout: float = 300) -> list[str]:
    """The benchmark's output lines; it must exit 0."""
    module = f"benchmarks.{script.removesuffix('.py')}"  # as the docs run them: python -m benchmarks.NAME
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def fake():
    with FakeLMServer(latency=0.001, tool_turns=1) as server:  # one tool call per agent turn before answering
        yield server


def endpoint(server: FakeLMServer) -> list[str]:
    return ["--api-base", server.api_base, "--model", "fake"]


def test_library_budget(tmp_path):
    """At its smallest size: 10 steps of each arm; the capped arm's libraries never pass the budget, and the placed
    layout's calls are no longer than the whole library's."""
    lines = run("library_budget.py", "--steps", "10", "--budget", "40", "--held-out", "2", "--plot",
                str(tmp_path / "p.png"))
    steps = [re.fullmatch(r"library_budget step=(\d+) arm=(placed|budget) plan=(\d+) solve=(\d+) check=(\d+) "
                          r"retired=(\d+)", line) for line in lines if " step=" in line]
    assert len(steps) == 20 and all(steps)
    assert all(max(int(m.group(i)) for i in (3, 4, 5)) <= 40 for m in steps if m.group(2) == "budget")
    arms = {m.group(1): m for line in lines if (m := re.fullmatch(
        r"library_budget arm=(\w+) steps=10 max_tokens=(\d+) retired=(\d+) experiences=(\d+)", line))}
    assert set(arms) == {"placed", "budget"} and int(arms["budget"].group(2)) <= 40
    layouts = {(m.group(1), m.group(2)): float(m.group(3)) for line in lines if (m := re.fullmatch(
        rf"library_budget layout=(placed|everywhere) arm=(placed|budget) prompt_tokens_per_call=({X}) calls=6", line))}
    assert len(layouts) == 4 and all(layouts["placed", a] <= layouts["everywhere", a] for a in ("placed", "budget"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_judge_billing():
    """At its smallest size: an unbudgeted run and one with half its bill as max_cost, compiled again twice on its
    log_dir; the spend reported is the server's bill and the stop lands within 1.15x of the budget, resumes included."""
    lines = run("judge_billing.py", "--epochs", "2", "--shares", "0.5", "--backends", "threads", "--resumes", "2")
    pattern = re.compile(rf"judge_billing backend=threads max_cost=(none|{X}) billed=\${X} reported=\${X} \(ratio "
                         rf"({X})\) judge_calls=(\d+)/(\d+) stopped=(yes|no) bill/budget=({X}) overshoot=\${X} "
                         rf"\({X} units\)")
    rows = [pattern.fullmatch(line) for line in lines if line.startswith("judge_billing ")]
    assert len(rows) == 2 and all(rows), lines
    for row in rows:
        assert abs(float(row.group(2)) - 1) <= 0.05 and row.group(3) == row.group(4) != "0"
    assert rows[1].group(5) == "yes" and float(rows[1].group(6)) <= 1.15
    resumed = re.fullmatch(rf"judge_billing_resumes backend=threads max_cost={X} runs=3 billed=\${X} reported=\${X} "
                           rf"\(ratio ({X})\) bill/budget=({X}) new_calls=(\d+)", lines[-1])
    assert resumed and abs(float(resumed.group(1)) - 1) <= 0.05 and float(resumed.group(2)) <= 1.15, lines[-1]


def test_rate_limit():
    """At its smallest size: one compile, then two at once, against a provider whose limit (6000 a minute) is not
    reached; each line says what the provider saw."""
    lines = run("rate_limit.py", "--rpm", "6000", "--processes", "1,2", "--train", "1")
    pattern = re.compile(rf"rate_limit: rpm=6000 processes=([12]) pacer=(6000|3000) engine=auto requests=(\d+) "
                         rf"answered=(\d+) refused=(\d+) share_429=({X}) minutes=({X}) floor=({X})")
    rows = [pattern.fullmatch(line) for line in lines if line.startswith("rate_limit:")]
    assert len(rows) == 2 and all(rows), lines
    assert all(int(r.group(3)) == int(r.group(4)) > 0 and r.group(5) == "0" for r in rows)


def test_every_benchmark_has_a_test_here():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - NOT_BENCHMARKS
    assert scripts == COVERED


def test_ray_backend():
    """Its three lines at the smallest size, on a cluster of two `ray start` nodes the benchmark starts and ends."""
    lines = run("ray_backend.py", "--queries", "3", "--units", "4", "--loops", "100000", timeout=600)
    rows = {line.split(":")[0]: dict(f.split("=") for f in line.split(": ", 1)[1].split()) for line in lines
            if line.startswith("ray_")}
    assert rows["ray_same"]["library_equal"] == rows["ray_same"]["steps_equal"] == "true"
    assert rows["ray_same"]["calls_threads"] == rows["ray_same"]["calls_ray"]
    assert {k: rows["ray_faults"][k] for k in ("killed", "crashes", "corrupted", "charged_twice", "library_equal")} \
        == {"killed": "1", "crashes": "0", "corrupted": "0", "charged_twice": "0", "library_equal": "true"}
    float(rows["ray_overhead"]["unit_ms"]), float(rows["ray_overhead"]["ray_s"])  # figures, printed as numbers


def test_faults(tmp_path):
    lines = run("faults.py", "--faults", "malformed")
    assert re.fullmatch(r"faults: injected=[1-9]\d* crashes=0 corrupted=0 redone=0 resumed_equal=true", lines[-2])
    assert lines[-1] == ("silent_failures: metric_error=raised reflection_outage=not_done calls_per_bad_reply=2 "
                         "budget_without_history=stopped corrupt_run_json=refused")


def test_api_run():
    """The smallest API run on the provider simulator: the budget holds within the calls in flight, the plan foresees
    the calls, no failed call enters a group."""
    lines = run("api_run.py", "--train", "4", "--threads", "4", "--budget-train", "24", "--budget-calls", "130",
                "--attribution-queries", "4")
    budgeted = re.fullmatch(rf"plan_budget: scheduled=(\d+) reachable=(\d+) steps_run=(\d+) calls=\d+ planned=\d+ "
                            rf"error=({X}) cost_error={X} pilot_cost_error={X} read=\d+ of 24 .*", lines[-3])
    assert budgeted, lines[-3]
    attributed = re.fullmatch(rf"plan_attribution: queries=4 items_planned=\d+ items=\d+ calls=(\d+) planned=(\d+) "
                              rf"bound=(\d+) error={X} cost_error={X}", lines[-2])
    assert attributed and int(attributed.group(1)) <= int(attributed.group(3)), lines[-2]
    assert budgeted.group(2) == budgeted.group(3) != budgeted.group(1) and float(budgeted.group(4)) <= 0.25
    found = re.fullmatch(rf"api_run: preset=paper calls=\d+ cost=\$\S+ budget=\$\S+ overshoot_calls=(\d+) plan_error=({X}) "
                         rf"plan_cost_error={X} cached_share={X} failed_calls=\d+ failures_in_groups=(\d+) "
                         rf"reference_cost=\$\S+", lines[-1])
    assert found, lines[-1]
    assert int(found.group(1)) <= 4 and float(found.group(2)) <= 0.25 and found.group(3) == "0"


def test_api_run_carry_and_rate_limit():
    """Its other two modes at their smallest: a program carried to another model on the simulator (the refit's calls
    and dollars beside a fresh compile's), and a run against a requests-a-minute limit unpaced and paced."""
    (line,) = run("api_run.py", "--train", "2", "--threads", "4", "--refit-queries", "4", "--carry-to",
                  "openai/gpt-4o-mini")
    carried = re.fullmatch(rf"carry_api: from=deepseek/deepseek-chat to=openai/gpt-4o-mini learned_calls=\d+ "
                           rf"learned_cost=\$\S+ items=(\d+) kept=\d+ calls_refit=(\d+) planned_refit=\d+ "
                           rf"cost_refit=\$\S+ calls_fresh=(\d+) cost_fresh=\$\S+ cost_share={X}", line)
    assert carried and int(carried.group(1)) > 0 and 0 < int(carried.group(2)) < int(carried.group(3)), line
    lines = run("api_run.py", "--train", "1", "--rate-limit-rpm", "600", "--rate-threads", "4")
    assert [re.fullmatch(rf"rate_limit: rpm=600 threads=4 paced=(no|yes) requests=\d+ answered=\d+ minutes={X} "
                         rf"per_r={X} ratio={X} floor={X} share_429={X}", line).group(1) for line in lines] == ["no", "yes"]


def test_async_backend():
    """At its smallest: two queries of two attempts, 50 ms replies, a limit that does not bind."""
    lines = run("async_backend.py", "--batch", "2", "--group", "2", "--median", "0.05", "--rpm", "600",
                "--configs", "threads:2,async:8")
    assert all(re.fullmatch(rf"(threads|async):\d+: wall_s={X} floor_s={X} ratio={X} answered=\d+ share_429={X} "
                            rf"rss_mib=\d+ lost=0 server_max_in_flight=\d+", line) for line in lines[:-1]), lines
    assert re.fullmatch(rf"async: in_flight=8 wall_s={X} threads_wall_s=2:{X} floor_s={X} share_429={X} "
                        r"calls_equal=true", lines[-1]), lines[-1]


def test_step_latency():
    lines = run("step_latency.py", "--batch", "2", "--group", "2", "--latency", "0.01", "--threads", "4", "--no-floor")
    assert any(re.fullmatch(r"LM calls: \d+; bound .*: holds", line) for line in lines)
    assert re.fullmatch(rf"step_latency: wall={X} critical_path={X} ratio={X}", lines[-1])


def test_local_web(fake):
    lines = run("local_web.py", "--questions", "1", "--max-iters", "2", *endpoint(fake))
    for agent, line in zip(("react", "step"), lines[-2:]):  # one search each, no failed tool call
        assert re.fullmatch(rf"local_web: agent={agent} questions=1 s_per_question={X} tool_calls=1\.00 "
                            rf"failed_calls=0\.00 f1={X}", line), line


def test_local_math(fake, tmp_path):
    lines = run("local_math.py", "--train", "2", "--eval", "2", "--seeds", "1", "--generations", "2",
                "--out", str(tmp_path), *endpoint(fake))
    assert re.fullmatch(rf"local_math: baseline={X} compiled={X} diff={X} ci95=\[{X}, {X}\] n=2", lines[-1])
    assert (tmp_path / "result.json").exists()


def test_local_learning(fake, tmp_path):
    lines = run("local_learning.py", "--seeds", "1", "--train", "2", "--eval", "2", "--generations", "4",
                "--batch", "2", "--simba-seeds", "0", "--out", str(tmp_path), *endpoint(fake))
    assert re.fullmatch(rf"local_learning: optimizer=tfgrpo task=game24 seeds=1 problems=2 valid_ops=(\d\.\d\d|na) "
                        rf"library=\d+ baseline={X} compiled={X} lift={X} ci_low={X} ci_high={X}", lines[-1])


PEER_ARMS = ["baseline", "bootstrap", "bootstrap-rs", "bootstrap-rs-solved", "infer-rules", "knn", "simba",
             "simba-solved", "gepa", "mipro", "tfgrpo-rules", "tfgrpo-probed+demos", "tfgrpo-onestep+demos",
             "tfgrpo-probed-wide+demos"]


def test_the_cost_frontier_counts_an_arm_dominated_only_by_a_cheaper_one_that_beats_it_by_a_paired_ci(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.peers import frontier

    def arm(calls, solved):  # 40 problems, one seed: the first `solved` are solved
        return {0: {"compile": {"calls": calls},
                    "rows": [{"problem": i, "run": 0, "score": float(i < solved)} for i in range(40)]}}

    results = {"baseline": arm(0, 10), "cheap": arm(4, 30), "costly": arm(100, 12), "best": arm(200, 32)}
    spent = {a: results[a][0]["compile"]["calls"] for a in results}
    assert frontier(results, "costly", spent) == ("dominated by cheap; of the 2 arm(s) spending no more compile calls: "
                                                  "not ahead of baseline, cheap")
    assert frontier(results, "cheap", spent) == ("on the cost frontier; of the 1 arm(s) spending no more compile "
                                                 "calls: ahead (paired CI above zero) of baseline")
    assert frontier(results, "best", spent).startswith("on the cost frontier; of the 3 arm(s) spending no more "
                                                       "compile calls: ahead (paired CI above zero) of baseline, "
                                                       "costly; not ahead of cheap")
    assert frontier(results, "baseline", spent).endswith("calls: none")


def test_peers(fake, tmp_path):
    """Every optimizer compiles, is evaluated and gets its line and its point; a second run reuses what was saved."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["--arms", ",".join(PEER_ARMS), "--seeds", "0", "--train", "2", "--eval", "2", "--generations", "2",
            "--batch", "2", "--budget-calls", "10", "--out", str(tmp_path), "--mlflow", store, *endpoint(fake)]
    lines = [line for line in run("peers.py", *args, timeout=600) if line.startswith("peers: ")]
    assert [re.search(r"optimizer=(\S+)", line).group(1) for line in lines] == sorted(
        PEER_ARMS, key=lambda a: (a != "baseline", a))
    for line in lines:
        assert re.fullmatch(rf"peers: task=game24 optimizer=\S+ seeds=1 problems=2 calls=\d+ score={X} min={X} lift={X} "
                            rf"ci_low={X} vs_best_other={X} ci_low_vs_best={X}", line), line
    assert (tmp_path / "game24" / "peers.png").stat().st_size > 0
    spent = {arm: json.loads((tmp_path / "game24" / arm / "seed0" / "compile.json").read_text())["metric_calls"]
             for arm in PEER_ARMS if arm != "baseline"}  # every compile counts its metric calls
    # never past the budget (each attempt is charged as it starts), and no step is started that the calls left cannot
    # pay for: its 2 x 2 rollouts and a probe of the program and one edit on the 2 training puzzles
    assert all(10 - (2 * 2 + 2 * 2) < spent[arm] <= 10 for arm in spent if arm.startswith("tfgrpo-")), spent
    calls = fake.stats()["calls"]
    assert [line for line in run("peers.py", *args) if line.startswith("peers: ")] == lines
    assert fake.stats()["calls"] == calls  # nothing was sent again
    from mlflow.tracking import MlflowClient  # every arm is its own run, with its held-out score

    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("peers-game24").experiment_id])
    assert sorted(r.data.params["arm"] for r in runs) == sorted(PEER_ARMS)
    assert all("heldout/score" in r.data.metrics for r in runs)
    tfgrpo_run = next(r for r in runs if r.data.params["arm"] == "tfgrpo-rules")
    assert "train/mean_reward" in tfgrpo_run.data.metrics  # the tfgrpo arm logged its steps into its run
    assert (tmp_path / "mlflow-artifacts").is_dir() and not (ROOT / "mlruns").exists()  # nothing lands in the repo
    # an arm measured once and superseded keeps its results, reported apart from the menu and never the best other
    shutil.copytree(tmp_path / "game24" / "tfgrpo-rules", tmp_path / "game24" / "tfgrpo-excerpts")
    report = run("peers.py", "--report", "--out", str(tmp_path))
    assert any(line.startswith("# explored, not in the menu: tfgrpo-excerpts (") for line in report)
    assert [line for line in report if line.startswith("peers: ")] == lines
    missing = next(line for line in report if line.startswith("# not measured on game24: "))
    assert {"tfgrpo-rules+demos", "tfgrpo-default"} <= set(missing[26:].split(", "))


def test_peers_knn_on_gsm8k_retrieves_solved_training_problems(fake, tmp_path):
    """On GSM8K the k nearest training problems come with their reference solutions: no LM call to compile, and one
    call per held-out problem whose prompt carries the retrieved solutions as demos."""
    args = ["--task", "gsm8k", "--arms", "baseline,knn", "--seeds", "0", "--train", "4", "--eval", "2", "--out",
            str(tmp_path), *endpoint(fake)]
    before = fake.stats()["calls"]
    lines = [line for line in run("peers.py", *args) if line.startswith("peers: task=gsm8k optimizer=knn ")]
    assert len(lines) == 1 and " calls=0 " in lines[0], lines
    assert fake.stats()["calls"] - before == 4  # 2 baseline + 2 knn evaluation calls
    rows = [json.loads(line) for line in (tmp_path / "gsm8k" / "knn" / "seed0" / "eval.jsonl").read_text().splitlines()]
    assert rows[0]["eval_calls"] == 2 and [r["error"] for r in rows] == [None, None]


def test_peers_knn_bootstrapped_on_gsm8k_pools_the_students_own_solved_traces(fake, tmp_path):
    """knn-bootstrapped tries each training problem until the student solves it (G tries at most) and pools only the
    solved traces; the fake student solves no GSM8K problem, so every problem takes G tries, the pool stays empty
    and the held-out problems are answered by the plain student, one call each."""
    args = ["--task", "gsm8k", "--arms", "baseline,knn-bootstrapped", "--seeds", "0", "--train", "3", "--eval", "2",
            "--generations", "2", "--out", str(tmp_path), *endpoint(fake)]
    before = fake.stats()["calls"]
    lines = [line for line in run("peers.py", *args) if line.startswith("peers: task=gsm8k optimizer=knn-bootstrapped ")]
    where = tmp_path / "gsm8k" / "knn-bootstrapped" / "seed0"
    spent = json.loads((where / "compile.json").read_text())
    assert len(lines) == 1 and spent["calls"] == spent["metric_calls"] == 3 * 2, spent
    assert json.loads((where / "program.json").read_text())["predict"]["demos"] == []  # nothing solved, nothing pooled
    assert fake.stats()["calls"] - before == 6 + 2 + 2  # the compile, then one call per held-out problem (each arm)


def test_peers_knn_on_game24_solves_the_training_puzzles_once_and_retrieves_from_them(fake, tmp_path, monkeypatch):
    """Game of 24 puzzles come unsolved: the compile solves each training puzzle once (its calls counted there) and
    saves the solved ones as the pool; evaluating then makes one call per held-out puzzle, retrieving from the pool."""
    args = ["--arms", "baseline,knn", "--seeds", "0", "--train", "4", "--eval", "3", "--generations", "2", "--out",
            str(tmp_path), *endpoint(fake)]
    before = fake.stats()["calls"]
    run("peers.py", *args)
    where = tmp_path / "game24" / "knn" / "seed0"
    spent = json.loads((where / "compile.json").read_text())
    assert 4 <= spent["calls"] == spent["metric_calls"] <= 8  # each puzzle tried until solved, 2 tries at most
    pool = json.loads((where / "program.json").read_text())["write_program"]["demos"]
    assert pool  # the fake student solves some of them
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.ceiling import solves
    from tfgrpo.tasks.game24 import load_game24

    train = [sorted(int(n) for n in str(ex.numbers).split()) for ex in load_game24("game24_train", limit=4, offset=100)]
    for demo in pool:  # every pooled demo is a training puzzle, and its code solves it
        assert sorted(demo["numbers"]) in train and solves(demo["code"], demo["numbers"], demo["numbers"])
    assert fake.stats()["calls"] - before == spent["calls"] + 3 + 3  # then one call per held-out puzzle (each arm)
    assert any(line.startswith("peers: task=game24 optimizer=knn ") for line in run("peers.py", *args))
    assert fake.stats()["calls"] - before == spent["calls"] + 3 + 3  # the second run reloads the pool, sends nothing
    # another pool, the same held-out puzzles: their vectors come from this pool's fit, never from a cache of the last
    run("peers.py", "--arms", "baseline,knn", "--seeds", "0", "--train", "4", "--train-offset", "104", "--eval", "3",
        "--generations", "2", "--out", str(tmp_path / "other"), *endpoint(fake))
    rows = [json.loads(line) for line in (tmp_path / "other" / "game24" / "knn" / "seed0" / "eval.jsonl").open()]
    assert [r["error"] for r in rows] == [None] * 3


def test_peers_refuses_an_arm_outside_the_tasks_menu():
    for arm, why in [("tfgrpo-excerpts", "was explored and superseded"), ("knn-bootstrapped", "is made for gsm8k"),
                     ("tfgrpo-nothing", "is no arm")]:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--arms", arm], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and f"{arm} {why}" in proc.stderr, proc.stderr[-2000:]


def test_replay(fake, tmp_path):
    """Sampling the pool (here from the fake server, whose programs solve nothing), then every configuration replayed
    on it; and the replay of the saved pool, at its smallest size."""
    pool = tmp_path / "pool.json"
    lines = run("replay.py", "--collect", "2", "--pool", str(pool), "--runs", "5", *endpoint(fake))
    assert len(json.loads(pool.read_text())["programs"]) == 2
    from benchmarks.replay import CONFIGS

    replayed = [line for line in lines if line.startswith("replay: ")]
    assert [re.search(r"config=(\S+)", line).group(1) for line in replayed] == list(CONFIGS)
    for line in replayed:
        assert re.fullmatch(rf"replay: config=\S+ runs=5 general_mean={X} p10=\d+ p50=\d+ share_flat_or_better={X} "
                            rf"share_none={X} metric_calls=\d+", line), line
    saved = run("replay.py", "--runs", "5")
    assert sum(line.startswith("replay: ") for line in saved) == len(CONFIGS)


def test_rule_ceiling(fake):
    lines = run("rule_ceiling.py", "--problems", "1", "--runs", "1", *endpoint(fake))
    arms = [re.fullmatch(rf"rule_ceiling: arm=(\S+) problems=1 runs=1 solved=[01]/1 rate={X} lift={X} "
                         rf"ci_low={X} ci_high={X}", line) for line in lines[-4:]]
    assert [m and m.group(1) for m in arms] == ["baseline", "oracle:full", "oracle:search", "oracle:robust"]


def test_learning_paths(fake, tmp_path):
    config = tmp_path / "fake.toml"
    config.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[policy]
backend = "litellm"
model = "openai/fake"
api_base = "{fake.api_base}"
cache = false
[task]
name = "game24"
trainset = "game24_train"
train_limit = 2
evalset = "game24_test"
[optimizer]
num_generations = 4
num_train_epochs = 1
batch_size = 2
num_threads = 4
""")
    compiled = CliRunner().invoke(app, ["compile", str(config)])  # the run whose step 0 both paths learn from
    assert compiled.exit_code == 0, compiled.output
    lines = run("learning_paths.py", str(config), "--step", "0")
    for path, line in zip(("paper", "contrast"), lines[-2:]):
        assert re.fullmatch(rf"learning_paths: path={path} calls=\d+ seconds=\d+ proposed=\d+ valid=\d+ "
                            rf"valid_ops=\d\.\d\d library=\d+", line), line


def _local_model_or_skip(model: str) -> None:
    """Skip when the embedded model cannot run here; CI (TFGRPO_REQUIRE_LOCAL_MODEL) fails instead."""
    from tfgrpo import local_model, local_weights

    try:
        local_model.require_server_command()
        local_weights.find_parts(local_weights.MODELS[model])
    except Exception as exc:  # not installed, not built, or weights missing
        if os.environ.get("TFGRPO_REQUIRE_LOCAL_MODEL"):
            pytest.fail(f"the real local model is required here but unavailable: {exc}")
        pytest.skip(f"{type(exc).__name__}: {exc}")


@pytest.mark.local_model
def test_local_throughput():
    _local_model_or_skip("qwen2.5-coder-0.5b")
    lines = run("local_throughput.py", "--model", "qwen2.5-coder-0.5b", "--modes", "off", "ngram-mod", "--puzzles",
                "1", "--max-tokens", "48", timeout=900)
    for mode, line in zip(("off", "ngram-mod"), lines[-3:-1]):
        assert re.fullmatch(rf"local_throughput: mode={mode} tok_s={X} acceptance=[01]\.\d\d solved=[0-2]/2 tokens=\d+ "
                            rf"seconds=\d+ quality_diff=[+-]\d\.\d{{3}} ci=\[[+-]\d\.\d{{3}},[+-]\d\.\d{{3}}\]", line), line
    assert re.fullmatch(r"local_throughput: mode=(off|ngram-mod) speedup=\d+\.\d\dx quality_diff=[+-]\d\.\d{3} "
                        r"ci=\[[+-]\d\.\d{3},[+-]\d\.\d{3}\] main_job_s=not-run", lines[-1]), lines[-1]


def test_benchmarks_import_only_the_public_api():
    """No benchmark edits sys.path or imports an underscore name, and none imports another benchmark that imports
    it back (issue 57): they run as `python -m benchmarks.NAME` on what tfgrpo documents."""
    import ast

    imports: dict[str, set[str]] = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert "sys.path" not in path.read_text(), path.name
        found = imports.setdefault(path.stem, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not any(a.name.startswith("_") for a in node.names), (path.name, node.module)
                if node.module.startswith("benchmarks."):
                    found.add(node.module.split(".")[1])
                elif node.module == "benchmarks":
                    found.update(a.name for a in node.names)
    for name, deps in imports.items():
        for dep in deps:
            assert name not in imports.get(dep, set()), f"benchmarks.{name} and benchmarks.{dep} import each other"


SEARCH = """from itertools import permutations
def solve(nums):
    def go(items):
        if len(items) == 1:
            return items[0][1] if abs(items[0][0] - 24) < 1e-6 else None
        for i, j in permutations(range(len(items)), 2):
            (a, x), (b, y) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for v, e in [(a + b, f"({x}+{y})"), (a - b, f"({x}-{y})"), (a * b, f"({x}*{y})")] + (
                    [(a / b, f"({x}/{y})")] if b else []):
                if (found := go(rest + [(v, e)])):
                    return found
    return go([(n, str(n)) for n in nums])
print(solve(nums))"""


def test_ceiling_counts_what_the_written_programs_solve(tmp_path):
    """Two attempts a run wrote (a full search and a sum), each run in the sandbox on the held-out puzzles; the kept
    demo is the sum: the line says the run was limited by what it chose, not by what it wrote."""
    attempts = {"0_0": ("nums = [4, 5, 11, 12]\n" + SEARCH, [4, 5, 11, 12]),
                "0_1": ("nums = [1, 6, 9, 12]\nprint('+'.join(map(str, nums)))", [1, 6, 9, 12])}
    where = tmp_path / "checkpoint" / "steps"
    where.mkdir(parents=True)
    (where / "0000.attempts.jsonl").write_text("".join(
        json.dumps({"stage": "rollout", "outputs": {"code": code}, "trace": [{"inputs": {"numbers": numbers}}]}) + "\n"
        for code, numbers in attempts.values()) + json.dumps({"stage": "rollout", "outputs": None, "trace": []}) + "\n")
    (tmp_path / "checkpoint" / "run.json").write_text(json.dumps({"fingerprint": "not an attempt"}))
    sum_demo = {"numbers": [1, 6, 9, 12], "code": attempts["0_1"][0]}
    (tmp_path / "program.json").write_text(json.dumps({"write_program": {"demos": [sum_demo]}}))
    lines = run("ceiling.py", str(tmp_path), "--limit", "3")
    assert lines[-1] == "written: programs=2 best_written=3 kept=0 of=3", lines


def test_worth(fake, tmp_path):
    """A saved Game of 24 program with an experience and a demo: each item's worth and the controls, pruned, on the
    smallest held-out set; a second run sends nothing (every run is checkpointed in the seed folder)."""
    import dspy

    from tfgrpo.programs import save_program
    from tfgrpo.programs.inject import apply_library
    from tfgrpo.programs.library import ExperienceLibrary
    from tfgrpo.tasks.game24 import Game24Solver

    program = Game24Solver()
    apply_library(program, ExperienceLibrary.recovered([("E1", "Try every order of the four numbers.", "")]))
    program.write_program.demos = [dspy.Example(numbers=[1, 2, 3, 4], code="print('(1 + 2 + 3) * 4')")]
    save_program(program, tmp_path / "arm" / "seed0" / "program.json")
    args = ["--runs", str(tmp_path / "arm"), "--queries", "4", "--prune", *endpoint(fake)]
    lines = run("worth.py", *args)
    assert re.fullmatch(rf"worth: task=game24 seed=0 items=2 library={X} ci_low={X} control={X} "
                        rf"ci_low_vs_control={X} pruned=[0-2]", lines[-1]), lines[-1]
    assert any(line.startswith("# | E1") for line in lines) and any(line.startswith("# | D1") for line in lines)
    calls = fake.stats()["calls"]
    assert run("worth.py", *args)[-1] == lines[-1] and fake.stats()["calls"] == calls


def test_same_run(tmp_path):
    """Two run directories compared: equal to itself, and a changed step record or library is said, field by field."""
    run_dir = tmp_path / "a"
    run_dir.mkdir()
    (run_dir / "library.json").write_text(json.dumps({"experiences": []}))
    (run_dir / "program.json").write_text(json.dumps({"self": {"demos": []}}))
    step = {"step": 0, "groups_kept": 2, "wall_s": 1.0, "usage": {"rollout": {"calls": 8}}, "details": {"old": 1}}
    (run_dir / "steps.jsonl").write_text(json.dumps(step) + "\n")
    shutil.copytree(run_dir, tmp_path / "b")
    other = dict(step, wall_s=2.0, usage={}, details={})  # timings and usage differ, and a removed count
    (tmp_path / "b" / "steps.jsonl").write_text(json.dumps(other) + "\n")
    assert run("same_run.py", str(run_dir), str(tmp_path / "b"), "--ignore", "details.old")[-1] == (
        "same_run: library_equal=true program_equal=true steps_equal=true steps=1,1")
    (tmp_path / "b" / "steps.jsonl").write_text(json.dumps(dict(other, groups_kept=1)) + "\n")
    lines = run("same_run.py", str(run_dir), str(tmp_path / "b"))
    assert lines[-1].endswith("steps_equal=false steps=1,1") and any(line.startswith("step 0 groups_kept") for line in lines)


def test_carry(fake, tmp_path):
    """The shipped Game of 24 program carried to another model (here the fake server), every arm at its smallest size,
    and its line; a second run reuses what was saved."""
    args = ["--task", "game24", "--seeds", "0", "--problems", "2", "--train", "2", "--refit-queries", "2",
            "--threads", "2", "--out", str(tmp_path), *endpoint(fake)]
    lines = run("carry.py", *args, timeout=600)
    assert re.fullmatch(rf"carry: task=game24 from=qwen2.5-coder-1.5b to=fake seeds=1 problems=2 baseline={X} "
                        rf"carried={X} refit={X} refit_steps={X} fresh={X} calls_refit=\d+ calls_fresh=\d+ "
                        rf"ci_low_refit_vs_fresh={X}", lines[-1]), lines[-1]
    before = fake.stats()["calls"]
    assert run("carry.py", *args)[-1] == lines[-1] and fake.stats()["calls"] == before
