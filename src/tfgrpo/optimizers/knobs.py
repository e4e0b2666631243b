"""The knobs of `TrainingFreeGRPO`, each declared once: its type, default, check, documentation, and whether the
run's fingerprint (run.json) holds it.

`Knobs` is a dataclass; `TrainingFreeGRPO` is one too, built on it, so `TrainingFreeGRPO(metric, num_generations=5)`
takes every knob as a keyword argument (an editor completes them) and checks it here. The config file's
`[optimizer]` section (`tfgrpo.config.OptimizerConfig`) is made from the same fields, the docstring's Args and the
knob table of docs/usage.md are written from their docs, and the knobs marked `fingerprinted` change what a run
computes: a resume must keep their values.
"""

from __future__ import annotations

import logging
import os
import re
import textwrap
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # (a knob's type, as the API page and help() show it; never imported here)
    import dspy

# runner.LearningPath, named in `learning_path`'s type as the docs show it (runner imports this module, not back)
LearningPath = Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    valid: Callable[[Any], bool]
    expected: str  # what a valid value is, for the error message


def integer(low: int | None = None) -> Check:
    return Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low),
                 "an integer" if low is None else f"an integer >= {low}")


def number(low: float, high: float) -> Check:
    return Check(lambda v: _is_number(v) and low <= v <= high, f"a number in [{low}, {high}]")


def positive(expected: str) -> Check:
    return Check(lambda v: _is_number(v) and v > 0, expected)


def one_of(*values: str) -> Check:
    return Check(lambda v: v in values, ", ".join(map(repr, values[:-1])) + f" or {values[-1]!r}")


def instance(kind: type | tuple[type, ...], expected: str) -> Check:
    return Check(lambda v: isinstance(v, kind), expected)


def lazy_instance(module: str, name: str, expected: str) -> Check:
    """An instance of `module.name`, imported when a value is checked (so that this module stays a leaf)."""
    def valid(v: Any) -> bool:
        import importlib

        return isinstance(v, getattr(importlib.import_module(module), name))
    return Check(valid, expected)


def optional(check: Check) -> Check:
    return Check(lambda v: v is None or check.valid(v), f"None or {check.expected}")


def _valid_prices(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(m, str) and isinstance(p, dict) and {"input", "output"} <= set(p)
                                       and set(p) <= {"input", "output", "cached_input"}
                                       and all(_is_number(x) and x >= 0 for x in p.values()) for m, p in v.items())


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN is no number here


FLAG = instance(bool, "True or False")
PATH_INSTANCE = lazy_instance("tfgrpo.optimizers.runner", "LearningPath", "a LearningPath instance")
PATHS = ("auto", "paper", "contrast")
PREDICTOR_NAMES = Check(lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(n, str) for n in v),
                        "a non-empty list of predictor names")


def knob(default: Any, check: Check, doc: str, *, fingerprinted: bool = False) -> Any:
    """A knob's field: its default, the check a value must pass, one paragraph of documentation, and whether the
    resume fingerprint holds it (True when it changes what a run computes)."""
    return field(default=default, metadata={"check": check, "doc": doc, "fingerprinted": fingerprinted})


# The presets of `auto`, each a budget and the settings measured best for it; a knob passed explicitly wins. "light" is
# the configuration confirmed on held-out puzzles for the embedded 1.5B (configs/local.toml): groups and batches of 4,
# up to 2 of the model's own winning attempts as demos, every edit probed on 8 other training queries, and the run
# ending where a probe could not tell edits apart or nothing is left to learn. "medium" and "heavy" are the same settings
# with larger budgets. "paper" is the paper's setting for capable models, its budget the paper's run (3 epochs of 100
# queries x 5 attempts). Each caps what a predictor's library may hold in tokens: the small-model presets at 512 (the 1.5B's
# context of 8,192 holds its demos and the task beside it), the paper's at an eighth of the model's context window.
# The figures behind each are in benchmarks/measurements.md.
SMALL_MODEL = dict(num_generations=4, batch_size=4, max_operations_per_group=1, max_demos=2, probe_size=8,
                   probe_min_power=0.4, stop_when_nothing_to_learn=True)
