"""What `compile()` starts from, checked before anything is spent: the program, the examples, whether a
`max_cost` budget can be measured at all for the LMs that will be called, and the library to learn on from."""

from __future__ import annotations

import inspect
import logging

import dspy

from tfgrpo.optimizers.learning_paths import SMALL_REFLECTOR_B, model_size_b
from tfgrpo.programs.inject import LIBRARY_KEY, library_from_instructions
from tfgrpo.programs.library import ExperienceLibrary

logger = logging.getLogger(__name__)

EXAMPLE_HINT = "dspy.Example(question=..., answer=...).with_inputs('question')"


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


def required_inputs(program: dspy.Module) -> list[str] | None:
    """The input fields every call of `program` needs: the named parameters without a default of its `forward`,
    or, for a `forward(**kwargs)` (Predict, ChainOfThought, ReAct), its signature's input fields (a module with one
    predictor: that predictor's). None when they cannot be told."""
    try:
        params = list(inspect.signature(type(program).forward).parameters.values())[1:]  # without self
    except (AttributeError, TypeError, ValueError):  # no forward, or one inspect cannot read
        return None
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    signature = getattr(program, "signature", None)
    predictors = program.predictors()
    if signature is None and len(predictors) == 1:
        signature = predictors[0].signature
    return list(signature.input_fields) if signature is not None else None


def check_inputs(name: str, examples, program: dspy.Module) -> None:
    """A ValueError, before anything is spent, when an example lacks an input the program needs: the program would
    run without it (DSPy only logs "Missing: [...]") and score 0, which reads like a bad library."""
    needed = required_inputs(program)
    for i, example in enumerate(examples if needed else []):
        missing = [k for k in needed if k not in example.inputs()]
        if missing:
            raise ValueError(f"{name}[{i}] has no input {missing} that the program needs (its inputs are "
                             f"{needed}); the example's inputs are {list(example.inputs().keys())}. Rename the "
                             f"fields, or mark the right ones with .with_inputs(...)")


def has_price(lm: dspy.BaseLM) -> bool:
    """Whether DSPy can price `lm`'s calls: DSPy 3.4 routes the model to a provider and reads the per-token price
    from its own copy of LiteLLM's price map (dspy.clients.model_metadata); a model it cannot route or has no
    price for records no cost, so a cost budget would never grow."""
    try:
        from dspy.clients.capabilities import resolve
        from dspy.clients.model_metadata import model_info, rate

        route = resolve(lm)
        info = model_info(route.provider, route.model)
    except Exception:  # a model DSPy cannot route (a custom BaseLM, a name without a provider)
        return False
    return rate(info, "input_cost_per_token") is not None and rate(info, "output_cost_per_token") is not None


def check_prices(policy_lms: list[dspy.BaseLM], reflection_lm: dspy.BaseLM) -> None:
    """Refuse a `max_cost` budget when an LM that will be called has no known price: its calls would count as $0
    and the budget would never stop the run."""
    unpriced: dict[str, list[str]] = {}
    for role, lm in [("policy", lm) for lm in policy_lms] + [("reflection", reflection_lm)]:
        if not has_price(lm):
            unpriced.setdefault(str(getattr(lm, "model", type(lm).__name__)), []).append(role)
    if unpriced:
        named = ", ".join(f"the {' and '.join(dict.fromkeys(roles))} LM {model!r}" for model, roles in unpriced.items())
        raise ValueError(f"max_cost is set, but DSPy knows no price for {named} (LiteLLM's price map has no entry for "
                         "it): its calls would count as $0 and the budget would never stop the run. Budget with "
                         "max_total_tokens instead, which is measured for every model")


def starting_library(student: dspy.Module, program: dspy.Module, targets: list[str], *, max_words: int,
                     max_experiences: int | None) -> ExperienceLibrary:
    """The library to learn on from: the student's own (its `experience_library`), else the one rendered into the
    targets' instructions (a program loaded with stock DSPy's `load` carries only that), else an empty one."""
    start = getattr(student, LIBRARY_KEY, None)
    own = isinstance(start, ExperienceLibrary)
    if own and (len(start) or start.retired):
        library = start.copy()
    elif (library := library_from_instructions(program, targets, max_words=max_words,
                                               max_experiences=max_experiences)) is not None:
        logger.info("The program carries no experience_library, but its instructions hold %d experience(s) (%s): "
                    "recovered from there and kept; their provenance was not saved in the instructions",
                    len(library), ", ".join(e.id for e in library))
    else:
        library = start.copy() if own else ExperienceLibrary()
    library.max_words, library.max_experiences = max_words, max_experiences
    return library


def explain_learning_path(setting: str, path: str, reflection_lm: dspy.BaseLM) -> None:
    """Log which learning path a run takes and why (for "auto": the size read from the reflection model's name)."""
    model = str(getattr(reflection_lm, "model", ""))
    if setting != "auto":
        logger.info("Learning path %r (set by learning_path)", path)
        return
    size = model_size_b(model)
    why = f"its name gives {size:g}B parameters" if size != float("inf") else \
        "its name gives no parameter count, so it is taken as a large model"
    logger.info("learning_path='auto' picked %r for the reflection model %r: %s (contrast up to %gB). Set "
                "learning_path='paper' or 'contrast' to choose.", path, model, why, SMALL_REFLECTOR_B)
