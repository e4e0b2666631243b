"""Issue 18: your own program, end to end, and nothing lost on the way (the optimizer's side; the CLI's side is
in test_cli_own_program.py)."""

import logging
import sys
from pathlib import Path

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import LESSON, compile_with, learner, make_trainset, metric
from tfgrpo.optimizers import MetricError, TooManyFailuresError, TrainingFreeGRPO
from tfgrpo.programs import ExperienceLibrary, apply_library, with_experiences
from tfgrpo.programs.inject import rendered_experiences
from tfgrpo.signatures import Operation

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package

from tfgrpo.testing import FakeLMServer  # noqa: E402

FIRST, SECOND = "When a sum has two digits, write the tens first.", "When unsure, add the numbers again."


# -- a program loaded with stock DSPy keeps what it learned ------------------------------------------------------
def test_a_program_loaded_with_stock_dspy_keeps_its_experiences_when_compiled_again(tmp_path, caplog):
    first = compile_with(ScriptedLM(learner(ops=[{"action": "add", "text": FIRST}, {"action": "add", "text": SECOND}])),
                         dspy.ChainOfThought("question -> answer"))
    assert first.experience_library.texts() == [FIRST, SECOND]
    first.save(tmp_path / "agent.json")  # stock DSPy, in the user's code

    program = dspy.ChainOfThought("question -> answer")
    program.load(tmp_path / "agent.json")
    assert not hasattr(program, "experience_library") and FIRST in program.predict.signature.instructions
    lm = ScriptedLM(learner())
    with caplog.at_level(logging.INFO, logger="tfgrpo"):
        again = compile_with(lm, program)
    assert again.experience_library.texts() == [FIRST, SECOND, LESSON]  # nothing dropped, the new one added
    assert [e.id for e in again.experience_library] == ["E1", "E2", "E3"]
    assert again.experience_library.active["E1"].history[0].action == "recovered"
    rollouts = [c for c in lm.calls if kind_of(c["messages"]) == "student"]
    assert all(SECOND in c["messages"][0]["content"] for c in rollouts), "the recovered library is in the prompts"
    assert "recovered" in caplog.text


def test_the_rendered_block_reads_back_exactly():
    library = ExperienceLibrary()
    library.apply([Operation(action="add", text=t) for t in (FIRST, "Two lines:\nthe second one.", SECOND)], step=0)
    library.apply([Operation(action="delete", ids=["E1"])], step=1)
    rendered = with_experiences("Answer the question.", library)
    # a text is kept on one line (src/tfgrpo/programs/library.py), so the rendering cannot read back as two experiences
    assert rendered_experiences(rendered) == [("E2", "Two lines: the second one.", ""), ("E3", SECOND, "")]
    assert rendered_experiences("Answer the question.") is None


def test_blocks_that_disagree_between_predictors_are_refused_not_guessed():
    class TwoStep(dspy.Module):
        def __init__(self):
            super().__init__()
            self.plan, self.solve = dspy.Predict("question -> plan"), dspy.Predict("question, plan -> answer")

    program = TwoStep()
    one, two = ExperienceLibrary(), ExperienceLibrary()
    one.apply([Operation(action="add", text=FIRST)], step=0)
    two.apply([Operation(action="add", text=SECOND)], step=0)
    apply_library(program, one, ["plan"])
    apply_library(program, two, ["solve"])
    del program.experience_library
    dspy.configure(lm=ScriptedLM(learner()))
    with pytest.raises(ValueError, match="differ"):
        TrainingFreeGRPO(metric, num_generations=2).compile(program, trainset=make_trainset())


