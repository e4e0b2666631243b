"""Carrying a learned program to another model: the saved program says where it learned (its provenance, which stock
DSPy reads past), and a compile on another model refits what it carries first: each item measured on the new model on
held-out queries, those that do not help it left out, then the steps go on from the rest."""

import json
import logging

import dspy
import pytest

from scripted_lm import ScriptedLM, kind_of
from test_optimizer import LESSON, compile_with, learner, make_trainset, metric, student_answer
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs import ExperienceLibrary, apply_library, load_program, save_program

HURTS = "Always answer minus one when the sum looks large."


def carried(tmp_path, policy="openai/model-a"):
    """A program learned elsewhere: two experiences (one helps any model, one hurts), saved with its provenance."""
    library = ExperienceLibrary()
    from tfgrpo.signatures.operations import Operation

    library.apply([Operation(action="add", text=LESSON), Operation(action="add", text=HURTS)], step=0)
    program = apply_library(dspy.Predict("question -> answer"), library)
    program.provenance = {"policy": [policy], "reflection": policy, "knobs": {}, "steps": 2,
                          "worth": {"E1": 0.5, "E2": 0.25}}
    save_program(program, tmp_path / "program.json")
    return tmp_path / "program.json"


def new_model():
    """This run's model: right only with the helpful rule in its prompt and not the hurtful one."""
    def respond(messages, kwargs):
        if kind_of(messages) == "student":
            values = student_answer(messages, kwargs)
            if HURTS in messages[0]["content"] or LESSON not in messages[0]["content"]:
                values["answer"] = "-1"
            return values
        return learner()(messages, kwargs)
    lm = ScriptedLM(respond)
    lm.model = "openai/model-b"
    return lm


