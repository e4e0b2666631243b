"""What a compile will do, checked and priced before anything is spent: `TrainingFreeGRPO.plan(...)`.

`compile` makes its plan first, and the CLI's dry run prints the same object: every check compile makes (the program,
the examples, the LMs, a budget that can be measured, a `log_dir` that holds another run), the preset and learning path
chosen, the budget, and what the run is expected to send, in calls, tokens and dollars. Nothing is written, and nothing
called unless a pilot is asked for.

The estimate covers the steps the budgets let the run start (`reachable_steps`: each budget checked as the run checks
it before a step), and assumes that every group has reward contrast (so every learning call is made: an upper bound
for them) and that no reply fails; prompts are the program's own, rendered by DSPy's chat adapter for the training
queries, with a library that grows by `GROWTH` experiences a step (the paper's reference re-run: 27 in 6 steps), and a
tool loop (ReAct) that answers halfway through its `max_iters` turns (a guess, not a measurement); replies are counted
at `reply_tokens` (default: by the program's output fields, `FIELD_REPLY`, for the program; `LEARNING_REPLY` for a
learning call). A pilot (`plan(..., pilot=N)`) runs the student on N training queries first and takes a reply's tokens,
and the prompts' as the provider counted them, from those calls: the one way a plan makes LM calls.
`cost_unlearned` is the same run with a library that stays as it starts.
Dollars are those tokens at the models' prices; where the price map gives a cheaper price for cached prompt tokens
(DeepSeek, OpenAI), the part of each prompt that a stage's calls share (instructions, library, demos: they come first)
is priced as cached after the stage's first call of a step, as those providers bill a repeated prefix.
"""

from __future__ import annotations

import inspect
import logging
import statistics
from dataclasses import dataclass, field
from typing import Callable

import dspy
from dspy.adapters.chat_adapter import ChatAdapter

from tfgrpo.base.util import digest
from tfgrpo.optimizers.checkpoint import Checkpoint, code_fingerprint, prompt_versions
from tfgrpo.optimizers.spend import context_window, metered, model_price, token_counter
from tfgrpo.optimizers.workers import fixed_temperature, run_program
from tfgrpo.optimizers.judge import carried_demos
from tfgrpo.optimizers.record import LIMITS, role
from tfgrpo.optimizers.knobs import Knobs, fingerprinted_knobs, resolve
from tfgrpo.optimizers.records import Demo
from tfgrpo.optimizers.rewards import score_attempt
from tfgrpo.programs.inject import NO_PREDICTORS, PROVENANCE_KEY, predictor_roles, resolve_targets, starting_library
from tfgrpo.programs.learning import AdvantageExtractor, Consolidator, Summarizer
from tfgrpo.programs.library import ExperienceLibrary

logger = logging.getLogger(__name__)

EXAMPLE_HINT = "dspy.Example(question=..., answer=...).with_inputs('question')"
CHARS_PER_TOKEN = 4
GROWTH = 5  # experiences a step adds to the library, on average (the paper's reference re-run: 27 in 6 steps)
EXPERIENCE_TOKENS = 40  # one experience in a prompt: its ID and about 25 words
# tokens of a learning call's reply, when `reply_tokens` does not say: the embedded 1.5B's contrast replies averaged 67
# (the main job's 9 contrast calls); the simulator's summaries and advantages take 32-54
LEARNING_REPLY = 70


