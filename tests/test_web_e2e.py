"""The web task offline, end to end: the local site on a real port with a real index, a scripted LM that
searches, opens a page and answers; compile, save, load (also in stock DSPy), and the CLI's web path."""

from __future__ import annotations

import json
import re

import dspy
import pytest
from scripted_lm import ScriptedLM, output_fields

from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import load_program, save_program
from tfgrpo.tasks.web import PageFetcher, StepAgent, WebTools, f1_metric, react_agent
from tfgrpo.tasks.web.search import make_backend
from tfgrpo.tasks.web.site import running_site
from tfgrpo.testing import FakeLMServer

RULE = "Read the page of the top search result before you answer."
QUESTIONS = [("What government position was held by the actress Shirley Temple?", "Chief of Protocol"),
             ("Which city is the Edithvale railway station's line in?", "Melbourne")]
ANSWERS = {"Shirley": "Chief of Protocol", "Edithvale": "Melbourne"}  # what a careful reader finds on the opened page


def field(messages, name: str) -> str:
    text = messages[-1]["content"].split("\n\nRespond with the corresponding output fields")[0]
    match = re.search(rf"\[\[ ## {name} ## \]\]\n(.*?)(?=\n\n\[\[ ## |\Z)", text, re.S)
    return match.group(1).strip() if match else ""


def agent_lm():
    """Searches the question, opens the first result, answers. Without the learned rule only even rollouts read
    the page before answering (the others guess); with it, every attempt does."""

    def respond(messages, kwargs):
        fields = output_fields(messages)
        if "difference" in fields:  # the contrast learner
            return {"difference": "the better attempt read the page", "action": "add", "rule": RULE}
        question, history = field(messages, "question"), field(messages, "history")
        if history == "(nothing yet)":
            return {"thought": "search first", "action": "search", "argument": question}
        if "open_page:" not in history:
            careful = RULE in messages[0]["content"] or kwargs.get("rollout_id", 0) % 2 == 0
            if careful:
                url = re.search(r"http://127\.0\.0\.1:\d+/wiki/\S+", history).group(0)
                return {"thought": "read the top page", "action": "open_page", "argument": url}
            return {"thought": "guess", "action": "answer", "argument": "Governor"}
        key = next(k for k in ANSWERS if k in question)
        found = ANSWERS[key] if ANSWERS[key].split()[0] in history else "unknown"
        return {"thought": "the page says it", "action": "answer", "argument": found}

    return ScriptedLM(respond)


@pytest.fixture(scope="module")
def site():
    with running_site() as base:  # the shipped HotpotQA corpus, on a real port
        yield base


def tools_for(base: str) -> WebTools:
    return WebTools(make_backend("local", base_url=base), fetcher=PageFetcher(allowed_origins=[base]), top_k=3)


def examples():
    return [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in QUESTIONS]


def test_step_agent_searches_opens_and_answers_over_http(site):
    dspy.configure(lm=agent_lm(), adapter=dspy.ChatAdapter(use_json_adapter_fallback=False))
    pred = StepAgent(tools_for(site))(question=QUESTIONS[0][0])
    t = pred.trajectory
    assert [t["tool_name_0"], t["tool_name_1"], t["tool_name_2"]] == ["search", "open_page", "finish"]
    assert t["observation_0"].startswith("1. Shirley Temple\n")  # the real index ranked the right page first
    assert "Chief of Protocol" not in t["observation_0"]  # the snippet does not say it: the page must be read
    assert "Chief of Protocol" in t["observation_1"] and pred.answer == "Chief of Protocol"


def test_compile_learns_the_rule_then_saves_and_loads(site, tmp_path):
    lm = agent_lm()
    dspy.configure(lm=lm, adapter=dspy.ChatAdapter(use_json_adapter_fallback=False))
    student = StepAgent(tools_for(site), max_iters=3)
    compiled = TrainingFreeGRPO(f1_metric, learning_path="contrast", num_generations=4, batch_size=2,
                                num_threads=2, max_operations_per_group=1).compile(student, trainset=examples())
    assert [e.text for e in compiled.experience_library.active.values()] == [RULE]
    assert RULE not in student.step.signature.instructions  # the student is never changed
    steps = compiled.detailed_results.to_dict()["steps"]
    assert steps[0]["tool_calls_mean"] > 1.0 and 0 < steps[0]["mean_reward"] < 1
    learner_saw = next(c for c in lm.calls if "difference" in output_fields(c["messages"]))["messages"][-1]["content"]
    assert "open_page(http://127.0.0.1:" in learner_saw and "characters returned)" in learner_saw  # the actions...
    assert "ambassador to Ghana" not in learner_saw  # ...not the page they read (a small model copies facts)

    path = save_program(compiled, tmp_path / "program.json")
    loaded = load_program(StepAgent(tools_for(site), max_iters=3), path)
    stock = StepAgent(tools_for(site), max_iters=3)
    stock.load(str(path))  # DSPy's own loader: the rule lives in the saved instructions
    for program in (loaded, stock):
        assert RULE in program.step.signature.instructions
        with dspy.context(lm=lm.copy(rollout_id=1)):  # an odd rollout: guessed before learning, reads now
            assert program(question=QUESTIONS[0][0]).answer == "Chief of Protocol"


