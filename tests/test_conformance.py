"""A user's program as DSPy runs it: each kind of DSPy module (Predict, ChainOfThought, BestOfN, Refine, ReAct,
MultiChainComparison, Parallel, a History input, a forward that returns None or a string, `n=3` completions,
`Prediction.from_completions`, a predictor built inside forward, a prediction holding an open file or a generator)
with typed outputs (an Enum, pydantic models, a tuple, a date), compiled with a scripted LM. For each: the metric
receives what `dspy.Evaluate` gives it, in a first compile and in one run again on its log_dir; the library reaches
every predictor and the demos their predictors; the program saves and loads in stock DSPy in a fresh process with the
same prompts; a compile stopped part way (by its budget, or killed) and run again gives the program of a run that was
never stopped, sending only the requests the stopped run had not had answered."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from pathlib import Path

import dspy
import pytest
from scripted_lm import ScriptedLM, kind_of, output_fields
from test_optimizer import LESSON, learner
from user_programs import PROGRAMS, Color, example, learned, right, student

from tfgrpo.optimizers import TrainingFreeGRPO

TESTS = Path(__file__).parent
LEARNER = learner()


def respond(messages, kwargs):
    if kind_of(messages) == "student":
        return student(output_fields(messages), messages[-1]["content"], kwargs)
    return LEARNER(messages, kwargs)


def kinds(pred) -> str:
    """The types a metric receives, as text: a prediction's fields (an element's type for a list or tuple), and how
    many completions it holds where it holds several."""
    if not isinstance(pred, dspy.Prediction):
        return type(pred).__name__
    seen = {k: type(v).__name__ + (f"[{type(v[0]).__name__}]" if isinstance(v, (list, tuple)) and v else "")
            for k, v in pred.items()}
    if pred.completions is not None and len(pred.completions) > 1:
        seen["completions"] = len(pred.completions)
    return json.dumps(seen, sort_keys=True)


class Metric:
    """A metric as a user writes it, reading the typed fields (`pred.things[0].name` raises on a string), noting the
    types it receives."""

    def __init__(self):
        self.seen, self.lock = set(), threading.Lock()

    def __call__(self, example, pred, trace=None):
        with self.lock:
            self.seen.add(kinds(pred))
        if isinstance(pred, str):
            return float(pred == "yes")
        if "color" in pred:  # (None raises here, as it would under dspy.Evaluate)
            assert isinstance(pred.color, Color) and pred.things[0].name and isinstance(pred.pair, tuple)
            assert pred.day.year > 2000
        if "log" in pred:  # open, as the program left it
            assert not pred.log.closed and pred.log.writable()
        if "words" in pred:  # not consumed before the metric reads it
            assert list(pred.words) == pred.answer.split()
        return float(right(pred))


def evaluate_kinds(name: str, lm) -> set[str]:
    """The types dspy.Evaluate gives the metric, over rollout IDs (the scripted student answers by them)."""
    metric = Metric()
    for rid in range(4):
        program = PROGRAMS[name]()
        program.set_lm(lm.copy(rollout_id=rid, temperature=1.0))
        dspy.Evaluate(devset=[example(i, name) for i in range(4)], metric=metric, num_threads=1,
                      display_progress=False, max_errors=100)(program)
    return metric.seen


def compile_program(name: str, lm, **kw):
    dspy.configure(lm=lm)
    metric = Metric()
    opts = dict(num_generations=4, batch_size=2, num_train_epochs=1, num_threads=2, max_demos=1,
                learning_path="paper")
    opts.update(kw)
    compiled = TrainingFreeGRPO(metric, **opts).compile(PROGRAMS[name](), trainset=[example(i, name) for i in range(4)])
    return compiled, metric


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_user_program_compiles_as_dspy_runs_it(name, tmp_path):
    lm = ScriptedLM(respond)
    compiled, metric = compile_program(name, lm, log_dir=str(tmp_path / "run"))
    # the metric received what dspy.Evaluate gives it
    assert metric.seen and metric.seen <= evaluate_kinds(name, lm), (metric.seen, evaluate_kinds(name, lm))
    # the library reaches every predictor
    assert compiled.experience_library.texts()
    for pname, predictor in compiled.named_predictors():
        assert LESSON in predictor.signature.instructions, pname
    # a demo kept reaches the predictors whose calls it holds, each with that predictor's fields
    kept = [d for s in compiled.detailed_results.steps for d in s.demos]
    with_demos = {pname: p.demos for pname, p in compiled.named_predictors() if p.demos}
    assert bool(kept) == bool(with_demos), (kept, with_demos)
    for pname, demos in with_demos.items():
        fields = dict(compiled.named_predictors())[pname].signature.output_fields
        assert all(set(fields) <= set(dict(d)) for d in demos), (pname, demos)
        for demo in demos:
            if "color" in dict(demo):
                assert Color(dict(demo)["color"])  # as DSPy's parser reads it back (never "Color.RED")
    # saved, and loaded in stock DSPy in a fresh process: the same prompts
    path = tmp_path / "program.json"
    compiled.save(str(path))
    script = (f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); import dspy; "
              f"from user_programs import PROGRAMS; from user_programs import learned; "
              f"p = PROGRAMS[{name!r}](); p.load({str(path)!r}); print(json.dumps(learned(p)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "tfgrpo" not in out.stderr
    assert json.loads(out.stdout) == learned(compiled)
    # compiled again on its log_dir: every finished step reused whole, nothing sent
    again_lm = ScriptedLM(respond)
    again, metric = compile_program(name, again_lm, log_dir=str(tmp_path / "run"))
    assert again_lm.calls == [] and learned(again) == learned(compiled)
    assert metric.seen <= evaluate_kinds(name, lm)


class Crash(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def crashing(after: int):
    """`respond`, until the `after`-th call, which dies as a killed process does."""
    seen, lock = {"n": 0}, threading.Lock()

    def respond_or_die(messages, kwargs):
        with lock:
            seen["n"] += 1
            if seen["n"] == after:
                raise Crash()
        return respond(messages, kwargs)

    return respond_or_die


def tokens(result) -> int:
    return sum(u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) for u in result.run_usage.values())


def recorded(log_dir) -> collections.Counter:
    """How often the record of a run holds each request (by its key)."""
    lines = [json.loads(line) for line in (log_dir / "calls.jsonl").read_text().splitlines()]
    return collections.Counter(e["key"] for e in lines if "key" in e)


def of_an_attempt(key: str) -> bool:
    """Whether the record's key is of an attempt's call (its unit a digest; a learning call's is "stage#i")."""
    return "/" in key and "#" not in key.split("/")[0]


def replies(log_dir) -> int:
    """The LM replies the record holds (a call of `n=3` holds three)."""
    lines = [json.loads(line) for line in (log_dir / "calls.jsonl").read_text().splitlines()]
    return sum(len(e["reply"]["responses"]) or 1 for e in lines if "key" in e)


ON_THE_EVENT_LOOP = ["predict_typed", "best_of_n", "refine", "react", "several_completions", "predictor_in_forward",
                     "holds_a_generator"]


@pytest.mark.parametrize("stop", ["budget", "kill"])
@pytest.mark.parametrize("name, backend", [(name, "threads") for name in PROGRAMS] +
                         [(name, "async") for name in ON_THE_EVENT_LOOP])
def test_a_compile_stopped_and_run_again_gives_the_program_of_a_run_never_stopped(name, backend, stop, tmp_path):
    """Stopped part way (its token budget runs out, or the process dies at a call), then compiled again on its log_dir
    with the budget lifted: the same program as a run never stopped, the program run again as it is (the metric gets
    what dspy.Evaluate gives it), and no request the stopped run had answered is sent again; on threads, and on the
    event loop (backend="async") for the shapes with an async path."""
    whole_lm = ScriptedLM(respond)
    whole, _ = compile_program(name, whole_lm, log_dir=str(tmp_path / "whole"), backend=backend)
    if stop == "kill":
        first = ScriptedLM(crashing(len(whole_lm.calls) // 2))
        with pytest.raises(Crash):
            compile_program(name, first, log_dir=str(tmp_path / "run"), backend=backend)
    else:
        first = ScriptedLM(respond)
        stopped, _ = compile_program(name, first, log_dir=str(tmp_path / "run"), backend=backend,
                                     max_total_tokens=tokens(whole.detailed_results) // 2)
        assert "max_total_tokens" in stopped.detailed_results.stopped_early
    kept, before = replies(tmp_path / "run"), recorded(tmp_path / "run")
    assert len(first.calls) - kept <= 2  # the stopped run's replies were kept, but those in flight as it died
    lm = ScriptedLM(respond)
    again, metric = compile_program(name, lm, log_dir=str(tmp_path / "run"), backend=backend)
    assert learned(again) == learned(whole)
    # no request was sent more often than by a run never stopped, for those the stopped run had answered (an attempt's
    # calls; with dspy.Parallel, whose trace is in the order its threads end, a learning call's prompt may differ)
    after, once = recorded(tmp_path / "run") - before, recorded(tmp_path / "whole")
    assert not [key for key in before if before[key] + after[key] > once[key]
                and (of_an_attempt(key) or name != "parallel")]
    if name != "parallel":
        assert len(lm.calls) == len(whole_lm.calls) - kept  # what the stopped run had not asked, and nothing else
        assert again.detailed_results.run_usage == whole.detailed_results.run_usage  # the two runs' cost is one run's
    assert metric.seen and metric.seen <= evaluate_kinds(name, lm)


@pytest.mark.parametrize("backend", ["threads", "async"])
def test_a_stop_inside_a_step_keeps_the_last_finished_step(backend, tmp_path):
    """A budget that runs out inside step 1's learning calls returns step 0's library and demos (those of a run of
    one step), and a resume with the budget lifted gives the program of a run never stopped."""
    whole, _ = compile_program("predict_typed", ScriptedLM(respond), backend=backend)
    one, _ = compile_program("predict_typed", ScriptedLM(respond), backend=backend, max_steps=1)
    tokens = lambda used: used.get("prompt_tokens", 0) + used.get("completion_tokens", 0)  # noqa: E731
    step0, step1 = (sum(tokens(u) for u in s.usage.values()) for s in whole.detailed_results.steps)
    rollouts1 = tokens(whole.detailed_results.steps[1].usage["rollout"])
    budget = step0 + rollouts1 + (step1 - rollouts1) // 3  # step 1 starts, and stops in its learning calls
    stopped, _ = compile_program("predict_typed", ScriptedLM(respond), backend=backend, max_total_tokens=budget,
                                 log_dir=str(tmp_path / "run"))
    result = stopped.detailed_results
    assert result.stopped_early and "max_total_tokens" in result.stopped_early and len(result.steps) == 1
    assert stopped.experience_library.texts() and learned(stopped) == learned(one)
    resumed, _ = compile_program("predict_typed", ScriptedLM(respond), backend=backend,
                                 log_dir=str(tmp_path / "run"))
    assert learned(resumed) == learned(whole) and not resumed.detailed_results.stopped_early
