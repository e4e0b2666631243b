"""End to end on the real embedded model (Qwen2.5-Coder-0.5B on llama.cpp): compile, save, load elsewhere.

Skipped only when the local extra is not installed; CI sets TFGRPO_REQUIRE_LOCAL_MODEL=1, which turns that
skip into a failure so the real-model path always runs there.
"""

import json
import os
import subprocess
import sys
import textwrap

import dspy
import pytest

from tfgrpo import local_model, local_weights
from tfgrpo.lms import local_dspy_lm
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import load_program, save_program
from tfgrpo.programs import ExperienceLibrary, LearningCallError, Summarizer
from tfgrpo.programs.contrast_learner import ContrastLearner
from tfgrpo.signatures import Operation
from tfgrpo.tasks.game24 import Game24Solver, game24_reward, load_game24
from tfgrpo.tasks.math.datasets import load_math
from tfgrpo.tasks.math.metric import math_metric

MODEL = "qwen2.5-coder-0.5b"


def _missing() -> str | None:
    try:
        local_model.require_server_command()
        local_weights.find_parts(local_weights.MODELS[MODEL])
    except Exception as exc:  # not installed, or weights missing
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def local_lm():
    reason = _missing()
    if reason:
        if os.environ.get("TFGRPO_REQUIRE_LOCAL_MODEL"):
            pytest.fail(f"the real local model is required here but unavailable: {reason}")
        pytest.skip(reason)
    with local_model.LocalServer(MODEL, n_ctx=4096) as server:
        yield local_dspy_lm(server.model_alias, server.api_base, max_tokens=200, temperature=0.3, cache=False,
                            timeout=300, num_retries=1)  # generous: a loaded CI machine must not time out
    assert server.proc is None or server.proc.poll() is not None  # stopped, no orphan