def test_dspy_react_uses_the_same_tools(site):
    calls = iter([{"next_thought": "search", "next_tool_name": "search", "next_tool_args": {"query": "Kiss and Tell 1945"}},
                  {"next_thought": "read", "next_tool_name": "open_page",
                   "next_tool_args": {"url": "/wiki/Shirley_Temple"}},
                  {"next_thought": "done", "next_tool_name": "finish", "next_tool_args": {}},
                  {"reasoning": "the page says so", "answer": "Chief of Protocol"}])
    dspy.configure(lm=ScriptedLM(lambda m, k: next(calls)), adapter=dspy.ChatAdapter(use_json_adapter_fallback=False))
    pred = react_agent(tools_for(site), max_iters=4)(question=QUESTIONS[0][0])
    assert "Kiss and Tell (1945 film)" in pred.trajectory["observation_0"]
    assert pred.trajectory["observation_1"].startswith("refused: only http:// and https://")  # a relative URL: a message, not a crash
    assert pred.answer == "Chief of Protocol"


WEB_CONFIG = """
run_dir = "{run_dir}"
[policy]
backend = "litellm"
model = "openai/fake"
api_base = "{api_base}"
cache = false
[task]
name = "web"
trainset = "hotpotqa_train"
train_limit = 2
evalset = "hotpotqa_dev"
eval_limit = 2
max_iters = 2
[web]
reward = "f1"
[optimizer]
num_generations = 2
num_train_epochs = 1
batch_size = 2
num_threads = 4
[evaluate]
num_threads = 2
"""


def test_cli_runs_the_web_task_and_reports_all_three_scores(tmp_path):
    from typer.testing import CliRunner

    from tfgrpo.cli import app

    with FakeLMServer(latency=0.001, tool_turns=1) as server:  # one search on the local site, then an answer
        config = tmp_path / "web.toml"
        config.write_text(WEB_CONFIG.format(run_dir=tmp_path / "run", api_base=server.api_base))
        result = CliRunner().invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "eval" / "summary.json").read_text())
    assert set(summary["baseline"]["metrics"]) == {"judge", "em"} and "paired_judge" in summary
    rows = [json.loads(x) for x in (tmp_path / "run" / "eval" / "baseline.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(r["metrics"]) == {"judge", "em"} for r in rows)
    assert all(r["tool_calls"] == 1 and not r["error"] for r in rows)
    cached = (tmp_path / "run" / "judge_cache.jsonl").read_text().splitlines()
    assert summary["judge_calls"] == len(cached) >= 1  # baseline and compiled share the verdicts of equal answers
    report = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "rep")])
    assert report.exit_code == 0, report.output
    assert re.search(r"\| judge [01]\.\d{3}, em [01]\.\d{3} \| 1\.00 \|", (tmp_path / "rep" / "report.md").read_text())


def test_tools_turn_failures_into_messages_and_keep_goal_passages(site):
    from tfgrpo.tasks.web import open_page

    assert open_page(f"{site}/wiki/Shirley_Temple").startswith("refused: 127.0.0.1 is a loopback")  # safe as imported
    tools = tools_for(site)
    assert tools.open_page("http://169.254.169.254/latest/meta-data/").startswith("refused: 169.254.169.254 is a cloud metadata")
    assert tools.open_page(f"{site}/wiki/No_such_page").startswith("HTTP 404")
    dead = WebTools(make_backend("local", base_url="http://127.0.0.1:9"), top_k=3)  # nothing listens there
    assert dead.search("anything").startswith("search failed: ")
    page_lm = ScriptedLM(lambda m, k: {"passages": "she served as Chief of Protocol"})
    reader = WebTools(make_backend("local", base_url=site), fetcher=PageFetcher(allowed_origins=[site]), page_lm=page_lm)
    url = f"{site}/wiki/Shirley_Temple"
    assert reader.open_page(url, goal="her government position") == "she served as Chief of Protocol"
    assert "Chief of Protocol" in page_lm.calls[0]["messages"][-1]["content"]  # the page text went to the page LM
    assert reader.open_page(url).startswith("Shirley Temple")  # without a goal: the page's main text
    long = WebTools(make_backend("local", base_url=site), fetcher=PageFetcher(allowed_origins=[site]), page_chars=200)
    page = long.open_page(url)
    assert re.fullmatch(r"Shirley Temple.{0,190}\S \[\.\.\. \d+ characters cut \.\.\.\]", page, flags=re.S)