def test_a_saved_program_carries_its_provenance_and_stock_dspy_still_loads_it(tmp_path):
    compiled = compile_with(ScriptedLM(learner()), dspy.Predict("question -> answer"), max_demos=1)
    assert compiled.provenance["steps"] == 1 and compiled.provenance["knobs"]["num_generations"] == 4
    save_program(compiled, tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["metadata"]["provenance"]["policy"] == compiled.provenance["policy"]
    assert load_program(dspy.Predict("question -> answer"), tmp_path / "p.json").provenance == compiled.provenance
    stock = dspy.Predict("question -> answer")
    stock.load(str(tmp_path / "p.json"))  # stock DSPy reads past the provenance
    assert LESSON in stock.signature.instructions


def test_a_refit_measures_each_carried_item_on_the_new_model_and_leaves_out_what_hurts(tmp_path, caplog):
    student = load_program(dspy.Predict("question -> answer"), carried(tmp_path))
    dspy.configure(lm=new_model())
    held_out = make_trainset(8)[4:]
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = TrainingFreeGRPO(metric, auto="off", num_train_epochs=0, num_threads=2).compile(
            student, trainset=make_trainset(4), valset=held_out)
    refit = compiled.detailed_results.refit
    assert [(item.id, item.learned_on["policy"], item.learned_on["worth"]) for item in refit.items] == [
        ("E1", ["openai/model-a"], 0.5), ("E2", ["openai/model-a"], 0.25)]
    worth = {item.id: item.worth for item in refit.items}
    assert worth["E2"] < 0 and worth["E2"] < worth["E1"]  # the hurtful rule costs the new model
    assert refit.pruned == ["E2"] and compiled.experience_library.texts() == [LESSON]
    assert "Refit: each of the 2 carried item(s) measured on openai/model-b" in caplog.text
    assert compiled.provenance["carried_from"]["policy"] == ["openai/model-a"]


def test_no_refit_on_the_model_that_learned_it_unless_asked_and_a_refit_needs_held_out_queries(tmp_path):
    student = load_program(dspy.Predict("question -> answer"), carried(tmp_path, policy="openai/model-b"))
    dspy.configure(lm=new_model())
    same = TrainingFreeGRPO(metric, auto="off", num_train_epochs=0).compile(student, trainset=make_trainset(4),
                                                                           valset=make_trainset(8)[4:])
    assert same.detailed_results.refit is None and len(same.experience_library) == 2  # "auto": learned here
    with pytest.raises(ValueError, match="refit=True measures the carried items on held-out queries"):
        TrainingFreeGRPO(metric, refit=True).plan(student, make_trainset(4))
    asked = TrainingFreeGRPO(metric, auto="off", num_train_epochs=0, refit=True).compile(
        student, trainset=make_trainset(4), valset=make_trainset(8)[4:])
    assert asked.detailed_results.refit.pruned == ["E2"]


def test_tfgrpo_refit_measures_a_saved_program_on_the_configs_model(tmp_path):
    """`tfgrpo refit PROGRAM CONFIG`: the saved program's items measured on the config's model on its valset, written
    to refit.json, and said with where each was learned; the program it writes carries what was kept."""
    import contextlib

    from typer.testing import CliRunner

    from test_cli import config
    from tfgrpo.cli import app
    from tfgrpo.config import Config
    from tfgrpo.signatures.operations import Operation
    from tfgrpo.task import task_parts
    from tfgrpo.testing import FakeLMServer

    with FakeLMServer(latency=0.001) as server:
        path = config(tmp_path, server.api_base)
        text = path.read_text().replace('eval_limit = 5\n', 'eval_limit = 5\nvalset = "gsm8k_test"\nval_limit = 4\n')
        path.write_text(text)
        cfg = Config.load(path)
        with contextlib.ExitStack() as stack:
            program = task_parts(cfg, stack).make()
        library = ExperienceLibrary()
        library.apply([Operation(action="add", text="Check the units of the answer."),
                       Operation(action="add", text="Write the final number alone.")], step=0)
        program = apply_library(program, library)
        program.provenance = {"policy": ["openai/other"], "reflection": "openai/other", "knobs": {}, "steps": 1,
                              "worth": {"E1": 0.1}}
        save_program(program, tmp_path / "carried.json")
        result = CliRunner().invoke(app, ["refit", str(tmp_path / "carried.json"), str(path)])
    assert result.exit_code == 0, result.output
    refit = json.loads((tmp_path / "run" / "refit.json").read_text())
    assert [item["id"] for item in refit["items"]] == ["E1", "E2"]
    assert refit["items"][0]["learned_on"] == {"policy": ["openai/other"], "worth": 0.1}
    assert "What each carried item is worth on this model" in result.output
    assert "learned with openai/other: worth there +0.100" in result.output
    kept = json.loads((tmp_path / "run" / "library.json").read_text())["experiences"]
    assert [e["id"] for e in kept] == [i["id"] for i in refit["items"] if i["id"] not in refit["pruned"]]


@pytest.mark.parametrize("name", ["game24", "gsm8k"])
def test_a_shipped_program_says_where_it_learned_so_another_model_refits_it(name):
    """The shipped programs record the model that learned them (the embedded 1.5B): planned on the 0.5B with held-out
    queries, `refit="auto"` refits their demos; on the 1.5B it does not. Stock DSPy still loads the file."""
    from tfgrpo import learned
    from tfgrpo.lms import local_dspy_lm

    shipped = learned.find(name)
    program = load_program(learned.named(shipped.provenance["program"])(), shipped.program_path)
    assert program.provenance["policy"] == [f"openai/{shipped.provenance['model']}"]
    queries = learned.heldout(shipped)[:4]
    for model, refit in (("qwen2.5-coder-0.5b", True), (shipped.provenance["model"], False)):
        with dspy.context(lm=local_dspy_lm(model, "http://127.0.0.1:1/v1", max_tokens=512)):
            plan = TrainingFreeGRPO(metric, auto="off", max_demos=2, num_train_epochs=0).plan(
                program, queries, queries)
        assert plan.refit is refit and len(plan.demos) == 2, model
    stock = learned.load(shipped)  # dspy's own load
    assert len(stock.predictors()[0].demos) == 2


def test_demos_another_optimizer_wrote_are_named_when_max_demos_leaves_them_unmeasured(caplog):
    """A student whose demos stock dspy.BootstrapFewShot kept, refit=True with max_demos=0 (the small model's preset):
    the run says in one line that they stay unmeasured and which max_demos would measure them."""
    student = dspy.Predict("question -> answer")
    student.demos = [dspy.Example(question="What is 1 + 1?", answer="2", augmented=True),
                     dspy.Example(question="What is 2 + 3?", answer="5", augmented=True)]
    with caplog.at_level(logging.WARNING, logger="tfgrpo"):
        compiled = compile_with(ScriptedLM(learner()), student, valset=make_trainset(4), refit=True, max_demos=0,
                                num_train_epochs=1)
    assert "carries 2 demo(s) that the refit does not measure, since max_demos=0" in caplog.text
    assert "pass max_demos=2" in caplog.text and len(compiled.demos) == 2  # left as they were
