"""The optimizer's knobs are defined once: the constructor and the config file check them by the same rules,
their defaults differ only where the config says why, and the fingerprint takes the knobs that shape a run.

A knob is written in four places (the constructor's signature, its docstring, `optimizers/knobs.KNOBS` and
`tfgrpo/config.OptimizerConfig`); these tests fail as soon as two of them disagree."""

import inspect
import re

import pytest
from pydantic import ValidationError

from tfgrpo.config import OptimizerConfig
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.knobs import KNOBS

CONFIG_ONLY = {"method", "num_direct_experiences"}  # the direct baseline's keys
CLI_DEFAULTS = {"num_generations", "num_train_epochs", "batch_size", "num_threads"}  # see the comment in config.py
NOT_IN_A_FILE = {"reflection_lm": "the [reflection] section", "log_dir": "run_dir/checkpoint",
                 "progress": "the CLI's own progress bars", "use_mlflow": "the [tracking] section"}  # knobs a TOML file cannot hold, and where the CLI gets them

BAD = [("num_generations", 0), ("num_generations", 2.5), ("temperature", -0.1), ("temperature", 3),
       ("num_train_epochs", -1), ("batch_size", 0), ("seed", "zero"), ("reflection_lm", "gpt-4o"),
       ("max_operations_per_group", 0), ("use_ground_truth", "yes"), ("max_experiences", 0),
       ("max_words_per_experience", 3), ("target_predictors", []), ("target_predictors", "predict"),
       ("num_threads", 0), ("max_failure_rate", 1.5), ("max_cost", 0), ("max_cost", -1.0),
       ("max_total_tokens", 0), ("log_dir", 3), ("progress", "bar"), ("learning_path", "fast"),
       ("constrained_decoding", "xml"), ("use_mlflow", "yes"), ("metric_timeout_s", 0), ("metric_timeout_s", "1")]


def metric(example, pred, trace=None):
    return 1.0


def test_the_constructor_takes_exactly_the_defined_knobs():
    params = inspect.signature(TrainingFreeGRPO.__init__).parameters
    assert [p for p in params if p not in ("self", "metric")] == list(KNOBS)
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in KNOBS)
    doc = TrainingFreeGRPO.__doc__.split("Args:", 1)[1]
    assert all(f"\n        {name}: " in doc for name in ["metric", *KNOBS]), "every knob is documented"


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_knob_is_refused_by_the_constructor_and_the_config_alike(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        TrainingFreeGRPO(metric, **{name: value})
    if name in OptimizerConfig.model_fields:
        with pytest.raises(ValidationError, match=name):
            OptimizerConfig(**{name: value})


def documented_defaults() -> dict[str, str]:
    """Each argument of the class docstring's Args section, and the default it states ("Default 5.")."""
    doc = TrainingFreeGRPO.__doc__.split("Args:", 1)[1]
    entries = re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", doc, flags=re.MULTILINE | re.DOTALL)
    return {name: m.group(1) if (m := re.search(r'Default ("[^"]*"|-?\d+(?:\.\d+)?|None|True|False)(?=[\s.:,(]|$)', text))
            else None for name, text in entries}


def test_the_docstring_states_each_knobs_default_as_the_signature_has_it():
    params = inspect.signature(TrainingFreeGRPO.__init__).parameters
    stated = documented_defaults()
    assert list(stated) == ["metric", *KNOBS], "the docstring documents the knobs, in the signature's order"
    written = {k: f'"{d}"' if isinstance(d, str) else repr(d) for k in KNOBS for d in [params[k].default]}
    assert {k: stated[k] for k in KNOBS} == written


def test_every_knob_a_file_can_hold_is_in_the_config_section():
    assert set(KNOBS) - set(OptimizerConfig.model_fields) == set(NOT_IN_A_FILE)
    assert set(OptimizerConfig.model_fields) - set(KNOBS) == CONFIG_ONLY


def test_config_defaults_are_the_optimizers_except_the_documented_ones():
    params = inspect.signature(TrainingFreeGRPO.__init__).parameters
    config = OptimizerConfig()
    differ = {k for k in set(OptimizerConfig.model_fields) - CONFIG_ONLY if getattr(config, k) != params[k].default}
    assert differ == CLI_DEFAULTS
    TrainingFreeGRPO(metric, **config.model_dump(exclude=CONFIG_ONLY))  # the config's values are valid knobs


def test_the_fingerprint_holds_the_knobs_that_change_what_a_run_computes():
    fingerprinted = {k for k, knob in KNOBS.items() if knob.fingerprinted}
    assert fingerprinted == {"num_generations", "temperature", "num_train_epochs", "batch_size", "seed",
                             "max_operations_per_group", "use_ground_truth", "max_experiences",
                             "max_words_per_experience", "learning_path", "max_demos", "max_excerpt_lines",
                             "excerpt_whole_attempt", "probe_size", "keep_tied_demos", "max_probed_edits"}