@dataclass(frozen=True)
class Plan:
    """A compile before it starts (`TrainingFreeGRPO.plan`).

    Attributes:
        knobs: The knobs the run uses: yours, with the `auto` preset's values for those you did not pass.
        preset: The preset `auto` took (None: off).
        learning_path: "paper", "contrast" or your path's class name.
        models: The policy models (by predictor) and the reflection model.
        steps: Optimization steps the run is scheduled to make (every batch of every epoch, cut at `max_steps`);
            `expected["total"]["steps"]`: those its budgets let it start.
        turns: LM calls one attempt of the program makes (a ReAct loop: its `max_iters` and the extract).
        expected: Expected calls, prompt and completion tokens and dollars (None: no price known): `per_step` by stage,
            and the whole run's `total` (steps, validation, attribution) with its `metric_calls`.
        bound: The same, as upper bounds (every call sent twice, every rewrite made, replies at the `max_tokens` cap).
        budget: `max_cost`, `max_total_tokens` and `max_metric_calls` as the run uses them (None: no limit).
        resume: What `log_dir` holds of the run a compile goes on from: its finished `steps` (reused whole) and the LM
            `calls` its record holds (a request asked again is answered from it); 0 and 0 for a new run.
        notes: What the checks found worth a word (duplicates, a valset that overlaps the trainset, ...).
        library_tokens: `max_library_tokens` resolved: the tokens of experiences a predictor may carry (None: no cap).
    """

    knobs: Knobs
    preset: str | None
    learning_path: str
    models: dict
    steps: int
    turns: int
    expected: dict
    bound: dict
    budget: dict
    resume: dict
    notes: list[str] = field(default_factory=list)
    fingerprint: dict = field(default_factory=dict, repr=False)  # what a resume of the run must match
    targets: list[str] = field(default_factory=list, repr=False)
    library: ExperienceLibrary | None = field(default=None, repr=False)  # the starting library
    demos: list[Demo] = field(default_factory=list, repr=False)  # the demos the student carries (with max_demos)
    refit: bool = False  # the carried items are measured on this run's model before the steps (`refit`)
    carried: dict = field(default_factory=dict, repr=False)  # the student's saved provenance: where it learned
    library_tokens: int | None = None
    count_tokens: Callable[[str], int] | None = field(default=None, repr=False)  # how `library_tokens` are counted
    roles: dict[str, str] = field(default_factory=dict, repr=False)  # several targets: what each does (`Run.roles`)

    def summary(self) -> str:
        """The plan in a few lines, as the run starts and the dry run print it."""
        total, b = self.expected["total"], self.budget
        cost = "no price known" if total.get("cost") is None else f"${total['cost']:.4f}" + (
            f" (${total['cost_unlearned']:.4f} if the library stays as it starts)"
            if total.get("cost_unlearned") is not None else "")
        limits = ", ".join(f"{k}={v:g}" for k, v in b.items() if v is not None) or "none"
        reachable, reads = total.get("steps", self.steps), total.get("examples_read", {})
        cut = f" (of {self.steps} scheduled: the budget stops the run there)" if reachable < self.steps else ""
        lines = [f"plan: preset {self.preset!r}, {self.learning_path} path, {reachable} step(s){cut} of "
                 f"{self.knobs.batch_size} queries x {self.knobs.num_generations} attempts; reflection model "
                 f"{self.models['reflection']!r}",
                 "reads: " + (", ".join(f"{n:,} {name} example(s)" for name, n in reads.items() if n) or "nothing") +
                 f"; a reply counted at {total.get('reply', '?')}",
                 f"expected: {total['calls']:,} calls, {total['prompt_tokens']:,} prompt + "
                 f"{total['completion_tokens']:,} completion tokens ({total['cached_tokens']:,} prompt tokens cached), "
                 f"{cost}, {total['metric_calls']:,} metric calls (every group with contrast, every step run)",
                 f"budget: {limits}" + ("; the run may stop sooner where more calls cannot pay (probe_min_power, "
                                        "stop_when_nothing_to_learn)" if self.knobs.probe_min_power or
                                        self.knobs.stop_when_nothing_to_learn else "")]
        if total.get("budget_note") and not (self.resume.get("steps") or self.resume.get("calls")):
            lines.append(total["budget_note"])
        if self.knobs.backend == "ray":
            lines.append("backend: ray: each attempt a task on the Ray cluster (RAY_ADDRESS, or the one ray.init() "
                         "finds); the budget, the record and the learning calls here")
        if self.resume.get("steps") or self.resume.get("calls"):
            lines.append(f"resume: {self.resume['steps']} finished step(s) in log_dir reused whole, "
                         f"{self.resume['calls']} recorded LM call(s) answer the same requests again")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def projection(self, steps: list) -> str:
        """After a step, for the progress log: what the run's steps (`StepResult`s) spent so far, the total of the steps
        the plan expects the run to reach at that rate, and the plan's own figure for them."""
        done = len(steps)
        reachable = max(self.expected["total"].get("steps", self.steps), done)
        used = [u for s in steps for u in s.usage.values()]
        calls, completion = sum(u.get("calls", 0) for u in used), sum(u.get("completion_tokens", 0) for u in used)
        costs = [u["cost"] for u in used if u.get("cost") is not None]
        stages = self.expected["per_step"].values()
        planned_calls = sum(stage["calls"] for stage in stages) * reachable
        spent = f", ${sum(costs):.4f}" if costs else ""
        projected = f", ${sum(costs) / done * reachable:.4f}" if costs else ""
        planned = "" if any(stage.get("cost") is None for stage in stages) else \
            f", ${sum(stage['cost'] for stage in stages) * reachable:.4f}"
        reply = f"; replies averaged {completion / calls:.0f} tokens" if calls else ""
        return (f"after step {done} of {reachable}: the steps spent {calls:,} calls{spent}; at this rate "
                f"{reachable} step(s) make ~{round(calls / done * reachable):,} calls{projected} (the plan: "
                f"{planned_calls:,} calls{planned}){reply}")