# -- max_cost for a model without a price ------------------------------------------------------------------------
def test_max_cost_is_refused_for_a_model_without_a_price_and_stops_a_priced_one():
    def compile_on(model):
        with dspy.context(lm=dspy.LM(model, api_base=server.api_base, api_key="x", cache=False, num_retries=0)):
            return TrainingFreeGRPO(metric, num_generations=2, num_train_epochs=1, batch_size=2, max_cost=1e-9,
                                    progress=lambda *_: None).compile(dspy.Predict("question -> answer"),
                                                                      trainset=make_trainset())

    with FakeLMServer(latency=0.001) as server:
        with pytest.raises(ValueError, match=r"no price for the policy and reflection LM 'openai/fake'.*max_total_tokens"):
            compile_on("openai/fake")
        assert server.stats()["calls"] == 0
        # the same server under a model name DSPy can price: the budget is measured and stops the run
        results = compile_on("openai/gpt-4o-mini").detailed_results.to_dict()
    assert "max_cost" in results["stopped_early"] and results["steps"] == []  # charged before each unit: inside step 0
    assert results["usage"]["policy"]["cost"] > 0


# -- validation fails loudly ---------------------------------------------------------------------------------
class Fragile(dspy.Module):
    """A user program whose tool breaks on some questions."""

    def __init__(self):
        super().__init__()
        self.predict = dspy.Predict("question -> answer")

    def forward(self, question):
        if "boom" in question:
            raise RuntimeError(f"the calculator crashed on {question!r}")
        return self.predict(question=question)


def valset(broken, fine):
    return [dspy.Example(question=f"What is {i} + boom?", answer="0").with_inputs("question") for i in range(broken)] + \
        [dspy.Example(question=f"What is {i} + 1?", answer=str(i + 1)).with_inputs("question") for i in range(fine)]


def test_validation_errors_past_the_failure_rate_stop_the_run_with_the_first_error(tmp_path):
    with pytest.raises(TooManyFailuresError, match=r"validation after epoch 0: .*3 of 4.*calculator crashed"):
        dspy.configure(lm=ScriptedLM(learner()))
        TrainingFreeGRPO(metric, num_generations=4, batch_size=4, num_train_epochs=1, log_dir=str(tmp_path),
                         progress=lambda *_: None).compile(Fragile(), trainset=make_trainset(), valset=valset(3, 1))
    assert not (tmp_path / "epochs").exists(), "a failed validation is not saved as a score"


def test_a_few_validation_errors_are_warned_about_and_counted(caplog):
    dspy.configure(lm=ScriptedLM(learner()))
    with caplog.at_level(logging.INFO, logger="tfgrpo"):
        compiled = TrainingFreeGRPO(metric, num_generations=4, batch_size=4, num_train_epochs=1,
                                    progress=lambda *_: None).compile(Fragile(), trainset=make_trainset(),
                                                                      valset=valset(1, 3))
    epoch = compiled.detailed_results.to_dict()["epochs"][0]
    assert epoch["val_failures"] == 1 and epoch["val_score"] == pytest.approx(0.75)
    assert "failed on 1 of 4 validation examples" in caplog.text and "calculator crashed" in caplog.text
    assert compiled.detailed_results.to_dict()["best_epoch"] == 0 and "Keeping the library of epoch 0" in caplog.text


def test_replies_that_do_not_parse_score_0_and_do_not_stop_the_run(caplog):
    """A reply with content that the adapter cannot parse (a model that ran out of tokens before its answer field) is
    the program's own wrong answer, not an outage: 3 of 4 such validation replies are counted and score 0, and the run
    goes on (a tool that raises, as above, stops it)."""
    respond = learner()

    def cut_short(messages, kwargs):
        if kind_of(messages) == "student" and "boom" in messages[-1]["content"]:
            return "Let me think about this step by step. First I add the"  # no field: nothing to parse
        return respond(messages, kwargs)

    dspy.configure(lm=ScriptedLM(cut_short))
    with caplog.at_level(logging.INFO, logger="tfgrpo"):
        compiled = TrainingFreeGRPO(metric, num_generations=4, batch_size=4, num_train_epochs=1,
                                    progress=lambda *_: None).compile(dspy.Predict("question -> answer"),
                                                                      trainset=make_trainset(), valset=valset(3, 1))
    epoch = compiled.detailed_results.to_dict()["epochs"][0]
    assert epoch["val_failures"] == 3 and epoch["val_score"] == pytest.approx(0.25)
    assert "AdapterParseError" in caplog.text


