"""The optimizer's knobs are declared once (`tfgrpo.optimizers.knobs.Knobs`): the constructor, the config file's
[optimizer] section and the docstring are made from the declaration, and what is still written by hand about
them (configs/reference.toml, the table of docs/usage.md) is checked against it here; a failure prints the
difference."""

import difflib
import inspect
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tfgrpo.config import SET_ELSEWHERE, OptimizerConfig
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.knobs import KNOBS, Knobs, default_text, fingerprinted_knobs, knob_table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent.parent
CONFIG_ONLY = {"method", "num_direct_experiences"}  # the direct baseline's keys

BAD = [("num_generations", 0), ("num_generations", 2.5), ("temperature", -0.1), ("temperature", 3),
       ("num_train_epochs", -1), ("batch_size", 0), ("seed", "zero"), ("reflection_lm", "gpt-4o"),
       ("max_operations_per_group", 0), ("use_ground_truth", "yes"), ("max_experiences", 0),
       ("max_words_per_experience", 3), ("target_predictors", []), ("target_predictors", "predict"),
       ("num_threads", 0), ("max_failure_rate", 1.5), ("max_cost", 0), ("max_cost", -1.0),
       ("max_total_tokens", 0), ("max_metric_calls", 0), ("log_dir", 3), ("progress", "bar"), ("learning_path", "fast"),
       ("constrained_decoding", "xml"), ("use_mlflow", "yes"), ("metric_timeout_s", 0), ("metric_timeout_s", "1"),
       ("max_steps", 0)]


def metric(example, pred, trace=None):
    return 1.0


def differences(label: str, expected: list[str], found: list[str]) -> str:
    """A unified diff of two lists of lines, for an assertion's message."""
    return f"{label} disagrees with src/tfgrpo/optimizers/knobs.py:\n" + "\n".join(
        difflib.unified_diff(expected, found, "declared (src/tfgrpo/optimizers/knobs.py)", label, lineterm=""))


def test_the_constructor_takes_exactly_the_declared_knobs_keyword_only():
    params = inspect.signature(TrainingFreeGRPO.__init__).parameters
    assert [p for p in params if p not in ("self", "metric")] == list(KNOBS)
    assert params["metric"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in KNOBS)
    assert {p: params[p].default for p in KNOBS} == {name: f.default for name, f in KNOBS.items()}
    assert TrainingFreeGRPO(metric).probe_size == 0 and TrainingFreeGRPO(metric, probe_size=4).probe_size == 4
    with pytest.raises(TypeError):
        TrainingFreeGRPO(metric, 5)  # knobs are keyword-only, as in DSPy's optimizers