def make_plan(optimizer, student: dspy.Module, trainset: list, valset: list | None, attribution_set: list | None, *,
              reply_tokens: int | None = None, pilot: int = 0, say: bool = False) -> Plan:
    """Every check compile makes, the resolved knobs and path, the fingerprint and the estimate (see the module
    docstring); raises what compile would raise, with nothing written, and nothing called unless `pilot` (the student
    run on that many training queries first, `pilot_usage`). `say`: log the preset and path chosen (compile does)."""
    check_program(student)
    held_out = attribution_set if attribution_set is not None else valset
    if optimizer.attribution and not held_out:
        raise ValueError("attribution=True measures the kept items on held-out queries: pass valset= or "
                         "attribution_set=")
    sets = {"trainset": trainset, "valset": valset,
            "attribution_set": held_out if optimizer.attribution or attribution_set is not None else None}
    for name, examples in sets.items():
        if examples is not None:
            check_examples(name, examples)
    if not trainset:
        raise ValueError("trainset is empty")
    program = student.deepcopy()
    targets = resolve_targets(program, optimizer.target_predictors)
    notes = check_data(sets, student)
    lms = _lms(optimizer, student)
    knobs, preset, path = resolve(optimizer.knobs, optimizer.explicit_knobs(), lms["reflection"].model, say=say)
    if path == "contrast" and knobs.num_generations == 1:
        raise ValueError("the contrast learning path compares attempts of one query and learns nothing from "
                         "num_generations=1: use learning_path='paper' (the paper's G = 1 ablation) or G >= 2")
    _check_temperature(knobs, "temperature" in optimizer.explicit_knobs(), lms["policy"])
    if knobs.max_cost is not None:
        check_prices(lms, knobs.prices)
    library = starting_library(student, program, targets, max_words=knobs.max_words_per_experience,
                               max_experiences=knobs.max_experiences)
    demos = carried_demos(program, targets) if knobs.max_demos else []
    if say and (len(library) or demos):
        logger.warning("The student carries what was learned before: %d experience(s) and %d demo(s); the run goes on "
                       "from them (probed, rewritten or replaced like its own)", len(library), len(demos))
    carried = getattr(student, PROVENANCE_KEY, None) if isinstance(getattr(student, PROVENANCE_KEY, None), dict) else {}
    policy = sorted({str(lm.model) for lm in lms["policy"]})
    elsewhere = bool(carried.get("policy")) and sorted(carried["policy"]) != policy
    refit = bool(len(library) or demos) and (knobs.refit is True or (knobs.refit == "auto" and elsewhere))
    if attribution_set is not None and not optimizer.attribution and not refit:
        raise ValueError("attribution_set is only read with attribution=True, or by the refit of a student that carries "
                         "what it learned elsewhere (refit)")
    if refit and not held_out:
        if knobs.refit is True:
            raise ValueError("refit=True measures the carried items on held-out queries: pass valset= or "
                             "attribution_set=")
        notes.append(f"the student's items were learned with {carried['policy']}, not {policy}, but there are no "
                     "held-out queries to refit them on (valset= or attribution_set=): they are kept as they are")
        refit = False
    unmeasured = carried_demos(program, targets) if not knobs.max_demos else []  # (another optimizer's, say)
    if say and unmeasured and (knobs.refit is True or (knobs.refit == "auto" and elsewhere)):
        logger.warning("The student carries %d demo(s) that the refit does not measure, since max_demos=0: they stay "
                       "on their predictors as they are; pass max_demos=%d (or more) to have each measured and kept "
                       "or left out", len(unmeasured), len(unmeasured))
    if refit and say:
        logger.warning("Refit: each of the %d carried item(s) measured on %s before the steps (learned with %s)",
                       len(library) + len(demos), ", ".join(policy),
                       ", ".join(carried.get("policy") or ["a model the program did not record"]))
    if not hasattr(type(program), "forward") and not hasattr(type(program), "aforward"):
        raise TypeError(f"{type(program).__name__} defines neither forward() nor aforward(): a dspy.Module runs one of "
                        "them on each example")
    library_tokens, count_tokens = library_budget(knobs, program, targets, trainset, lms["policy"][0], notes)
    fingerprint = make_fingerprint(knobs, program, targets, trainset, valset, library, demos, lms, optimizer.metric)
    saved = Checkpoint(knobs.log_dir).check(fingerprint, other_versions=knobs.resume_other_versions,
                                            quiet=say)  # as compile (whose start says what it reuses)
    measured = pilot_usage(program, trainset[:pilot], knobs, optimizer.metric) if pilot else None
    if measured is not None:
        notes.append(f"the pilot: {measured['calls']} call(s) on {min(pilot, len(trainset))} training "
                     f"queries{measured['spent']}; their replies and prompts set the estimate's sizes")
    elif pilot:
        notes.append(f"the pilot's {pilot} queries brought back no usage (every call failed, or the LM reports none): "
                     "the estimate's sizes are guesses")
    expected, bound = estimate(knobs, program, trainset, valset, held_out, lms, learning_path=path,
                               reply_tokens=reply_tokens, pilot=measured,
                               carries=bool(len(library) or demos), refit_items=(len(library) + len(demos)) * refit)
    budget = {"max_cost": knobs.max_cost, "max_total_tokens": knobs.max_total_tokens,
              "max_metric_calls": knobs.max_metric_calls}
    models = {"policy": policy, "reflection": str(lms["reflection"].model)}
    return Plan(knobs=knobs, preset=preset, learning_path=path, models=models, steps=knobs.total_steps(len(trainset)),
                turns=_turns(program),
                expected=expected, bound=bound, budget=budget, resume=saved, notes=notes,
                fingerprint=fingerprint, targets=targets, library=library, demos=demos, refit=refit,
                carried=carried, library_tokens=library_tokens, count_tokens=count_tokens,
                roles=predictor_roles(program, targets) if len(targets) > 1 else {})