PRESETS = {
    "light": dict(SMALL_MODEL, num_train_epochs=1, max_metric_calls=150, max_library_tokens=512),
    "medium": dict(SMALL_MODEL, num_train_epochs=3, max_metric_calls=300, max_library_tokens=512),
    "heavy": dict(SMALL_MODEL, num_train_epochs=5, max_metric_calls=800, max_library_tokens=512),
    "paper": dict(num_generations=5, batch_size=50, num_train_epochs=3, max_operations_per_group=2, max_demos=0,
                  probe_size=0, stop_when_nothing_to_learn=False, max_metric_calls=2000, max_library_tokens="auto"),
}
MEASURED = {"light": "Qwen2.5-Coder-1.5B (Q4, llama.cpp)", "paper": "DeepSeek-V3.1 (by the paper)"}
SMALL_PRESET_B = 2  # auto="auto" takes "light" for reflection models of at most this size: the size it was measured at
SMALL_REFLECTOR_B = 8  # learning_path="auto" picks "contrast" for reflection LMs of at most this many billion parameters


@dataclass(kw_only=True, eq=False)
class Knobs:
    """Every knob of `TrainingFreeGRPO`, checked when set (a ValueError says what a valid value is)."""

    auto: str | None = knob("auto", optional(one_of("auto", "off", *PRESETS)), doc=(
        "A preset, as DSPy's MIPROv2 and GEPA take one: \"light\", \"medium\" or \"heavy\" (a budget of "
        "max_metric_calls and the settings measured best on a 1.5B model: groups of 4, batches of 4, up to 2 of "
        "its own winning attempts kept as demos, each edit probed on 8 other training queries), \"paper\" (the "
        "paper's settings and a budget of 2,000 metric calls, for capable models), \"auto\" (\"light\" when the "
        "reflection model's name gives at most 2B parameters, the size it was measured at, else \"paper\"; the choice "
        "and the budget are said as the run starts) or None (\"off\" in a config file: every knob as "
        "declared). A knob you pass yourself always wins over the preset."))

    # group rollouts
    num_generations: int = knob(5, integer(1), fingerprinted=True, doc=(
        "Attempts per query (G). A group is only learned from when its rewards differ; 1 turns the group "
        "comparison off (the paper's ablation)."))
    temperature: float = knob(0.7, number(0, 2), fingerprinted=True, doc=(
        "Sampling temperature of the attempts while learning, in [0, 2]."))
    # schedule
    num_train_epochs: int = knob(3, integer(0), fingerprinted=True, doc="Passes over the trainset.")
    batch_size: int = knob(50, integer(1), fingerprinted=True, doc="Queries per optimization step.")
    max_steps: int | None = knob(None, optional(integer(1)), doc=(  # more steps on a resume go on from the last
        "Stop after this many steps, part way through an epoch if need be (TRL's `max_steps`); the epoch it stops "
        "in is still validated. None: every batch of every epoch."))
    seed: int = knob(0, integer(), fingerprinted=True, doc=(
        "Seeds the order of the trainset and the attempts' rollout IDs."))
    # learning calls
    reflection_lm: dspy.BaseLM | None = knob(None, optional(lazy_instance("dspy", "BaseLM", "a dspy.BaseLM")), doc=(
        "LM of the learning calls (summaries, group advantages, consolidation). None: `dspy.settings.lm`, else the "
        "student's LM. A stronger model than the student learns better."))
    max_operations_per_group: int = knob(2, integer(1), fingerprinted=True, doc=(
        "Most library edits one group may propose."))
    use_ground_truth: bool = knob(True, FLAG, fingerprinted=True, doc=(
        "False scores each attempt against the majority answer of its group and shows the learning calls no "
        "answer key."))
    learning_path: str | LearningPath = knob(
        "auto", Check(lambda v: (isinstance(v, str) and v in PATHS) or PATH_INSTANCE.valid(v),
                      "'auto', 'paper', 'contrast' or a LearningPath instance"), fingerprinted=True, doc=(
            "\"paper\" (summaries, group advantages, one consolidation call), \"contrast\" (one short call per "
            "best-vs-worst pair of a group, typed from the live library, folded in code; made for small reflection "
            "LMs) or \"auto\": contrast when the reflection model's name gives at most 8B parameters, the paper's "
            "path when it gives more or no size at all (the choice is logged). Set it yourself when the name does "
            "not tell: \"paper\" for a capable API model, \"contrast\" for a small local one. A `LearningPath` "
            "instance plugs in a path of your own."))
    constrained_decoding: str = knob("auto", one_of("auto", "json_object", "json_schema", "off"), doc=(
        "For the contrast path: \"json_object\" (llama.cpp servers' JSON-schema form), \"json_schema\" (OpenAI, "
        "vLLM, SGLang, Ollama), \"off\" (parse and validate only) or \"auto\" (json_schema where LiteLLM says the "
        "model supports it, else off)."))
    # the library
    max_experiences: int | None = knob(None, optional(integer(1)), fingerprinted=True, doc=(
        "Cap on the library's size; None for no cap."))
    max_words_per_experience: int = knob(32, integer(4), fingerprinted=True, doc=(
        "Experiences longer than this are refused (at least 4)."))
    max_library_tokens: int | str | None = knob(None, Check(
        lambda v: v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 16),
        "None, \"auto\" or an integer >= 16"), fingerprinted=True, doc=(
        "The most tokens of experiences each predictor carries in its instructions, counted with the policy model's "
        "own tokenizer where it is known (the embedded model's, from its server; an OpenAI model's, by LiteLLM), else "
        "estimated (plan() says which). After each step, what passes it retires, the experience left unedited longest "
        "first, each retirement in the step's record (`details[\"retired\"]`); the paper's consolidation is asked to "
        "merge or delete first where the step's proposals would pass it. \"auto\": an eighth of the policy model's context window where it is known, else no cap. plan() "
        "refuses a budget with which the longest prompt would not fit the context window. None: no cap."))
    duplicate_overlap: float | None = knob(0.7, optional(number(0, 1)), fingerprinted=True, doc=(
        "A new experience whose content words overlap an existing one's by this share or more (Jaccard) says the "
        "same: it is folded into the existing one, its sources and predictors joining the existing one's, instead of "
        "added; "
        "counted under the step's `details[\"folded\"]`. None: only an exact duplicate is refused."))
    target_predictors: list[str] | None = knob(None, optional(PREDICTOR_NAMES), doc=(
        "Names of the predictors that get the library; None for all."))
    max_demos: int = knob(0, integer(0), fingerprinted=True, doc=(
        "Winning attempts kept as few-shot demos of the target predictors: after each step, a query's best attempt "
        "that fully succeeded (reward >= 1) while its groupmates did worse, ranked by group advantage, one per query "
        "(see src/tfgrpo/optimizers/judge.py). An extension of the paper for small policy models, which copy a working example "
        "far better than they follow advice. 0: off."))
    probe_size: int = knob(0, integer(0), fingerprinted=True, doc=(
        "Each step's candidate edits (library operations, demos) are tried on this many training queries outside "
        "the step's batch, one attempt each, against the current program on the same queries, ranked by full "
        "successes first and mean reward second: an operation is kept only if it ranks no lower; a demo, or an "
        "experience carrying an excerpt, only if it adds full successes; of the winning demos the best one's set "
        "is kept, and of the winning experiences with an excerpt the best one (src/tfgrpo/optimizers/judge.py). Needs "
        "use_ground_truth. 0: off, every valid operation is applied, as in the paper."))
    max_probed_edits: int = knob(3, integer(1), fingerprinted=True, doc=(
        "Most candidate edits probed per step (half of them demos, when max_demos > 0); edits beyond it are "
        "dropped."))
    probe_min_power: float = knob(0.0, number(0, 1), doc=(  # how far to go, like a budget: a resume may change it
        "With probe_size, probe only where the probe can tell edits apart: at the step's solve rate (its attempts "
        "that fully succeeded), the chance that a candidate halving the program's failures solves more of the "
        "probe_size queries than the program, less the chance that a useless one does, must reach this. Below it "
        "(a task the model already half solves: at 60% a probe of 8 has 0.33) the probe is skipped, no edit is kept "
        "unprobed, the free demo slots take full successes (those of groups with contrast first, as BootstrapFewShot "
        "takes solved traces) and the run stops: more calls cannot pay. The step's learning calls wait for its "
        "solve rate: none is made where the probe is skipped. With num_generations of 4 or more a step looks first "
        "at half of each group's attempts, and makes the rest only where that solve rate leaves the probe power. "
        "0: always probe."))
    stop_when_nothing_to_learn: bool = knob(False, FLAG, doc=(
        "End the run after a step in which no group had contrast (dynamic sampling included) or whose program "
        "solved every probe query: nothing is left to learn from these training queries; said in the log and in "
        "`stopped_early`."))
    # what each learned item is worth (worth.py)
    refit: bool | str = knob("auto", one_of("auto", True, False), fingerprinted=True, doc=(
        "Before the steps, measure what each experience and demo the student carries is worth on this run's model, as "
        "`attribution` does, on held-out queries (the valset, or compile's `attribution_set`), and leave out those "
        "that do not help, as `prune` does (chosen on half of the queries, checked on the other); the steps then go "
        "on from what is left (`num_train_epochs=0`: the refit alone). In `detailed_results.refit`, each item with "
        "where it was learned and its worth there when the saved program recorded them. \"auto\": when the student "
        "carries items that its saved provenance says were learned with another policy model; True: whenever it "
        "carries any; False: never."))
    attribution: bool = knob(False, FLAG, doc=(
        "After the compile, measure what each kept experience and demo is worth on held-out queries (the valset, or "
        "compile's `attribution_set`): the compiled program against it with each item left out, paired per query "
        "with a 95% CI, and two controls: nothing learned, and an irrelevant text of the same length in place of "
        "what was learned. In `detailed_results.worth`, worth.json of log_dir, `tfgrpo report` and MLflow. Costs "
        "(items + 3) program runs per query (the dry run counts them)."))
    attribution_max_items: int = knob(8, integer(1), doc=(
        "With attribution: up to this many items, leave-one-out; above it, Shapley values estimated by sampling "
        "attribution_permutations orders of the items."))
    attribution_permutations: int = knob(8, integer(1), doc=(
        "With attribution over more than attribution_max_items items: random orders sampled for the Shapley values "
        "(each costs up to one program run per item and query)."))
    prune: bool = knob(False, FLAG, doc=(
        "With attribution: drop items one at a time, the least worth first, while an item is worth <= 0 and the "
        "program without it (and without those dropped before it) scores no lower, measured on half of the "
        "attribution queries; the pruned program is kept only if it scores at least as well as the unpruned one on "
        "the other half, which chose nothing. What was dropped is in `detailed_results.worth.pruned`."))
    # execution
    num_threads: int = knob(8, integer(1), doc=(
        "Concurrent LM calls of a step (all stages share them); with backend=\"async\", the attempts in flight."))
    backend: str = knob("threads", one_of("threads", "async", "ray"), doc=(
        "Where the program's attempts run (rollouts, probe, validation, attribution): \"threads\", on num_threads "
        "threads of this process; \"async\", as coroutines on one event loop of this process, num_threads of them "
        "in flight, each through the program's `acall` and DSPy's async path to the LM (a program with only "
        "`forward` runs on a thread, and so do the learning calls and the metric, up to num_threads of them), for "
        "hundreds of calls waiting on a provider; \"ray\", each attempt (the program run) as a task on a Ray cluster (`pip install -e \".[ray]\"`; the cluster named by "
        "RAY_ADDRESS, or the one `ray.init()` finds or starts), for programs whose own work (tools, sandboxed code, "
        "page fetching) outgrows one machine, num_threads of them in flight. The budget, the record of the calls, the "
        "failure rule, the metric (on what the program returned) and the learning calls stay in this process. See "
        "docs/long-runs.md and docs/ray.md."))
    max_failure_rate: float = knob(0.5, number(0, 1), doc=(
        "When more than this share of a step's attempts, summaries or group advantages, or of an epoch's "
        "validation runs, fail, the run stops with `TooManyFailuresError` and the step is not done; a resume "
        "makes the failed ones again (what was answered comes back from the record). A failure is an LM call that failed, a program or tool that raised, a metric "
        "call that timed out or raised; a reply that came back but did not parse is the program's own 0, not a failure."))
    metric_timeout_s: float | None = knob(None, optional(positive("a number of seconds > 0")), doc=(
        "Seconds one metric call may take: a call still running then (a judge LM that hangs, a sandbox that never "
        "returns) is abandoned and scores 0, counted as a failure: said in a warning, under "
        "`details[\"metric_timeouts\"]` of the step, in `val_failures` of a validation; more than "
        "`max_failure_rate` of a step's attempts timing out stops the run, as an outage does. None waits for ever. "
        "Ctrl-C stops a run at once either way."))
    max_cost: float | None = knob(None, optional(positive("a number > 0 (USD)")), doc=(
        "USD for every LM call of the run (rollouts, the metric's own calls, learning calls, probes, validation, "
        "attribution), priced from "
        "tokens by LiteLLM's price map or `prices`. What the run has spent is the sum of its record of calls, over "
        "any number of resumes; every call is charged before it is sent: when the next one would not fit beside "
        "those in flight, the run stops there, keeps the library so far and says so (`stopped_early`); a resume "
        "with a larger budget goes on, its answered calls free. A step the budget left cannot pay for (its rollouts "
        "and a probe of the program and one edit, at what an attempt has cost so far) is not started, on a resume "
        "too. Refused when no price is known for the policy or reflection model."))
    max_total_tokens: int | None = knob(None, optional(integer(1)), doc=(
        "Prompt plus completion tokens of all calls, charged before each call as `max_cost` is."))
    max_metric_calls: int | None = knob(None, optional(integer(1)), doc=(
        "Attempts scored by the metric, GEPA's budget: rollouts, probe attempts, validation and attribution runs, "
        "charged before each attempt starts (an attempt whose LM call failed is not scored and does not count; a "
        "resume's scoring of the attempts it makes again counts once); a step the calls left cannot pay for is not "
        "started, as with `max_cost`."))
    prices: dict | None = knob(None, optional(Check(_valid_prices, "a dict of model -> {\"input\": USD, \"output\": "
                                                                 "USD[, \"cached_input\": USD]} per million tokens")),
                               doc=(
        "Prices per million tokens by model string, for a model LiteLLM's price map does not know (a self-hosted "
        "one) or to override it: {\"openai/my-model\": {\"input\": 0.2, \"output\": 0.6, \"cached_input\": 0.05}}. "
        "Dollars in the plan, the budget and the results are tokens times these prices."))
    log_dir: str | os.PathLike | None = knob(None, optional(instance((str, os.PathLike), "a folder path")), doc=(
        "Folder of the run's record: every LM call's reply, with its usage and price, kept as it returns, and every "
        "finished step; None keeps nothing. The same compile on it resumes: a finished step is reused, an unfinished "
        "one runs again (the program's Python, its tools and the metric run again) and every request it asked "
        "before is answered from the record, never sent twice. A resume must use "
        "the same fingerprinted knobs, data, program, target predictors and LM models (the refusal names what "
        "differs); num_threads, max_failure_rate, the budgets and progress may change. One compile at a time: the "
        "folder is locked while a compile runs, and a second one is refused with a `RunLockedError` naming the "
        "holder (a lock of a process that died is taken over)."))
    resume_other_versions: bool = knob(False, FLAG, doc=(
        "Resume a log_dir whose work was made under other versions of tfgrpo, DSPy, LiteLLM or the adapter "
        "(run.json records them). Refused by default, naming both: their prompts may differ from today's, and the "
        "finished steps would sit beside new ones made with another prompt. True goes on and says so: the recorded "
        "replies answer the requests that are the same, the others are sent."))
    ray_other_versions: bool = knob(False, FLAG, doc=(
        "With backend=\"ray\", run on nodes whose tfgrpo, DSPy or Python version differs from this process's. Refused "
        "by default before any task runs, naming each such node and its versions: the attempts would be made by "
        "other prompts and adapters than the learning calls assume. True runs there and says so."))
    progress: Callable[[str, int, int], None] | None = knob(
        None, optional(Check(callable, "a callable progress(stage, done, total)")), doc=(
            "`progress(stage, done, total)`, called as units finish, for UIs; stage \"step\" is the whole run (steps "
            "done of all, the steps a resume reuses counted in its first call), the others restart with each step. "
            "None: a tqdm bar for the run and one per stage of each step on stderr, as DSPy's own optimizers draw, "
            "when stderr is a terminal (pass `lambda *_: None` for silence)."))
    use_mlflow: bool = knob(False, FLAG, doc=(
        "Log the compile to MLflow (`tfgrpo.tracking`): per step metrics, validation scores, knobs, the library "
        "and program; into the active MLflow run, else one it starts (or resumes from log_dir). It logs into an "
        "active run (e.g. `mlflow.dspy.autolog(log_compiles=True)`'s) even when off."))

    def __post_init__(self):
        for name in KNOBS:
            check_knob(name, getattr(self, name))
        if self.prune and not self.attribution:
            raise ValueError("prune drops items by their measured worth: it needs attribution=True")

    def total_steps(self, trainset_size: int) -> int:
        """How many steps a run over `trainset_size` training queries makes: every epoch's batches, cut at
        `max_steps`."""
        steps = self.num_train_epochs * -(-trainset_size // self.batch_size)
        return min(steps, self.max_steps or steps)


KNOBS = {f.name: f for f in fields(Knobs)}  # name -> dataclasses.Field, in the declaration's order


def check_knob(name: str, value: Any) -> Any:
    """`value` if it is valid for the knob `name`, else a ValueError that says what is expected."""
    check = KNOBS[name].metadata["check"]
    if not check.valid(value):
        raise ValueError(f"{name} must be {check.expected}, not {value!r}")
    return value


def model_size_b(model: str) -> float:
    """Parameter count in billions read from a model name ("qwen2.5-coder-1.5b" -> 1.5); inf if none is given."""
    sizes = [float(x) for x in re.findall(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", model.lower())]
    return max(sizes) if sizes else float("inf")


def resolve(knobs: Knobs, explicit: set[str], reflection_model: str, *, say: bool = False) -> tuple[Knobs, str | None,
                                                                                                   str]:
    """What a run with a reflection LM of this name uses: the knobs with the `auto` preset's values for every knob not
    in `explicit`, the preset's name (None: off), and the learning path's name ("contrast" or "paper" for "auto", by
    the model's size; a path instance's class name). `say`: log the choice at WARNING level, with its budget."""
    preset, size = (None if knobs.auto == "off" else knobs.auto), model_size_b(reflection_model)
    if preset == "auto":
        preset = "light" if size <= SMALL_PRESET_B else "paper"
    explicit = set(explicit) | ({"probe_size"} if not knobs.use_ground_truth else set())  # a probe needs the truth
    values = {name: getattr(knobs, name) for name in KNOBS}
    values.update({k: v for k, v in PRESETS.get(preset, {}).items() if k not in explicit})
    resolved, path = Knobs(**values), knobs.learning_path
    name = path if isinstance(path, str) and path != "auto" else type(path).__name__ if not isinstance(path, str) \
        else "contrast" if size <= SMALL_REFLECTOR_B else "paper"
    if say:
        changed = {k: v for k, v in PRESETS.get(preset, {}).items() if k not in explicit}
        _say(knobs, preset, name, reflection_model, changed)
    return resolved, preset, name


def _say(knobs: Knobs, preset: str | None, path: str, model: str, changed: dict) -> None:
    """Log the preset `auto` took (at WARNING level, so that a Python user sees it) and the learning path and why."""
    size = model_size_b(model)
    if knobs.learning_path == "auto":
        why = f"its name gives {size:g}B parameters" if size != float("inf") else \
            "its name gives no parameter count, so it is taken as a large model"
        logger.info("learning_path='auto' picked %r for the reflection model %r: %s (contrast up to %gB). Set "
                    "learning_path='paper' or 'contrast' to choose.", path, model, why, SMALL_REFLECTOR_B)
    else:
        logger.info("Learning path %r (set by learning_path)", path)
    if preset is None:
        return
    unmeasured = "" if preset != "paper" or size == float("inf") or size > 30 else (
        f"; no preset was measured on a model of {size:g}B ({', '.join(f'{k}: {v}' for k, v in MEASURED.items())}): "
        "pass auto=\"light\" for a small local model, or set the knobs yourself")
    logger.warning("auto=%r: preset %r for the reflection model %r (%s)%s; auto=None uses the knobs as declared",
                   knobs.auto, preset, model,
                   ", ".join(f"{k}={v}" for k, v in changed.items()) or "every knob passed explicitly", unmeasured)


def fingerprinted_knobs(knobs: Knobs) -> dict[str, Any]:
    return {name: getattr(knobs, name) for name, f in KNOBS.items() if f.metadata["fingerprinted"]}


def default_text(name: str) -> str:
    """A knob's default as Python writes it, with strings in double quotes ("auto")."""
    default = KNOBS[name].default
    return f'"{default}"' if isinstance(default, str) else repr(default)


def args_doc() -> str:
    """The knobs as the Args entries of a Google-style docstring, each with its type and ending with its default."""
    entries = [f"{name} ({f.type}): {f.metadata['doc']} Default {default_text(name)}." for name, f in KNOBS.items()]
    return "".join(textwrap.fill(e, 116, initial_indent=" " * 8, subsequent_indent=" " * 12) + "\n" for e in entries)


def knob_table() -> str:
    """The knobs as a Markdown list, one entry each: its name, type and default, whether a resume must keep it, what
    it does (docs/usage.md holds it between its `knobs` markers; a list reads on a phone where a table of long cells
    does not)."""
    rows = [f"- **`{name}`** (`{f.type}`) = `{default_text(name)}`"
            f"{' (a resume keeps it)' if f.metadata['fingerprinted'] else ''}: "
            f"{f.metadata['doc']}" for name, f in KNOBS.items()]
    return "\n" + "\n".join(rows) + "\n\n"

