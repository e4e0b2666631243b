"""Rendering into instructions, and save/load: in this process, in a new one, and in stock DSPy."""

import json
import subprocess
import sys
import textwrap

import dspy
import pytest

from tfgrpo.programs import ExperienceLibrary, apply_library, load_program, save_program, strip_experiences
from tfgrpo.programs.inject import OPEN_TAG
from tfgrpo.signatures import Operation


def library(*texts):
    lib = ExperienceLibrary()
    lib.apply([Operation(action="add", text=t) for t in texts], step=0, sources=["train#1"])
    return lib


def lookup(city: str) -> str:
    """Population of a city."""
    return "1000"


def test_rendering_is_appended_and_idempotent():
    program = dspy.ReAct("question -> answer", tools=[lookup])
    original = program.react.signature.instructions
    lib = library("When a tool fails, retry once with simpler arguments.")
    apply_library(program, lib)
    once = program.react.signature.instructions
    apply_library(program, lib)
    assert program.react.signature.instructions == once  # re-applying changes nothing
    assert once.startswith(original) and "lookup" in once  # the tool list survives
    assert once.count(OPEN_TAG) == 1 and "[E1] When a tool fails" in once
    assert strip_experiences(once) == original
    apply_library(program, ExperienceLibrary())  # an empty library removes the block
    assert program.react.signature.instructions == original


def test_structured_library_round_trips_through_program_save(tmp_path):
    program = apply_library(dspy.ChainOfThought("question -> answer"), library("When stuck, restate the goal."))
    program.save(tmp_path / "p.json")
    fresh = dspy.ChainOfThought("question -> answer")
    fresh.experience_library = ExperienceLibrary()
    fresh.load(tmp_path / "p.json")
    assert fresh.experience_library.texts() == ["When stuck, restate the goal."]
    assert fresh.experience_library.active["E1"].sources == ["train#1"]


def test_save_program_writes_no_lm_settings(tmp_path):
    lm = dspy.LM("openai/some-model", api_base="http://10.1.2.3:8000/v1", api_key="sk-secret-123")
    program = apply_library(dspy.Predict("question -> answer"), library("When x, do y."))
    program.set_lm(lm)
    save_program(program, tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    assert "sk-secret" not in text and "10.1.2.3" not in text and json.loads(text)["lm"] is None


SCRIPT = textwrap.dedent("""
    import json, sys
    import dspy
    {setup}
    program = dspy.ChainOfThought("question -> answer")
    program.load(sys.argv[1])
    print(json.dumps(program.predict.signature.instructions))
""")


@pytest.mark.parametrize("setup", ["", "import tfgrpo"], ids=["stock-dspy", "with-tfgrpo-installed"])
def test_saved_program_loads_in_a_new_process(tmp_path, setup):
    program = apply_library(dspy.ChainOfThought("question -> answer"), library("When a problem has units, convert first."))
    save_program(program, tmp_path / "agent.json")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup), str(tmp_path / "agent.json")],
                         capture_output=True, text=True, timeout=120, env={"LITELLM_LOCAL_MODEL_COST_MAP": "True",
                                                                            "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    instructions = json.loads(out.stdout.strip().splitlines()[-1])
    assert "[E1] When a problem has units, convert first." in instructions


def test_load_program_restores_the_library_and_reports_bad_files(tmp_path):
    program = apply_library(dspy.Predict("question -> answer"), library("When a, b."))
    path = save_program(program, tmp_path / "p.json")
    loaded = load_program(dspy.Predict("question -> answer"), path)
    assert loaded.experience_library.texts() == ["When a, b."]
    assert "[E1] When a, b." in loaded.signature.instructions

    bad = tmp_path / "bad.json"
    for content in ["{not json", "[]", json.dumps({"signature": 5}),
                    json.dumps({**json.loads(path.read_text()), "experience_library": {"format": "x"}})]:
        bad.write_text(content)
        target = dspy.Predict("question -> answer")
        with pytest.raises(ValueError, match="bad.json"):
            load_program(target, bad)
        assert OPEN_TAG not in target.signature.instructions  # nothing half-loaded
    with pytest.raises(ValueError, match="no saved state"):
        load_program(dspy.ChainOfThought("question -> answer"), path)


def test_a_file_of_another_program_is_refused_naming_what_each_holds(tmp_path):
    class Two(dspy.Module):
        def __init__(self):
            super().__init__()
            self.draft = dspy.Predict("question -> answer")
            self.check = dspy.Predict("question, answer -> verdict")

    class Other(dspy.Module):
        def __init__(self):
            super().__init__()
            self.solve = dspy.Predict("question -> answer")

    save_program(Other(), tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"no saved state for predictors \['draft', 'check'\]; the file holds "
                                         r"\['solve'\] and this program has \['draft', 'check'\]"):
        load_program(Two(), tmp_path / "other.json")


def test_a_file_whose_field_changed_type_is_refused_naming_both_types(tmp_path):
    class Worded(dspy.Signature):
        """Answer the question."""
        question: str = dspy.InputField()
        answer: str = dspy.OutputField()

    class Counted(dspy.Signature):
        """Answer the question."""
        question: str = dspy.InputField()
        answer: int = dspy.OutputField()

    saved = dspy.ChainOfThought(Worded)
    saved.predict.demos = [dspy.Example(question="How many legs has a cat?", reasoning="Cats walk on four.",
                                        answer="four")]
    save_program(saved, tmp_path / "worded.json")
    with pytest.raises(ValueError, match=r"predictor 'predict': field 'answer' was saved as str and is int in this "
                                         r"program"):
        load_program(dspy.ChainOfThought(Counted), tmp_path / "worded.json")
    assert load_program(dspy.ChainOfThought(Worded), tmp_path / "worded.json").predict.demos[0]["answer"] == "four"
    saved.save(str(tmp_path / "stock.json"))  # stock DSPy's file records no types: nothing to compare, it loads
    assert load_program(dspy.ChainOfThought(Counted), tmp_path / "stock.json").predict.demos[0]["answer"] == "four"