def library_budget(knobs: Knobs, program: dspy.Module, targets: list[str], trainset: list, lm: dspy.BaseLM,
                   notes: list[str]) -> tuple[int | None, Callable[[str], int] | None]:
    """`max_library_tokens` as the run uses it (None: no cap), and how its tokens are counted (`token_counter`); a
    note says both. "auto" takes an eighth of the policy model's context window (no cap where it is not known). A
    budget with which the longest prompt would not fit the window is refused: a target predictor's instructions and
    fields with the longest training input, the budget's experiences, `max_demos` demos as long, and a reply at the
    `max_tokens` cap (a tool loop's trajectory comes on top of that)."""
    if knobs.max_library_tokens is None:
        return None, None
    count, basis = token_counter(lm)
    window, budget = context_window(lm), knobs.max_library_tokens
    if budget == "auto" and window is None:
        notes.append(f"max_library_tokens='auto': the context window of {lm.model!r} is not known (neither its server "
                     "nor LiteLLM's model map says it), so the libraries have no cap; pass a number of tokens")
        return None, None
    budget = window // 8 if budget == "auto" else budget
    fit = ""
    if window is not None:
        cap = lm.kwargs.get("max_tokens") or lm.kwargs.get("max_completion_tokens") or 1024
        longest = max(trainset, key=lambda x: len(str(x.inputs().toDict())))
        prompts, inputs = {}, count(str(longest.inputs().toDict()))
        for name, predictor in program.named_predictors():
            if name in targets:
                sig = predictor.signature
                messages = ChatAdapter().format(sig, demos=[], inputs={  # (as `_tokens` renders a prompt)
                    k: dict(longest).get(k, "") for k, f in sig.input_fields.items()
                    if k in dict(longest) or f.annotation is not dspy.History})
                prompts[name] = count("\n".join(str(m["content"]) for m in messages))
        name = max(prompts, key=prompts.get)
        need = prompts[name] + budget + knobs.max_demos * (inputs + cap) + cap
        if need > window:
            raise ValueError(
                f"max_library_tokens={budget}: the longest prompt would not fit the context window of {lm.model!r} "
                f"({window:,} tokens): predictor {name!r} with the longest training input takes {prompts[name]:,}, "
                f"the library up to {budget:,}, {knobs.max_demos} demo(s) up to {knobs.max_demos * (inputs + cap):,} "
                f"and the reply up to {cap:,}, {need:,} in all. Pass a smaller max_library_tokens, fewer max_demos or "
                "a smaller max_tokens, or give the model a larger context")
        fit = f"; the longest prompt up to {need:,} of the context window's {window:,}"
    notes.append(f"library: at most {budget:,} tokens of experiences per predictor, counted by {basis}{fit}")
    return budget, count


# -- checks -----------------------------------------------------------------------------------------------------------
def check_program(student) -> None:
    """A TypeError that says a dspy.Module is expected, for a class, a function, a string or anything else."""
    if isinstance(student, dspy.Module):
        return
    if isinstance(student, type) and issubclass(student, dspy.Module):
        raise TypeError(f"compile() got the class {student.__name__}; pass an instance: {student.__name__}()")
    what = f"the string {student!r}" if isinstance(student, str) else \
        f"{type(student).__name__} {getattr(student, '__name__', '')!r}".replace(" ''", "")
    raise TypeError(f"compile() expects a dspy.Module (e.g. dspy.ChainOfThought('question -> answer'), or an "
                    f"instance of your own dspy.Module subclass) as the program, not {what}")


def check_data(sets: dict[str, list | None], program: dspy.Module) -> list[str]:
    """Every example must hold the inputs the program reads. Returns notes on what is legal but likely a mistake
    (said at WARNING level too): duplicated training examples, a valset or attribution set that shares examples with
    the trainset (its score is then not held out), an empty valset (no validation at all)."""
    for name, examples in sets.items():
        check_inputs(name, examples or [], program)
    trainset, valset, held_out = sets.values()
    notes, train = [], [_example_key(x) for x in trainset]
    if dups := len(train) - len(set(train)):
        notes.append(f"the trainset holds {dups} duplicate example(s): each copy is rolled out and probed as a query "
                     "of its own; drop the copies unless you mean to weight them")
    for name, examples in (("valset", valset), ("attribution_set", held_out)):
        shared = sum(_example_key(x) in set(train) for x in examples or [])
        if shared:
            notes.append(f"{shared} of the {len(examples)} {name} example(s) are also in the trainset: their score is "
                         "not held out; use examples the run does not learn from")
    if valset is not None and len(valset) == 0:
        notes.append("valset is empty: no epoch is validated and the last epoch's library is kept; pass valset=None to "
                     "say so, or give it examples")
    for note in notes:
        logger.warning(note)
    return notes


def _example_key(example: dspy.Example) -> str:
    return digest(example.toDict())


def check_examples(name: str, examples) -> None:
    """Every item of a trainset or valset must be a dspy.Example whose inputs are marked (`with_inputs`)."""
    if isinstance(examples, (str, bytes, dict)) or not hasattr(examples, "__len__"):
        raise TypeError(f"{name} must be a list of dspy.Example, e.g. [{EXAMPLE_HINT}], not {type(examples).__name__}")
    for i, example in enumerate(examples):
        if not isinstance(example, dspy.Example):
            raise TypeError(f"{name}[{i}] is a {type(example).__name__}; TrainingFreeGRPO needs dspy.Example items "
                            f"with their input fields marked: {EXAMPLE_HINT}")
        try:
            example.inputs()
        except ValueError:
            raise ValueError(f"{name}[{i}] has no input fields marked; mark them with .with_inputs(...), e.g. "
                             f"{EXAMPLE_HINT}") from None


def check_inputs(name: str, examples, program: dspy.Module) -> None:
    """A ValueError, before anything is spent, when an example lacks an input the program needs: the program would run
    without it (DSPy only logs "Missing: [...]") and score 0. What it needs: the named parameters without a default of
    its `forward` (or `aforward`), or, for a `forward(**kwargs)` (Predict, ChainOfThought, ReAct), its signature's input
    fields (a module with one predictor: that predictor's); nothing is checked when they cannot be told."""
    method = getattr(type(program), "forward", None) or getattr(type(program), "aforward", None)
    try:
        params = list(inspect.signature(method).parameters.values())[1:]  # without self
    except (TypeError, ValueError):  # no forward, or one inspect cannot read
        return
    needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        signature, predictors = getattr(program, "signature", None), program.predictors()
        signature = signature if signature is not None or len(predictors) != 1 else predictors[0].signature
        needed = list(signature.input_fields) if signature is not None else []
    for i, example in enumerate(examples if needed else []):
        missing = [k for k in needed if k not in example.inputs()]
        if missing:
            raise ValueError(f"{name}[{i}] has no input {missing} that the program needs (its inputs are "
                             f"{needed}); the example's inputs are {list(example.inputs().keys())}. Rename the "
                             f"fields, or mark the right ones with .with_inputs(...)")


