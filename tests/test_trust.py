"""Issue 37: inputs a run must not trust in silence. Each test is one way a run used to go wrong without a word."""

import sys
from pathlib import Path

import dspy
import pytest

from scripted_lm import ScriptedLM
from test_optimizer import learner, make_trainset, metric
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.programs.library import ExperienceLibrary
from tfgrpo.signatures.operations import Operation

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks.trust_rows


def add(*texts):
    return [Operation(action="add", ids=[], text=t) for t in texts]


# 2 ----------------------------------------------------------------------------------------------------------
def test_experiences_in_every_script_are_kept_and_duplicates_still_found():
    lib = ExperienceLibrary()
    texts = ["Add the ones first, then carry.", "先加个位再进位。", "检查结果是否正确。", "تحقق من النتيجة دائما.",
             "בדוק את התוצאה תמיד.", "🔢 ➕ ✅"]
    report = lib.apply(add(*texts), step=0)
    assert report.rejected == [] and lib.texts() == texts
    again = lib.apply(add("ADD the ones first -- then carry", "先加个位再进位", "检查结果是否正确!", "🔢  ➕ ✅!",
                          "ＡＤＤ ｔｈｅ ｏｎｅｓ ｆｉｒｓｔ, then carry."), step=1)
    assert [reason for _, reason in again.rejected] == ["duplicate of E1", "duplicate of E2", "duplicate of E3",
                                                         "duplicate of E6", "duplicate of E1"]


def test_the_length_bound_holds_for_scripts_without_spaces():
    lib = ExperienceLibrary(max_words=32)
    report = lib.apply(add("先" * 3000, "先加个位再进位。" * 5, "ตรวจสอบ" * 100, "检查结果是否正确。"), step=0)
    assert [reason.split(",")[-1].strip() for _, reason in report.rejected] == ["over the limit of 32"] * 3
    assert "3000 words" in report.rejected[0][1] and "CJK character" in report.rejected[0][1]
    assert lib.texts() == ["检查结果是否正确。"]
    assert lib.apply(add(" ".join(["word"] * 32)), step=1).rejected == [], "32 words of English still fit"


# 5 ----------------------------------------------------------------------------------------------------------
class Solver(dspy.Module):
    def __init__(self):
        super().__init__()
        self.solve = dspy.ChainOfThought("question -> answer")

    def forward(self, question):
        return self.solve(question=question)


@pytest.mark.parametrize("program", [dspy.Predict("question -> answer"), dspy.ChainOfThought("question -> answer"),
                                     Solver()], ids=["Predict", "ChainOfThought", "own module"])
def test_a_valset_without_the_programs_inputs_is_refused_before_any_call(program):
    lm = ScriptedLM(learner())
    dspy.configure(lm=lm)
    valset = [dspy.Example(query=x.question, answer=x.answer).with_inputs("query") for x in make_trainset()[:4]]
    with pytest.raises(ValueError, match=r"valset\[0\] has no input \['question'\].*'query'"):
        TrainingFreeGRPO(metric, num_generations=4, num_train_epochs=1).compile(program, trainset=make_trainset(),
                                                                               valset=valset)
    assert lm.calls == [], "nothing is spent on a run that could only score 0"