# -- what DSPy users bring -----------------------------------------------------------------------------------
def test_a_two_argument_metric_works_as_in_dspy_evaluate():
    def exact(example, pred):  # what dspy.Evaluate calls: metric(example, prediction)
        return pred.answer == example.answer  # a bool, as DSPy metrics often return

    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    compiled = TrainingFreeGRPO(exact, num_generations=4, batch_size=4, num_train_epochs=1,
                                progress=lambda *_: None).compile(dspy.Predict("question -> answer"),
                                                                  trainset=make_trainset())
    assert compiled.experience_library.texts() == [LESSON]
    score = dspy.Evaluate(devset=make_trainset(), metric=exact, display_progress=False)(compiled).score
    assert score == 100.0  # the same metric, in DSPy's own evaluator


@pytest.mark.parametrize("value, says", [("1", r"returned '1' \(str\)"), (None, "None"),
                                         (dspy.Prediction(score="0.5"), r"'0.5' \(str\)")])
def test_a_metric_that_returns_no_number_is_an_error(value, says):
    def stringly(example, pred, trace=None):
        return value

    dspy.configure(lm=ScriptedLM(learner()))
    with pytest.raises(MetricError, match=says) as info:
        TrainingFreeGRPO(stringly, num_generations=2).compile(dspy.Predict("question -> answer"), trainset=make_trainset())
    assert "stringly" in str(info.value) and "a number in [0, 1]" in str(info.value)


def test_a_metric_of_the_wrong_shape_is_refused_at_once():
    with pytest.raises(TypeError, match=r"\(example, prediction\)"):
        TrainingFreeGRPO(lambda pred: 1.0)


def test_what_is_not_a_program_or_examples_gets_a_clear_error():
    dspy.configure(lm=ScriptedLM(learner()))
    optimizer = TrainingFreeGRPO(metric, num_generations=2)
    for program, says in [(lambda question: question, "dspy.Module"), ("question -> answer", "dspy.Module"),
                          (dspy.ChainOfThought, r"pass an instance: ChainOfThought\(\)")]:
        with pytest.raises(TypeError, match=says):
            optimizer.compile(program, trainset=make_trainset())
    program = dspy.Predict("question -> answer")
    with pytest.raises(TypeError, match=r"trainset\[0\] is a dict.*with_inputs"):
        optimizer.compile(program, trainset=[{"question": "What is 1 + 2?", "answer": "3"}])
    with pytest.raises(ValueError, match=r"trainset\[1\] has no input fields marked.*with_inputs"):
        optimizer.compile(program, trainset=[make_trainset()[0], dspy.Example(question="q", answer="a")])
    with pytest.raises(TypeError, match=r"valset\[0\] is a dict"):
        optimizer.compile(program, trainset=make_trainset(), valset=[{"question": "q"}])


# -- reading what was learned --------------------------------------------------------------------------------
def test_a_library_reads_as_its_experiences():
    library = ExperienceLibrary()
    library.apply([Operation(action="add", text=t) for t in (FIRST, SECOND)], step=0)
    library.apply([Operation(action="delete", ids=["E1"])], step=1)
    assert repr(library) == f"ExperienceLibrary(1 experience, 1 retired)\n  [E2] {SECOND}"
    assert repr(ExperienceLibrary()) == "ExperienceLibrary(0 experiences)"


def test_the_learning_path_auto_picks_is_logged_with_the_reason(caplog):
    lm = ScriptedLM(learner())
    with caplog.at_level(logging.INFO, logger="tfgrpo"):
        compile_with(lm, dspy.Predict("question -> answer"))
    assert "learning_path='auto' picked 'paper' for the reflection model 'dummy'" in caplog.text
    assert "no parameter count" in caplog.text