def _lms(optimizer, program: dspy.Module) -> dict:
    """The policy LMs (by predictor; refused when a predictor has none) and the reflection LM."""
    policy = {}
    for name, predictor in program.named_predictors():
        lm = predictor.lm or dspy.settings.lm
        if lm is None:
            raise ValueError(f"predictor {name!r} has no LM: call dspy.configure(lm=dspy.LM(...)) or set one on it")
        policy[id(lm)] = lm
    if not policy:
        raise ValueError(NO_PREDICTORS)
    reflection = optimizer.reflection_lm or dspy.settings.lm or next(iter(policy.values()))
    return {"policy": list(policy.values()), "reflection": reflection}


def _check_temperature(knobs: Knobs, explicit: bool, policy: list) -> None:
    """A model that takes one temperature only (OpenAI's reasoning models) keeps it: a `temperature` passed explicitly
    is refused for it, the default is not applied (said once)."""
    for lm in policy:
        if (fixed := fixed_temperature(lm)) is not None and knobs.temperature != fixed:
            if explicit:
                raise ValueError(f"temperature={knobs.temperature} cannot be used with {lm.model!r}, which takes only "
                                 f"temperature={fixed:g}: leave temperature unset (its attempts then differ by their "
                                 "rollout IDs and the model's own sampling) or pass temperature=1.0")
            logger.warning("%s takes only temperature=%g: its attempts are sampled at that, not at the default %g",
                           lm.model, fixed, knobs.temperature)


def check_prices(lms: dict, prices: dict | None) -> None:
    """Refuse a `max_cost` budget when an LM that will be called has no known price: its calls would count as $0 and
    the budget would never stop the run."""
    unpriced: dict[str, list[str]] = {}
    for whose, lm in [("policy", lm) for lm in lms["policy"]] + [("reflection", lms["reflection"])]:
        if model_price(str(getattr(lm, "model", type(lm).__name__)), prices) is None:
            unpriced.setdefault(str(getattr(lm, "model", type(lm).__name__)), []).append(whose)
    if unpriced:
        named = ", ".join(f"the {' and '.join(dict.fromkeys(roles))} LM {model!r}" for model, roles in unpriced.items())
        raise ValueError(f"max_cost is set, but DSPy knows no price for {named} (LiteLLM's price map has no entry for "
                         "it): its calls would count as $0 and the budget would never stop the run. Give its price "
                         "(prices={model: {'input': ..., 'output': ...}} per million tokens), or budget with "
                         "max_total_tokens, which is measured for every model")


def make_fingerprint(knobs: Knobs, program, targets, trainset: list, valset: list | None,
                     library: ExperienceLibrary, demos: list[Demo], lms: dict, metric) -> dict:
    """What a resume must match: the knobs that change what is computed, the targets, the LMs' models, the program's
    instructions and code, the metric, the data (trainset, valset), the starting library and demos, and the versions
    that make the prompts."""
    models = {"policy": sorted({str(getattr(lm, "model", type(lm).__name__)) for lm in lms["policy"]}),
              "reflection": str(getattr(lms["reflection"], "model", type(lms["reflection"]).__name__))}
    fingerprinted = fingerprinted_knobs(knobs)
    if not isinstance(fingerprinted["learning_path"], str):  # a plug-in path is known by its class
        kind = type(fingerprinted["learning_path"])
        fingerprinted["learning_path"] = f"{kind.__module__}.{kind.__qualname__}"
    return {"knobs": fingerprinted, "targets": targets, "models": models,
            "instructions": digest([p.signature.instructions for _, p in program.named_predictors()]),
            "trainset": digest([dict(x) for x in trainset]), "valset": digest([dict(x) for x in valset or []]),
            "initial_library": digest(library.dump_state()), "initial_demos": digest([d.to_record() for d in demos]),
            **code_fingerprint(metric, program),
            "versions": prompt_versions()}


# -- the estimate -----------------------------------------------------------------------------------------------------
TRIES = 2  # the most times a call is sent: once, and once more when its reply does not parse