# 6 ----------------------------------------------------------------------------------------------------------
def test_two_user_files_of_the_same_name_are_each_imported_as_themselves(tmp_path, monkeypatch):
    from tfgrpo.user_task import import_object, metric_function, program_factory

    for team, score in (("team_a", 0.0), ("team_b", 1.0)):
        (tmp_path / team).mkdir()
        (tmp_path / team / "agent.py").write_text(
            "import dspy\n\n\nclass Agent(dspy.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.gen = dspy.Predict('question -> answer')\n\n    def forward(self, question):\n"
            "        return self.gen(question=question)\n\n\n"
            f"TEAM = {team!r}\n\n\ndef metric(example, pred, trace=None):\n    return {score}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(sys.path))
    assert isinstance(program_factory("team_a/agent.py:Agent")(), dspy.Module)
    assert metric_function("team_b/agent.py:metric")(None, None) == 1.0, "team_b's metric, not team_a's"
    assert import_object("team_a/agent.py:metric", "metric")(None, None) == 0.0
    assert import_object("team_b/agent.py:TEAM", "x") == "team_b" and import_object("team_a/agent.py:TEAM", "x") == "team_a"
    assert import_object("team_a/agent.py:Agent", "program") is import_object("./team_a/agent.py:Agent", "program"), \
        "one file is imported once"


# 4 and 7: loading a saved program -------------------------------------------------------------------------------
def saved_program(tmp_path, signature="question -> answer"):
    from tfgrpo.programs import apply_library, save_program

    program = Solver() if signature == "question -> answer" else Labeller()
    library = ExperienceLibrary()
    library.apply(add("Add the ones first, then carry.", "Check the sum by subtracting."), step=0)
    return save_program(apply_library(program, library), tmp_path / "program.json")


class Labeller(dspy.Module):
    def __init__(self):
        super().__init__()
        self.solve = dspy.ChainOfThought("text -> label")  # the same predictor name as Solver's, other fields

    def forward(self, text):
        return self.solve(text=text)


def test_a_program_json_of_another_program_is_refused(tmp_path):
    from tfgrpo.programs import load_program

    path = saved_program(tmp_path, "text -> label")
    with pytest.raises(ValueError, match=r"solve.predict.*\['Text:', 'Reasoning:.*', 'Label:'\].*another program"):
        load_program(Solver(), path)
    assert load_program(Labeller(), path).experience_library.texts()[0] == "Add the ones first, then carry."


def test_tfgrpo_evaluate_refuses_another_programs_json_with_one_line_and_no_call(tmp_path):
    from typer.testing import CliRunner

    from test_cli_own_program import config, user_project
    from tfgrpo.cli import app
    from tfgrpo.testing import FakeLMServer

    files = user_project(tmp_path, "issue37_agent")  # its Agent's predictor is solve.predict: question -> answer
    other = saved_program(tmp_path, "text -> label")  # solve.predict too, with the fields text -> label
    with FakeLMServer() as server:
        path = config(tmp_path, server.api_base, f"{tmp_path / 'issue37_agent.py'}:Agent", files)
        result = CliRunner().invoke(app, ["evaluate", str(path), "--program", str(other)])
        assert server.stats()["calls"] == 0
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "predictor 'solve.predict': it was saved with the fields" in " ".join(result.output.split())


def edited(path, instructions=None, library=None):
    import json

    state = json.loads(path.read_text())
    if instructions:
        old = state["solve.predict"]["signature"]["instructions"]
        state["solve.predict"]["signature"]["instructions"] = instructions(old)
    if library:
        library(state["experience_library"])
    path.write_text(json.dumps(state))
    return path


def reword(lib):
    lib["experiences"][1]["text"] = "Check the sum by adding it again."


@pytest.mark.parametrize("edit, says", [
    (dict(instructions=lambda s: s.replace("by subtracting", "by adding it again")),
     r"disagree \(\[E2\] reads 'Check the sum by adding it again.' in the block and 'Check the sum by subtracting.'"),
    (dict(instructions=lambda s: s.replace("</experiences>", "")), "1 <experiences> and 0 </experiences> tags"),
    (dict(instructions=lambda s: s.replace("[E2]", "[E1]")), "gives the ID E1 to more than one experience"),
    (dict(instructions=lambda s: s.replace("[E1]", "[X1]")), r"malformed experience ID \[X1\]"),
    (dict(library=lambda lib: lib["experiences"][1].update(id="E1")), "the ID E1 is given to more than one"),
    (dict(library=lambda lib: lib["experiences"][0].update(id="X1")), "the ID 'X1' is not of the form E1, E2"),
    (dict(library=reword), r"\[E2\] reads 'Check the sum by subtracting.' in the block"),
], ids=["reworded-line", "no-close-tag", "duplicate-id-block", "X1-block", "duplicate-id-library", "X1-library",
        "reworded-library"])
def test_a_hand_edit_that_the_two_copies_disagree_on_is_refused(tmp_path, edit, says):
    from tfgrpo.programs import load_program

    path = edited(saved_program(tmp_path), **edit)
    program = Solver()
    with pytest.raises(ValueError, match=says):
        load_program(program, path)
    assert "<experiences>" not in program.solve.predict.signature.instructions, "nothing was loaded"


def test_an_edit_made_to_both_copies_loads_as_edited(tmp_path):
    from tfgrpo.programs import load_program

    path = edited(saved_program(tmp_path), instructions=lambda s: s.replace("by subtracting", "by adding it again"),
                  library=reword)
    program = load_program(Solver(), path)
    assert program.experience_library.texts()[1] == "Check the sum by adding it again."
    assert program.solve.predict.signature.instructions.count("Check the sum by adding it again.") == 1


# the rows of benchmarks/faults.py ---------------------------------------------------------------------------------
def test_the_faults_benchmark_rows_say_each_case_is_caught(tmp_path):
    from benchmarks.trust_rows import trust_rows

    def folder(name):
        (tmp_path / name).mkdir()
        return tmp_path / name

    rows = {row["name"]: row for row in trust_rows(folder)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "non_latin_rules": "nothing lost: 5 of 5 non-Latin rules kept; the 3,000-character rule refused",
        "other_program_json": "refused: the saved fields differ",
        "valset_input_keys": "refused, nothing sent",
        "same_file_name": "nothing lost: each file imported as itself",
        "hand_edited_json": "refused: 4 of 4 edits"}
    assert not any(row["crashes"] for row in rows.values())