def test_the_library_defaults_are_the_papers():
    defaults = {name: f.default for name, f in KNOBS.items()}
    assert {k: defaults[k] for k in ("num_generations", "num_train_epochs", "batch_size", "num_threads",
                                     "temperature")} == {"num_generations": 5, "num_train_epochs": 3,
                                                         "batch_size": 50, "num_threads": 8, "temperature": 0.7}


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_knob_is_refused_by_the_constructor_and_the_config_alike(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        TrainingFreeGRPO(metric, **{name: value})
    with pytest.raises(ValueError, match=f"^{name} must be"):
        Knobs(**{name: value})
    if name in OptimizerConfig.model_fields:
        with pytest.raises(ValidationError, match=name):
            OptimizerConfig(**{name: value})


def documented_defaults() -> dict[str, str]:
    """Each argument of the class docstring's Args section, and the default it states ("Default 5.")."""
    doc = TrainingFreeGRPO.__doc__.split("Args:", 1)[1]
    entries = re.findall(r"^ {8}(\w+)(?: \([^)]*\))?: (.*?)(?=^ {8}\w+(?: \([^)]*\))?: |\Z)", doc,
                         flags=re.MULTILINE | re.DOTALL)  # "name (type): ..." (a knob's type) or "name: ..."
    return {name: m.group(1) if (m := re.search(r'Default ("[^"]*"|-?\d+(?:\.\d+)?|None|True|False)(?=[\s.:,(]|$)',
                                                " ".join(text.split()))) else None for name, text in entries}


def test_the_docstring_documents_each_knob_with_its_default():
    stated = documented_defaults()
    assert list(stated) == ["metric", *KNOBS], "the docstring documents the knobs, in the declaration's order"
    assert {k: stated[k] for k in KNOBS} == {k: default_text(k) for k in KNOBS}
    assert all(f.metadata["doc"].strip() for f in KNOBS.values()), "every knob has its documentation"


def test_every_knob_a_file_can_hold_is_in_the_config_section():
    assert set(KNOBS) - set(OptimizerConfig.model_fields) == set(SET_ELSEWHERE)
    assert set(OptimizerConfig.model_fields) - set(KNOBS) == CONFIG_ONLY


def test_the_configs_defaults_are_the_optimizers():
    config = OptimizerConfig()
    differ = {k: (getattr(config, k), KNOBS[k].default) for k in set(OptimizerConfig.model_fields) - CONFIG_ONLY
              if getattr(config, k) != KNOBS[k].default}
    assert differ == {}, "config default != the optimizer's: a config that wants other values states them"
    TrainingFreeGRPO(metric, **config.model_dump(exclude=CONFIG_ONLY))  # the config's values are valid knobs


FINGERPRINTED = ["num_generations", "temperature", "num_train_epochs", "batch_size", "seed",
                 "max_operations_per_group", "use_ground_truth", "learning_path", "max_experiences",
                 "max_words_per_experience", "max_library_tokens", "duplicate_overlap", "max_demos", "probe_size",
                 "max_probed_edits", "refit"]


def test_the_fingerprint_holds_the_knobs_that_change_what_a_run_computes():
    """The saved run.json's knobs: changing these names, their order or their defaults makes old run directories
    refuse to resume."""
    assert [k for k, f in KNOBS.items() if f.metadata["fingerprinted"]] == FINGERPRINTED
    assert list(fingerprinted_knobs(TrainingFreeGRPO(metric)).items()) == [
        ("num_generations", 5), ("temperature", 0.7), ("num_train_epochs", 3), ("batch_size", 50), ("seed", 0),
        ("max_operations_per_group", 2), ("use_ground_truth", True), ("learning_path", "auto"),
        ("max_experiences", None), ("max_words_per_experience", 32), ("max_library_tokens", None),
        ("duplicate_overlap", 0.7), ("max_demos", 0), ("probe_size", 0),
        ("max_probed_edits", 3), ("refit", "auto")]


def reference_section() -> tuple[list[str], str]:
    """configs/reference.toml's [optimizer] part: one line per key, in its order ("key = value", or "# key" for a
    key shown commented out), and its comment text."""
    text = (ROOT / "configs" / "reference.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[optimizer\]\n(.*?)(?=^\[)", text, flags=re.MULTILINE | re.DOTALL).group(1)
    values = tomllib.loads(section)
    lines = []
    for line in section.splitlines():
        if m := re.match(r"^(#\s*)?(\w+) = ", line):
            lines.append(f"# {m.group(2)}" if m.group(1) else f"{m.group(2)} = {values[m.group(2)]!r}")
    return lines, section


def test_the_reference_config_shows_every_knob_with_its_default():
    found, _ = reference_section()
    defaults = OptimizerConfig()
    expected = [f"# {k}" if getattr(defaults, k) is None else f"{k} = {getattr(defaults, k)!r}"
                for k in OptimizerConfig.model_fields]  # a knob whose default is None is shown commented out
    assert found == expected, differences("configs/reference.toml [optimizer]", expected, found)


def test_the_reference_config_names_the_fingerprinted_knobs():
    _, section = reference_section()
    comment = " ".join(line.lstrip("# ") for line in section.splitlines() if line.startswith("#"))
    listed = re.search(r"knobs that change what is computed \(([^)]*)\)", comment).group(1)
    found = [name.strip() for name in listed.split(",")]
    assert found == FINGERPRINTED, differences("configs/reference.toml's resume comment", FINGERPRINTED, found)


def test_the_docs_knob_table_is_the_declarations():
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- knobs[^>]*-->\n(.*?)<!-- /knobs -->", text, flags=re.DOTALL).group(1)
    assert found == knob_table(), differences("docs/usage.md's knob table", knob_table().splitlines(),
                                              found.splitlines()) + (
        "\nwrite it again with: python -c 'from tfgrpo.optimizers.knobs import knob_table; print(knob_table())'")