def estimate(knobs: Knobs, program: dspy.Module, trainset: list, valset: list | None, held_out: list | None,
             lms: dict, *, learning_path: str, reply_tokens: int | None = None, pilot: dict | None = None,
             carries: bool = False, refit_items: int = 0) -> tuple[dict, dict]:
    """Calls, tokens and dollars per stage of a step (`per_step`) and for the whole run (`total`, with `metric_calls`;
    `held_out`: the attribution's queries): expected (see the module docstring), and as an upper bound (every call
    sent twice, every rewrite, a full library, replies at the `max_tokens` cap). `pilot` (`pilot_usage`): a reply's
    tokens as measured, and, for a student that `carries` nothing, the prompts scaled to the tokens the provider
    counted for them."""
    policy = lms["policy"][0]
    signatures = [p.signature for _, p in program.named_predictors()]
    cap = policy.kwargs.get("max_tokens") or policy.kwargs.get("max_completion_tokens") or 1024
    reply, source = (reply_tokens, "reply_tokens") if reply_tokens else \
        (pilot["reply"], f"{pilot['calls']} pilot call(s)") if pilot else (_reply_tokens(signatures, cap),
                                                                           "the output fields")
    query, system, expected_turns = (_tokens(signatures, [x.inputs() for x in trainset]), _tokens(signatures, [{}]),
                                     _turns(program, expected=True))
    if pilot and not carries:  # the student's step-0 prompt as the provider counted it, against this module's count
        scale = pilot["prompt"] / max(query + (expected_turns - 1) * reply // 2, 1)
        query, system = round(query * scale), round(system * scale)
    sizes = {"query": query, "system": system,
             "turns": _turns(program), "expected_turns": expected_turns, "trainset": len(trainset),
             "reply": reply, "reply_source": source, "learning_reply": reply_tokens or LEARNING_REPLY,
             "cap": cap,
             "runs": knobs.num_train_epochs * len(valset or []) + attribution_runs(knobs, len(trainset),
                                                                                   len(held_out or []))["runs"],
             "prices": (model_price(str(policy.model), knobs.prices),
                        model_price(str(lms["reflection"].model), knobs.prices)),
             "metric": pilot.get("metric") if pilot else None}  # a judge's calls per scored attempt, as piloted
    scheduled = knobs.total_steps(len(trainset))
    per_step = _tally(knobs, sizes, learning_path, False, scheduled)["per_step"]
    steps, budget_note = reachable_steps(knobs, per_step, scheduled, len(trainset))
    per_epoch = -(-len(trainset) // knobs.batch_size)
    validated = min(knobs.num_train_epochs, -(-steps // per_epoch) if steps == scheduled else steps // per_epoch)
    items = attribution_runs(knobs, len(trainset), len(held_out or []), steps=steps)
    refit_runs = measure_runs(knobs, refit_items, len(held_out or []), prune=True)["runs"] if refit_items else 0
    sizes["runs"] = validated * len(valset or []) + items["runs"] + refit_runs
    expected, bound = _tally(knobs, sizes, learning_path, False, steps), _tally(knobs, sizes, learning_path, True, steps)
    batch = min(knobs.batch_size, len(trainset))
    measured = bool(items["runs"] or refit_runs)  # the held-out queries an attribution or a refit reads
    reads = {"trainset": min(len(trainset), steps * batch + steps * min(knobs.probe_size, len(trainset))),
             "valset": len(valset or []) if validated or (measured and held_out is valset) else 0,
             "attribution_set": len(held_out or []) if measured and held_out is not valset else 0}
    for tally in (expected, bound):
        tally["total"].update(steps=steps, scheduled_steps=scheduled, examples_read=reads, budget_note=budget_note,
                              reply=f"{sizes['reply']} tokens (from {sizes['reply_source']})")
    expected["total"]["attribution"] = items
    expected["total"]["cost_unlearned"] = _tally(knobs, sizes, learning_path, False, steps, growth=0)["total"]["cost"]
    bound["total"]["attribution"] = attribution_runs(knobs, len(trainset), len(held_out or []))
    return expected, bound


def pilot_usage(program: dspy.Module, examples: list, knobs: Knobs, metric=None) -> dict | None:
    """The student run on `examples` (real LM calls, billed; nothing is written): its calls, and the mean prompt and
    reply tokens of a call as the provider reported them (None when no call reported any). A query that fails is
    passed over: the run meets it again. With `metric`, each answer is scored too, and what the metric's own LM calls
    (an LLM judge's) spent per scored attempt is under `metric` (None when it made no call)."""
    answered = []
    with metered(knobs.prices) as used:
        for example in examples:
            _, attempt = run_program(program.deepcopy(), example)  # as an attempt runs it (an async program too)
            if attempt.error:  # a failed pilot query measures nothing
                logger.info("pilot query failed: %s", attempt.error)
            else:
                answered.append((example, attempt))
    with metered(knobs.prices) as judged:
        for example, attempt in answered if metric is not None else ():
            score_attempt(metric, example, attempt, knobs.metric_timeout_s)
    entries = [e for lm_entries in used.usage_data.values() for e in lm_entries if e.get("completion_tokens")]
    if not entries:
        return None
    total, scored, per = used.totals(), judged.totals(), None
    if scored["calls"]:  # per scored attempt (a cost only where the judge's price is known)
        per = {k: scored[k] / len(answered) for k in ("calls", "prompt_tokens", "completion_tokens")}
        per["cost"] = scored["cost"] / len(answered) if "cost" in scored else None
    spent = [x for x in (total.get("cost"), scored.get("cost")) if x is not None]
    return {"calls": len(entries) + scored["calls"],
            "reply": round(statistics.fmean(int(e["completion_tokens"]) for e in entries)),
            "prompt": round(statistics.fmean(int(e.get("prompt_tokens") or 0) for e in entries)),
            "spent": f", ${sum(spent):.4f}" if spent else "", "metric": per}


def reachable_steps(knobs: Knobs, per_step: dict, scheduled: int, trainset_size: int) -> tuple[int, str | None]:
    """How many of the `scheduled` steps the budgets let the run start, at what a step is expected to spend
    (`per_step`, by stage), as the run decides (`Record.reached`): it starts a step only where what is left pays for
    its rollouts and a probe of the program and one edit, each attempt at what one has cost so far; the steps before
    it spend a whole step each. Before its first call a run knows only what those attempts cost in metric calls, so
    the first step is refused by `max_metric_calls` alone: a token or dollar budget that the estimate says it passes
    stops the run inside that step. With the steps, what the plan says of a budget that lets no whole step run, or
    None."""
    attempts = min(knobs.batch_size, trainset_size) * knobs.num_generations
    need = attempts + 2 * min(knobs.probe_size, trainset_size)
    rollout = per_step["rollout"]
    whole = {"metric_calls": attempts + (1 + knobs.max_probed_edits) * min(knobs.probe_size, trainset_size)
             * bool(knobs.probe_size),
             "tokens": sum(s["prompt_tokens"] + s["completion_tokens"] for s in per_step.values()),
             "cost": sum(s["cost"] or 0.0 for s in per_step.values())}
    scored = per_step.get("reward", {})  # (a metric that calls an LM)
    one = {"metric_calls": 1, "cost": ((rollout["cost"] or 0.0) + (scored.get("cost") or 0.0)) / max(attempts, 1),
           "tokens": sum(s.get(k, 0) for s in (rollout, scored) for k in ("prompt_tokens", "completion_tokens"))
           / max(attempts, 1)}
    steps, said, no_step = scheduled, None, None
    for name in ("metric_calls", "tokens", "cost"):  # (a note on tokens before one on dollars)
        knob = LIMITS[name]
        limit = getattr(knobs, knob)
        if limit is None or not whole[name]:
            continue
        fits = 0 if limit < need * one[name] else int((limit - need * one[name]) // whole[name]) + 1
        if fits == 0 and name == "metric_calls":
            no_step = (f"no step: budget {knob}={limit:g} cannot pay for a step ({need} attempts: its rollouts, and a "
                       "probe of the program and one edit, where it probes); compile sends nothing (raise the budget, "
                       "or lower batch_size or num_generations)")
        elif fits == 0:
            shown = f"${need * one[name]:.4f}" if name == "cost" else f"{need * one[name]:,.0f}"
            said = said or (f"first step: budget {knob}={limit:g} is below what its {need} attempts are expected to "
                            f"need (~{shown}, an estimate: plan(..., pilot=N) measures a reply); the run starts it and "
                            "stops at the first call that would pass the budget (a resume with a larger budget goes on "
                            "from the calls it made)")
            fits = 1
        steps = min(steps, fits)
    return steps, no_step or said


def _tally(knobs: Knobs, sizes: dict, learning_path: str, bound: bool, steps: int, growth: float = GROWTH) -> dict:
    """The estimate (expected, or with `bound` the upper bound) of `steps` steps from the prompt `sizes` measured
    once, the library growing by `growth` experiences a step."""
    tries = TRIES if bound else 1
    G, query = knobs.num_generations, sizes["query"]
    turns = sizes["turns"] if bound else sizes["expected_turns"]

    def stage(calls: int, prompt: int, reply: int, shared: int = 0) -> dict:  # `shared`: the prefix its calls share
        return {"calls": calls * tries, "prompt_tokens": calls * prompt * tries, "completion_tokens": calls * reply * tries,
                "cached_tokens": 0 if bound else max(calls - 1, 0) * shared}

    batch = min(knobs.batch_size, sizes["trainset"])
    reply = sizes["cap"] if bound else sizes["reply"]
    learning_reply = sizes["cap"] if bound else sizes["learning_reply"]
    grown = growth * (steps - 1) / 2 if not bound else float("inf")  # the library halfway through the run; full
    library = int(min(grown, knobs.max_experiences or 40) * (EXPERIENCE_TOKENS if not bound else
                                                             knobs.max_words_per_experience * 1.4 + 8))
    shown = sizes["system"] + library + knobs.max_demos * (query + reply)  # what every attempt's prompt starts with
    task = max(query - sizes["system"], 1)  # the query's own inputs, as a learning call shows them
    attempt = query + library + knobs.max_demos * (query + reply) + (turns - 1) * reply // 2
    stages = {"rollout": stage(batch * G * turns, attempt, reply, shown)}
    if learning_path == "contrast":
        pairs = batch * min(knobs.max_operations_per_group, G // 2)
        calls = pairs * (2 if bound else 1)  # the contrast call, and its rewrite at most
        stages["contrast"] = stage(calls, 400 + task + library + 2 * reply, learning_reply, 400)
    else:
        fixed = {name: _tokens([sig], [{}]) for name, sig in (("summary", Summarizer(True).predict.signature),
                 ("advantage", AdvantageExtractor(True).predict.signature),
                 ("consolidation", Consolidator().predict.signature))}
        stages["summary"] = stage(batch * G, fixed["summary"] + task + library + reply, learning_reply,
                                  fixed["summary"] + library)
        stages["advantage"] = stage(batch, fixed["advantage"] + task + library + G * learning_reply, learning_reply,
                                    fixed["advantage"] + library)
        stages["consolidation"] = stage(1, fixed["consolidation"] + library + batch * knobs.max_operations_per_group
                                        * 60, learning_reply)
    probe_attempts = (1 + knobs.max_probed_edits) * min(knobs.probe_size, sizes["trainset"])
    if knobs.probe_size:
        stages["probe"] = stage(probe_attempts * turns, attempt, reply, shown)
    extra = stage(sizes["runs"] * turns, attempt, reply, shown)  # validation and attribution, once for the run
    for name, s in [*stages.items(), ("validation", extra)]:
        price = sizes["prices"][0 if role(name) == "policy" else 1]
        s["cost"] = None if price is None else ((s["prompt_tokens"] - s["cached_tokens"]) * price["input"] + s[
            "cached_tokens"] * price["cached_input"] + s["completion_tokens"] * price["output"])
    scored = batch * G + probe_attempts * bool(knobs.probe_size)  # a step's metric calls
    if judge := sizes.get("metric"):  # a metric that calls an LM, at what the pilot's scoring spent per attempt
        stages["reward"] = {"calls": scored * judge["calls"] * tries, "cached_tokens": 0,
                            **{k: scored * judge[k] * tries for k in ("prompt_tokens", "completion_tokens")},
                            "cost": None if judge["cost"] is None else scored * judge["cost"] * tries}
        for k in ("calls", "prompt_tokens", "completion_tokens"):
            extra[k] += sizes["runs"] * judge[k] * tries
        extra["cost"] = None if extra["cost"] is None or judge["cost"] is None else \
            extra["cost"] + sizes["runs"] * judge["cost"] * tries
    total = {k: steps * sum(s[k] for s in stages.values()) + extra[k]
             for k in ("calls", "prompt_tokens", "completion_tokens", "cached_tokens")}
    costs = [s["cost"] for s in [*stages.values(), extra]]
    total["cost"] = None if None in costs else steps * sum(costs[:-1]) + costs[-1]
    total["metric_calls"] = steps * scored + sizes["runs"]
    return {"per_step": stages, "total": total}


def attribution_runs(knobs: Knobs, trainset_size: int, queries: int, *, steps: int | None = None) -> dict:
    """The attribution's program runs (`attribution`, worth.py) on `queries` held-out queries, for the items `steps`
    steps are expected to keep (`GROWTH` experiences a step, and max_demos), or (None) as an upper bound, for every
    experience the steps can add (or max_experiences) and max_demos."""
    if not knobs.attribution or not queries:
        return {"items": 0, "runs": 0, "method": None}
    added = knobs.total_steps(trainset_size) * knobs.batch_size * knobs.max_operations_per_group if steps is None \
        else GROWTH * steps
    items = min(knobs.max_experiences if knobs.max_experiences is not None else added, added) + knobs.max_demos
    return measure_runs(knobs, items, queries, prune=knobs.prune)


def measure_runs(knobs: Knobs, items: int, queries: int, *, prune: bool) -> dict:
    """The program runs of measuring `items` items on `queries` queries (worth.py, the attribution's and a refit's):
    leave-one-out runs each query with all items, none, the control and each item left out; Shapley (past
    `attribution_max_items` items) up to one subset per item and sampled order; `prune` tries up to one more subset
    per item on half the queries, then checks two programs on the other half."""
    if not items or not queries:
        return {"items": 0, "runs": 0, "method": None}
    choose = (queries + 1) // 2 if prune else queries
    shapley = items > knobs.attribution_max_items
    per_query = knobs.attribution_permutations * items + 2 if shapley else items + 3
    per_query += items if prune else 0
    return {"items": items, "runs": choose * per_query + 2 * (queries - choose),
            "method": "shapley" if shapley else "leave-one-out"}


# Tokens a reply's output field is expected to take, by what its name says it holds, beside the field's own markup: a
# chain of thought runs to a paragraph, code to a short program, any other field (an answer, a tool's name or
# arguments) to a line.
FIELD_REPLY = {"reasoning": 120, "rationale": 120, "thought": 120, "next_thought": 120, "explanation": 120,
               "code": 200, "program": 200, "solution": 200}
LINE_REPLY, FIELD_MARKUP = 24, 10


def _reply_tokens(signatures: list, cap: int) -> int:
    """The tokens a reply of the program is expected to take, from its predictors' output fields (`FIELD_REPLY`),
    averaged over its predictors and at most the `max_tokens` cap."""
    per_call = [sum(FIELD_REPLY.get(name, LINE_REPLY) + FIELD_MARKUP for name in sig.output_fields)
                for sig in signatures] or [LINE_REPLY]
    return max(1, min(cap, int(statistics.fmean(per_call))))


def _turns(program: dspy.Module, expected: bool = False) -> int:
    """LM calls per attempt: one per predictor, and a module with a loop of `max_iters` turns (ReAct, an agent) its
    turns: ReAct's `max_iters` calls and its extract, an agent's `max_iters` and its answer; `expected`: a loop that
    ends with its answer halfway (a guess: a loop stops when the model answers)."""
    loops = [m for _, m in program.named_sub_modules() if isinstance(getattr(m, "max_iters", None), int)]
    return len(program.named_predictors()) + sum((m.max_iters + 1) // 2 if expected else m.max_iters
                                                 - isinstance(m, dspy.ReAct) for m in loops)


def _tokens(signatures: list, examples: list) -> int:
    """Tokens of the prompts of `signatures` (each predictor's instructions and fields, as the chat adapter renders
    them) for the inputs of `examples` (up to 20 averaged; `[{}]`: with empty inputs)."""
    total = 0
    for sig in signatures:
        # an input the example lacks counts as empty text; a dspy.History it lacks, as no turns
        sizes = [sum(len(str(m["content"])) for m in ChatAdapter().format(sig, demos=[], inputs={
            k: dict(x).get(k, "") for k, f in sig.input_fields.items()
            if k in dict(x) or f.annotation is not dspy.History})) for x in examples[:20]]
        total += int(statistics.fmean(sizes)) // CHARS_PER_TOKEN
    return total