@pytest.mark.local_model
def test_compile_save_and_load_in_stock_dspy(local_lm, tmp_path):
    dspy.configure(lm=local_lm)
    trainset = load_math("gsm8k_train", limit=2)
    # max_failure_rate=1.0: the 0.5B sometimes writes an unusable group advantage twice; with one group kept that is
    # "1 of 1 failed", which stops a run by design (tests/test_silent_failures.py) but is not what this test is about
    compiled = TrainingFreeGRPO(math_metric, num_generations=3, num_train_epochs=1, batch_size=2, num_threads=2,
                                learning_path="paper", max_demos=2, max_failure_rate=1.0,
                                log_dir=str(tmp_path / "log")).compile(dspy.ChainOfThought("question -> answer"),
                                                                       trainset=trainset)
    step = compiled.detailed_results.to_dict()["steps"][0]
    assert step["usage"]["rollout"]["calls"] >= 6 and step["usage"]["rollout"]["completion_tokens"] > 0
    assert 0.0 <= step["mean_reward"] <= 1.0 and step["rollout_failures"] <= 3
    expected_learning_calls = 3 * step["groups_kept"] + step["groups_kept"]
    assert step["usage"]["summary"]["calls"] + step["usage"]["advantage"]["calls"] >= expected_learning_calls

    path = save_program(compiled, tmp_path / "agent.json")
    assert "api_base" not in path.read_text()
    script = textwrap.dedent("""
        import json, sys, dspy
        p = dspy.ChainOfThought("question -> answer"); p.load(sys.argv[1])
        print(json.dumps([p.predict.signature.instructions, len(p.predict.demos)]))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert out.returncode == 0, out.stderr
    instructions, demos = json.loads(out.stdout.strip().splitlines()[-1])
    assert instructions == compiled.predict.signature.instructions
    assert demos == len(compiled.predict.demos) == len(step.get("demos", []))  # solved attempts, if any
    reloaded = load_program(dspy.ChainOfThought("question -> answer"), path)
    assert reloaded.experience_library.dump_state() == compiled.experience_library.dump_state()


@pytest.mark.local_model
def test_a_learning_call_on_the_real_model(local_lm):
    """The summary signature works on a real small model: a usable summary, or the typed failure."""
    summarizer = Summarizer()
    summarizer.set_lm(local_lm)
    try:
        summary = summarizer(task_input="question: What is 17 + 25?", attempt="reasoning: 17 + 25 = 32\nanswer: 32",
                             outcome="judged wrong (reward 0.00); extracted 32, expected 42", reference_answer="42",
                             experiences="(empty)")
    except LearningCallError:
        pytest.fail("the 0.5B model could not produce a parseable summary twice in a row")
    assert isinstance(summary, str) and len(summary.split()) >= 3


@pytest.mark.local_model
def test_contrast_call_is_constrained_by_the_live_library(local_lm):
    """Through the real llama.cpp server, the reply can only name actions and IDs the library allows."""
    library = ExperienceLibrary()
    library.apply([Operation(action="add", text="Search all orders of the numbers and all operators in code.")], step=0)
    learner = ContrastLearner(max_words=32, constrained="json_object")
    with dspy.context(lm=local_lm):
        rec = learner(task="numbers: [4, 7, 12, 12]", library=library, allowed="Game of 24",
                      better_attempt="code: ...\noutput: (7-4)*12-12\nresult: judged correct (reward 1.00)",
                      worse_attempt="code: ...\noutput: [stderr] NameError: name 'nums' is not defined\n"
                                    "result: judged wrong (reward 0.00)")
    assert local_lm.history[-1]["kwargs"]["response_format"]["schema"]["properties"]["target_id"]["enum"] == ["E1", "none"]
    assert rec["action"] in ("add", "modify", "none") and rec["target_id"] in ("E1", "none")


@pytest.mark.local_model
def test_the_real_model_places_a_rule_on_a_predictor_of_the_program(local_lm):
    """In a program of several predictors the contrast call's reply, decoded under its JSON schema by the real server,
    names one of the program's predictors (or "all"), and the rule's operation carries it."""
    roles = {"plan": "question -> approach: Say how to search for the answer",
             "write_program": "numbers, approach -> code: Write a Python program that prints the expression"}
    learner = ContrastLearner(max_words=32, constrained="json_object")
    before = len(local_lm.history)
    with dspy.context(lm=local_lm):
        rec = learner(task="numbers: [4, 7, 12, 12]", library=ExperienceLibrary(), allowed="Game of 24", roles=roles,
                      better_attempt="plan: try every order\ncode: ...\noutput: (7-4)*12-12\nresult: judged correct "
                                     "(reward 1.00)",
                      worse_attempt="plan: add them\ncode: print(4+7+12+12)\noutput: 35\nresult: judged wrong "
                                    "(reward 0.00)")
    schema = local_lm.history[before]["kwargs"]["response_format"]["schema"]  # (the contrast call; a rewrite may follow)
    assert schema["properties"]["predictor"]["enum"] == ["plan", "write_program", "all"]
    if rec["operation"] is not None:
        assert rec["operation"].predictors in (["plan"], ["write_program"], ["all"]), rec


@pytest.mark.local_model
def test_game24_compiles_on_the_contrast_path(local_lm, tmp_path):
    """The small-reflector path end to end: code-writing rollouts in the sandbox, partial-credit rewards,
    contrast calls under the schema, a library that loads back."""
    dspy.configure(lm=local_lm)
    # one LM call per rollout: without this, a reply in a broken format is asked again by DSPy's JSON adapter (a
    # second, legitimate call that made the count below 7 now and then); the context also reaches the step's threads
    with dspy.context(adapter=dspy.ChatAdapter(use_json_adapter_fallback=False)):
        compiled = TrainingFreeGRPO(game24_reward, num_generations=3, num_train_epochs=1, batch_size=2, num_threads=2,
                                    max_operations_per_group=1, constrained_decoding="json_object",
                                    log_dir=str(tmp_path / "log")).compile(Game24Solver(),
                                                                           trainset=load_game24(limit=2, offset=300))
    step = compiled.detailed_results.to_dict()["steps"][0]
    why = json.dumps({k: v for k, v in step.items() if k != "demos"}, default=str)  # the whole record if one fails
    assert step["usage"]["rollout"]["calls"] == 6 and "summary" not in step["usage"], why
    assert step["usage"].get("contrast", {}).get("calls", 0) >= step["groups_kept"] - step["learning_failures"], why
    assert step["operations_applied"]["add"] == len(compiled.experience_library), why
    reloaded = load_program(Game24Solver(), save_program(compiled, tmp_path / "game24.json"))
    assert reloaded.experience_library.texts() == compiled.experience_library.texts()


@pytest.mark.local_model
def test_a_bounded_field_closes_under_the_grammar_on_the_real_model(local_lm):
    """Asked for a long text in a field bounded to 40 characters, the real server's grammar closes the string
    at the bound and the field after it is still written: the reply parses."""
    from tfgrpo.programs.constrained import ConstrainedJSONAdapter

    class Essay(dspy.Signature):
        topic: str = dspy.InputField()
        essay: str = dspy.OutputField(desc="a long essay, at least 300 words", max_length=40)
        done: bool = dspy.OutputField()

    with dspy.context(lm=local_lm, adapter=ConstrainedJSONAdapter("json_object")):
        pred = dspy.Predict(Essay)(topic="the history of the bicycle")
    assert 0 < len(pred.essay) <= 40 and isinstance(pred.done, bool)


@pytest.mark.local_model
def test_web_step_agent_and_judge_on_the_real_model(local_lm):
    """The offline web task on the real model: every step is decoded under its JSON schema (llama.cpp's
    json_object form), so each turn is a legal action whatever the model writes, and the run ends in an answer
    within max_iters tool calls; the judge's verdict is read under its schema too."""
    from tfgrpo.tasks.web import LLMJudge, PageFetcher, StepAgent, WebTools
    from tfgrpo.tasks.web.search import make_backend
    from tfgrpo.tasks.web.site import running_site

    dspy.configure(lm=local_lm)
    question = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"
    with running_site() as base:
        tools = WebTools(make_backend("local", base_url=base), fetcher=PageFetcher(allowed_origins=[base]), top_k=3)
        pred = StepAgent(tools, max_iters=2, constrained="json_object")(question=question)
    names = [v for k, v in pred.trajectory.items() if k.startswith("tool_name_")]
    assert names[-1] == "finish" and set(names[:-1]) <= {"search", "open_page"} and len(names) <= 3
    assert isinstance(pred.answer, str)
    correct, reason = LLMJudge(local_lm, constrained="json_object")(question, "Chief of Protocol", pred.answer or "none")
    assert isinstance(correct, bool) and isinstance(reason, str)
