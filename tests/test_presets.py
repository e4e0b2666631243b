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


def metric(example, pred, trace=None):
    return 1.0


def test_auto_is_a_parameter_and_picks_the_small_model_preset_by_the_reflection_models_size():
    assert "auto" in inspect.signature(TrainingFreeGRPO).parameters
    opt = TrainingFreeGRPO(metric)
    small, large = opt.resolved("openai/qwen2.5-coder-1.5b"), opt.resolved("deepseek/deepseek-chat")
    assert {k: getattr(small, k) for k in PRESETS["light"]} == PRESETS["light"]
    assert {k: getattr(large, k) for k in PRESETS["paper"]} == PRESETS["paper"]
    assert opt.max_demos == 0  # the optimizer itself keeps the declared values; a run reads the resolved ones


def test_a_knob_passed_explicitly_wins_over_the_preset_and_none_turns_presets_off():
    opt = TrainingFreeGRPO(metric, auto="medium", probe_size=4, num_generations=8)
    knobs = opt.resolved("anything")
    assert knobs.probe_size == 4 and knobs.num_generations == 8 and knobs.max_metric_calls == 300
    assert knobs.num_explore_generations == 0  # exploring attempts are the preset's only while it sets G
    off = TrainingFreeGRPO(metric, auto=None).resolved("qwen2.5-coder-1.5b")
    assert off.max_demos == 0 and off.num_generations == 5  # as declared
    # without ground truth no probe runs, so a preset does not ask for one
    assert TrainingFreeGRPO(metric, auto="light", use_ground_truth=False).resolved("x").probe_size == 0


def test_a_config_file_sets_only_what_it_names(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[optimizer]\nauto = "light"\nbatch_size = 6\n')
    knobs = Config.load(path).optimizer_knobs()
    assert {k: v for k, v in knobs.items() if k != "constrained_decoding"} == {"auto": "light", "batch_size": 6}
    resolved = TrainingFreeGRPO(metric, **knobs).resolved("m")
    assert resolved.batch_size == 6 and resolved.max_demos == 2
    path.write_text('[optimizer]\nauto = "off"\n')
    assert TrainingFreeGRPO(metric, **Config.load(path).optimizer_knobs()).resolved("qwen-1.5b").max_demos == 0


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
    default construction (tfgrpo-default) make the same run for the embedded 1.5B: every knob that changes what a run
    computes is equal, and the preset's budget (max_metric_calls, which the arm measured before presets existed did not
    have) never stops a run of three steps of 4 x 4 attempts and their probes before its last step."""
    from benchmarks.peers import TFGRPO_ARMS
    from tfgrpo.optimizers.knobs import fingerprinted_knobs

    shared = dict(num_generations=4, num_train_epochs=1, batch_size=4, seed=0, learning_path="contrast",
                  constrained_decoding="json_object", max_operations_per_group=1, num_threads=2)
    arm = TrainingFreeGRPO(metric, **shared, **TFGRPO_ARMS["tfgrpo-probed-wide+demos"]).resolved("qwen2.5-coder-1.5b")
    default = TrainingFreeGRPO(metric, seed=0, num_threads=2, constrained_decoding="json_object")
    resolved = default.resolved("qwen2.5-coder-1.5b")
    a, b = fingerprinted_knobs(arm), fingerprinted_knobs(resolved)
    assert {k: (a[k], b[k]) for k in a if k != "learning_path" and a[k] != b[k]} == {}
    two_steps = 2 * (4 * 4 + (1 + resolved.max_probed_edits) * 8)  # rollouts and probe attempts, at most
    assert two_steps < resolved.max_metric_calls == arm.max_metric_calls  # the budget never cuts the third step
    assert default.resolve_learning_path("openai/qwen2.5-coder-1.5b") == "contrast"
    local = Config.load("configs/local.toml")
    from_config = TrainingFreeGRPO(metric, **local.optimizer_knobs()).resolved(local.policy.model)
    assert {k: getattr(from_config, k) for k in PRESETS["light"]} == PRESETS["light"]
