"""`auto=` presets, as DSPy's MIPROv2 and GEPA take them: a budget and settings chosen for the user, the choice said as
the run starts, and a knob the user passes always wins."""

import inspect
import logging

import dspy

from scripted_lm import ScriptedLM
from test_optimizer import compile_with, learner
from tfgrpo.config import Config
from tfgrpo.optimizers import TrainingFreeGRPO
from tfgrpo.optimizers.knobs import PRESETS


def resolved(optimizer, model):
    """The knobs a run with a reflection model of this name uses (the `auto` preset's values in place)."""
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[0]


def path_for(optimizer, model):
    from tfgrpo.optimizers.knobs import resolve

    return resolve(optimizer, optimizer.explicit_knobs(), model)[2]


def metric(example, pred, trace=None):
    return 1.0


def test_auto_is_a_parameter_and_picks_the_small_model_preset_by_the_reflection_models_size():
    assert "auto" in inspect.signature(TrainingFreeGRPO).parameters
    opt = TrainingFreeGRPO(metric)
    small, large = resolved(opt, "openai/qwen2.5-coder-1.5b"), resolved(opt, "deepseek/deepseek-chat")
    assert {k: getattr(small, k) for k in PRESETS["light"]} == PRESETS["light"]
    assert {k: getattr(large, k) for k in PRESETS["paper"]} == PRESETS["paper"]
    assert opt.max_demos == 0  # the optimizer itself keeps the declared values; a run reads the resolved ones


def test_a_knob_passed_explicitly_wins_over_the_preset_and_none_turns_presets_off():
    opt = TrainingFreeGRPO(metric, auto="medium", probe_size=4, num_generations=8)
    knobs = resolved(opt, "anything")
    assert knobs.probe_size == 4 and knobs.num_generations == 8 and knobs.max_metric_calls == 300
    off = resolved(TrainingFreeGRPO(metric, auto=None), "qwen2.5-coder-1.5b")
    assert off.max_demos == 0 and off.num_generations == 5  # as declared
    # without ground truth no probe runs, so a preset does not ask for one
    assert resolved(TrainingFreeGRPO(metric, auto="light", use_ground_truth=False), "x").probe_size == 0


def test_a_config_file_sets_only_what_it_names(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[optimizer]\nauto = "light"\nbatch_size = 6\n')
    knobs = Config.load(path).optimizer_knobs()
    assert {k: v for k, v in knobs.items() if k != "constrained_decoding"} == {"auto": "light", "batch_size": 6}
    knobs_used = resolved(TrainingFreeGRPO(metric, **knobs), "m")
    assert knobs_used.batch_size == 6 and knobs_used.max_demos == 2
    path.write_text('[optimizer]\nauto = "off"\n')
    assert resolved(TrainingFreeGRPO(metric, **Config.load(path).optimizer_knobs()), "qwen-1.5b").max_demos == 0


def test_the_run_uses_the_preset_and_says_which(caplog):
    lm = ScriptedLM(learner())
    lm.model = "openai/qwen2.5-coder-1.5b"  # a small model by its name: auto takes "light"
    with caplog.at_level(logging.INFO, logger="tfgrpo"):
        compiled = compile_with(lm, dspy.Predict("question -> answer"), learning_path="paper", num_threads=2)
    steps = compiled.detailed_results.steps
    assert "auto='auto': preset 'light'" in caplog.text
    assert len(steps) == 1 and steps[0].groups == 4 and "probe" in steps[0].usage  # batch 4 of 4 queries, probed


def test_the_default_construction_on_the_embedded_model_is_the_main_arm():
    """configs/local.toml's arm of benchmarks/peers.py (tfgrpo-probed-wide+demos with its shared knobs) and the
    default construction (tfgrpo-default) make the same run for the embedded 1.5B until the default's stops (issue 66:
    probe_min_power, stop_when_nothing_to_learn, which change how far a run goes, not what a step computes): every knob
    that changes what a run computes is equal, and the preset's budget (max_metric_calls, which the arm measured before
    presets existed did not have, and which is charged before each attempt) never stops a run of three steps of 4 x 4
    attempts and their probes."""
    from benchmarks.peers import TFGRPO_ARMS
    from tfgrpo.optimizers.knobs import fingerprinted_knobs

    shared = dict(num_generations=4, num_train_epochs=1, batch_size=4, seed=0, learning_path="contrast",
                  constrained_decoding="json_object", max_operations_per_group=1, num_threads=2)
    arm = resolved(TrainingFreeGRPO(metric, **shared, **TFGRPO_ARMS["tfgrpo-probed-wide+demos"]), "qwen2.5-coder-1.5b")
    default = TrainingFreeGRPO(metric, seed=0, num_threads=2, constrained_decoding="json_object")
    default_used = resolved(default, "qwen2.5-coder-1.5b")
    a, b = fingerprinted_knobs(arm), fingerprinted_knobs(default_used)
    assert {k: (a[k], b[k]) for k in a if k != "learning_path" and a[k] != b[k]} == {}
    three_steps = 3 * (4 * 4 + (1 + default_used.max_probed_edits) * 8)  # rollouts and probe attempts, at most
    assert three_steps <= default_used.max_metric_calls == arm.max_metric_calls  # the budget cuts none of the 3 steps
    assert path_for(default, "openai/qwen2.5-coder-1.5b") == "contrast"
    local = Config.load("configs/local.toml")
    from_config = resolved(TrainingFreeGRPO(metric, **local.optimizer_knobs()), local.policy.model)
    assert {k: getattr(from_config, k) for k in PRESETS["light"]} == PRESETS["light"]
