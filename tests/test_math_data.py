"""The math loader: shipped sets, user JSONL files, clear errors, hub schemas mapped without network."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dspy
import pytest

from tfgrpo.tasks.math import BUILTIN, load_math
from tfgrpo.tasks.math import datasets as math_datasets

DATA_DIR = Path(math_datasets.__file__).parent / "data"
EXPECTED_ROWS = {
    "dapo100": 100,
    "aime24": 30,
    "aime25": 30,
    "gsm8k_train": 7473,
    "gsm8k_test": 1319,
    "math500": 500,
}


@pytest.fixture(scope="module", autouse=True)
def _private_arrow_cache(tmp_path_factory):
    """Keep the arrow files that `datasets` writes out of the user's cache during the tests."""
    old = os.environ.get("TFGRPO_DATASETS_CACHE")
    os.environ["TFGRPO_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_cache"))
    yield
    if old is None:
        os.environ.pop("TFGRPO_DATASETS_CACHE", None)
    else:
        os.environ["TFGRPO_DATASETS_CACHE"] = old


@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_builtin_sets_load_with_expected_rows_and_fields(name):
    examples = load_math(name)
    assert len(examples) == EXPECTED_ROWS[name]
    for ex in examples:
        assert isinstance(ex, dspy.Example)
        assert set(ex.inputs().keys()) == {"question"}  # only the question goes to the program
        assert isinstance(ex.question, str) and ex.question.strip()
        assert isinstance(ex.answer, str) and ex.answer.strip()
        assert "id" in ex  # extra fields ride along, outside the inputs
    assert len({ex.id for ex in examples}) == len(examples)


def test_builtin_files_live_in_the_package_and_match_the_readme_checksums():
    readme = (DATA_DIR / "README.md").read_text()
    for name, path in BUILTIN.items():
        assert path.is_relative_to(DATA_DIR)  # never /work/shared or another outside folder
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        row = next(line for line in readme.splitlines() if f"`{name}`" in line)
        assert digest in row, f"README checksum for {name} does not match {path}"
    assert (DATA_DIR / "LICENSES").is_dir() and any((DATA_DIR / "LICENSES").iterdir())


def test_extra_fields_are_kept_but_not_inputs():
    first = load_math("math500", limit=1)[0]
    assert first.id == "test/precalculus/807.json"
    assert first.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert first.level == 2 and first.subject == "Precalculus" and "solution" in first
    assert set(first.inputs().keys()) == {"question"}
    assert load_math("gsm8k_test", limit=1)[0].solution.endswith("#### 18")


def test_limit_offset_and_gsm8k_split_alias():
    window = load_math("gsm8k_test", offset=3, limit=2)
    assert [ex.id for ex in window] == ["gsm8k-test-3", "gsm8k-test-4"]
    assert [ex.id for ex in load_math("gsm8k", split="test", limit=1)] == ["gsm8k-test-0"]
    assert load_math("gsm8k", limit=1)[0].id == "gsm8k-train-0"
    assert len(load_math("aime24", offset=25)) == 5
    assert load_math("aime24", offset=100) == [] and load_math("aime24", limit=0) == []
    with pytest.raises(ValueError):
        load_math("aime24", offset=-1)


def test_user_jsonl_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"question": "What is 2+2?", "answer": "4", "source": "me"},
        {"question": "Half of 1?", "answer": 0.5},
        {"question": "Ten?", "answer": 10},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # trailing blank line is fine
    examples = load_math(str(path))
    assert [ex.answer for ex in examples] == ["4", "0.5", "10"]  # answers are always strings
    assert examples[0].source == "me" and set(examples[0].inputs().keys()) == {"question"}
    assert [ex.question for ex in load_math(str(path), offset=1, limit=1)] == ["Half of 1?"]


def test_mixed_value_types_fall_back_to_plain_json_reading(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"question": "a", "answer": "x+1"}\n\n{"question": "b", "answer": 7}\n')
    assert [ex.answer for ex in load_math(str(path))] == ["x+1", "7"]


@pytest.mark.parametrize(
    "bad_row, field",
    [
        ({"question": "no answer here"}, "answer"),
        ({"answer": "3"}, "question"),
        ({"question": "empty answer", "answer": "   "}, "answer"),
        ({"question": "", "answer": "3"}, "question"),
    ],
)
def test_missing_or_empty_field_names_file_and_line(tmp_path, bad_row, field):
    path = tmp_path / "broken.jsonl"
    good = json.dumps({"question": "ok?", "answer": "1"})
    # The bad row is the third record but sits on line 4, after a blank line.
    path.write_text(f"{good}\n{good}\n\n{json.dumps(bad_row)}\n{good}\n")
    with pytest.raises(ValueError) as err:
        load_math(str(path))
    message = str(err.value)
    assert str(path) in message and "line 4" in message and f"'{field}'" in message
    assert len(load_math(str(path), limit=2)) == 2  # rows outside the requested window are not checked


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "garbled.jsonl"
    path.write_text('{"question": "q", "answer": "1"}\n{"question": "q2", "answer":\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2")):
        load_math(str(path))


@pytest.mark.parametrize("name", ["no_such_set", "missing_file.jsonl", "./nope", "a/b/c"])
def test_unknown_source_is_a_clear_error(name):
    with pytest.raises(ValueError, match="unknown question set"):
        load_math(name)


def test_hub_schemas_are_mapped_to_question_and_answer():
    to_example = math_datasets._to_example
    aime = to_example({"id": 60, "problem": "Find x.", "answer": "204", "solution": "..."}, hub=True)
    assert (aime.question, aime.answer, aime.id) == ("Find x.", "204", 60)
    assert "problem" not in aime and aime.solution == "..."
    gsm = to_example({"question": "Eggs?", "answer": "16-3-4=9\n9*2=18\n#### 1,018"}, hub=True)
    assert gsm.answer == "1018" and gsm.solution.endswith("#### 1,018")
    boxed_only = to_example({"problem": "Half?", "solution": r"So it is $\boxed{\frac12}$."}, hub=True)
    assert boxed_only.answer == r"\frac12"
    dapo_prompt = (
        "Solve the following math problem step by step. The last line of your response should be of "
        "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        'What is 1+1?\n\nRemember to put your answer on its own line after "Answer:".'
    )
    dapo = to_example(
        {"prompt": [{"role": "user", "content": dapo_prompt}], "reward_model": {"ground_truth": "2"}},
        hub=True,
    )
    assert (dapo.question, dapo.answer) == ("What is 1+1?", "2")
    with pytest.raises(ValueError, match="'answer'"):
        to_example({"problem": "no answer"}, hub=True)


def test_loading_works_offline_and_hub_failures_are_clear():
    """With the hub switched off the shipped sets still load (local files never touch the network),
    and a hub id that cannot be fetched gives one clear ValueError."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    code = (
        "from tfgrpo.tasks.math import load_math\n"
        "print(len(load_math('aime25')))\n"
        "try:\n    load_math('HuggingFaceH4/aime_2024')\n"
        "except ValueError as exc:\n    print('ValueError:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "30"
    assert lines[1].startswith("ValueError: could not load question set 'HuggingFaceH4/aime_2024'")
