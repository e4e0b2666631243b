"""The learned programs that ship (tfgrpo/learned.py): each is the benchmark's measured program with a provenance
that matches the saved results, `tfgrpo show NAME` prints it, and `tfgrpo evaluate NAME` scores it on its held-out
split through the benchmark's own evaluation code, sampled as stated (here against the fake LM server)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import dspy
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package

from benchmarks.peers import TFGRPO_ARMS, task_parts  # noqa: E402
from scripted_lm import ScriptedLM  # noqa: E402
from tfgrpo import learned  # noqa: E402
from tfgrpo.cli import app  # noqa: E402
from tfgrpo.evaluate import heldout_rows, read_rows  # noqa: E402
from tfgrpo.testing import FakeLMServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["game24", "gsm8k"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})


def solved(path: Path) -> float:
    return sum(row["score"] for row in read_rows(path))


def test_the_names_resolve_and_an_unknown_one_is_none():
    assert learned.names() == NAMES
    assert learned.find("game24").program_path == ROOT / "src" / "tfgrpo" / "learned_programs" / "game24" / "program.json"
    assert learned.find("mnist") is None


@pytest.mark.parametrize("name", NAMES)
def test_the_provenance_is_the_measured_run(name):
    """The program is the saved one of the benchmark run the provenance names, which scored what it states, the best
    seed of its arm; it was compiled with the arm's knobs and is scored with the benchmark's program, metric and
    held-out split."""
    shipped = learned.find(name)
    p, made = shipped.provenance, shipped.provenance["compiled_with"]
    source = ROOT / p["source"]
    task, arm, seed_dir = source.relative_to(ROOT / "benchmarks" / "results" / "peers").parts
    assert (arm, seed_dir) == (made["arm"], f"seed{made['seed']}")
    state = json.loads(shipped.program_path.read_text())
    recorded = state["metadata"].pop("provenance")  # where it learned, added for a refit on another model
    assert state == json.loads((source / "program.json").read_text())
    assert recorded["policy"] == [f"openai/{p['model']}"] and recorded["knobs"] == made["knobs"]
    assert (p["score"]["solved"], p["score"]["problems"]) == (solved(source / "eval.jsonl"), 48)
    assert p["score"]["baseline_solved"] == solved(source.parent.parent / "baseline" / seed_dir / "eval.jsonl")
    assert p["score"]["solved"] == max(solved(s / "eval.jsonl") for s in source.parent.glob("seed*"))
    assert made["knobs"].items() >= TFGRPO_ARMS[arm].items() and made["knobs"]["seed"] == made["seed"]
    assert p["sampling"]["rollout_id"] == made["seed"] and p["sampling"]["temperature"] == 0.3
    make, reward, metric, _, load_eval = task_parts(task)
    assert (learned.named(p["program"]), learned.named(made["reward"]), learned.named(p["metric"])) == (
        make, reward, metric)
    examples = learned.heldout(shipped)
    assert [dict(x) for x in examples] == [dict(x) for x in load_eval(48, p["heldout"]["offset"])]
    assert len(examples) == p["heldout"]["limit"] == 48


@pytest.mark.parametrize("name", NAMES)
def test_a_shipped_program_loads_with_its_demos(name):
    program = learned.load(learned.find(name))
    assert [len(p.demos) for _, p in program.named_predictors()] == [2]


def test_the_package_holds_the_learned_programs(tmp_path):
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                            "--build-lib", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    for name in NAMES:
        for file in ("program.json", "provenance.json"):
            assert (tmp_path / "tfgrpo" / "learned_programs" / name / file).is_file()


def test_show_name_prints_the_provenance_the_library_and_the_demos():
    result = invoke("show", "game24")
    assert result.exit_code == 0, result.output
    assert "compiled by tfgrpo-probed-wide+demos (seed 0)" in result.output
    assert "solved 34 of 48 (the uncompiled program: 2)" in result.output
    assert "experience library (0 active, 1 retired)" in result.output
    assert "demos (2)" in result.output and "def find_expression(numbers):" in result.output


def test_show_still_reads_a_file_and_refuses_what_is_neither(tmp_path):
    path = tmp_path / "program.json"
    path.write_text(learned.find("gsm8k").program_path.read_text())
    result = invoke("show", str(path))
    assert result.exit_code == 0 and "demos (2)" in result.output and "compiled by" not in result.output
    result = invoke("show", "mnist")
    assert result.exit_code == 2
    assert "mnist: no such file, and no shipped program of that name (there are: game24, gsm8k)" in result.output


def test_evaluate_name_scores_the_heldout_split_through_the_benchmarks_code():
    with FakeLMServer() as server:
        result = invoke("evaluate", "gsm8k", "--api-base", server.api_base)
        calls = server.stats()["kinds"]["student"]["calls"]
    assert result.exit_code == 0, result.output
    assert re.search(r"gsm8k: solved \d+ of 48 \(\d\.\d{3}, 95% bootstrap CI \d\.\d{3} \.\. \d\.\d{3} over problems\) "
                     r"in \d+ s; stated: 34 of 48, (in|out)side this run's CI", result.output), result.output
    assert calls == 48  # one run per held-out problem


def test_evaluate_a_config_still_needs_its_program(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[task]\nname = "game24"\n')
    result = invoke("evaluate", str(config))
    assert result.exit_code == 2 and "needs --program" in result.output


def test_the_sampling_is_the_provenances():
    """The LM is made with the stated temperature and reply limit, cache off; the benchmark's evaluation runs each
    problem once under rollout_id = the seed (scripted LM: every call's settings are recorded)."""
    shipped = learned.find("game24")
    lm = learned.sampling_lm(shipped, "http://127.0.0.1:1/v1")
    assert (lm.kwargs["temperature"], lm.kwargs["max_tokens"], lm.cache) == (0.3, 512, False)
    scripted = ScriptedLM(lambda messages, kwargs: {"answer": "4"}).copy(temperature=0.3)
    examples = [dspy.Example(question=f"What is {i} + 2?", answer=str(i + 2)).with_inputs("question") for i in (1, 2)]
    rows = heldout_rows(dspy.Predict("question -> answer"), examples, lambda ex, pred: pred.answer == ex.answer,
                        lm=scripted, seed=7, num_threads=2, name="p")
    assert [r["score"] for r in sorted(rows, key=lambda r: r["problem"])] == [0.0, 1.0]
    assert rows[0]["eval_calls"] == 2 and "wall_s" in rows[0]
    assert [(c["kwargs"]["rollout_id"], c["kwargs"]["temperature"]) for c in scripted.calls] == [(7, 0.3)] * 2
