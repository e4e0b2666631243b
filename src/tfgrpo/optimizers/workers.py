"""Where a run's units run, and what an attempt runs: a program on an example (`run_program`), on
a bounded pool of threads (`Workers`) or, with `backend="ray"`, as a task on a Ray cluster (`RayAttempts`).

`Workers` is the runner's seam: `map` runs a stage's units on the pool and `each` runs a step's groups side by side;
`AsyncWorkers` (`backend="async"`) adds `gather`, which runs a scope's attempts as coroutines on one event loop, and
keeps the other two verbs, so the step does not change.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import os
import platform
import queue
import re
import socket
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import dspy
import pydantic
import tqdm
from dspy.utils.exceptions import AdapterParseError, LMError

from tfgrpo.base.util import USER_MODULE_PREFIX, clip, digest, jsonable
from tfgrpo.optimizers.checkpoint import installed_version
from tfgrpo.optimizers.records import Attempt
from tfgrpo.optimizers.spend import UsageMeter, paced
from tfgrpo.programs.render import MAX_ATTEMPT_CHARS, count_tool_calls, format_attempt

logger = logging.getLogger(__name__)


# -- running a program ------------------------------------------------------------------------------------------------
def with_own_lms(program: dspy.Module, **overrides: Any) -> dspy.Module:
    """A deep copy of `program` whose predictors call private copies of their LMs (the predictor's own, else
    `dspy.settings.lm`), with `overrides` (such as rollout_id, temperature) set on the copies. A temperature is not set
    on a model that takes only its own (`fixed_temperature`)."""
    program = program.deepcopy()
    copies: dict[int, dspy.BaseLM] = {}
    for name, predictor in program.named_predictors():
        base = predictor.lm or dspy.settings.lm
        if base is None:
            raise ValueError(f"predictor {name!r} has no LM: call dspy.configure(lm=dspy.LM(...)) or set one on it")
        if id(base) not in copies:
            keep = fixed_temperature(base) is not None
            copies[id(base)] = base.copy(**{k: v for k, v in overrides.items() if not (keep and k == "temperature")})
        predictor.lm = copies[id(base)]
    return program


def fixed_temperature(lm: dspy.BaseLM) -> float | None:
    """The temperature a model requires (OpenAI's o-series and gpt-5 reasoning models take only 1.0), else None."""
    family = str(getattr(lm, "model", "")).split("/")[-1].lower()
    reasoning = re.match(r"^(o[1345](-(mini|nano|pro))?(-\d{4}-\d{2}-\d{2})?|gpt-5(\.\d+)*(?!-chat)(-.*)?)$", family)
    return 1.0 if reasoning else None


def run_program(program: dspy.Module, example: dspy.Example) -> tuple[dspy.Prediction | None, Attempt]:
    """Run `program` on `example`'s inputs (an async-only program, with `aforward` and no `forward`, through its event
    loop). Returns the prediction (None when the program raised; the error is never raised) and the `Attempt`: its
    outputs or error, whether the error says it got no answer (`failed`) or a reply that did not parse (`unparsed`),
    the trace of every predictor call (name, inputs, outputs, whole), its tool calls and its text."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            if not hasattr(type(program), "forward") and hasattr(type(program), "aforward"):  # an async-only program
                prediction = asyncio.run(program.acall(**example.inputs()))
            else:
                prediction = program(**example.inputs())
    except Exception as exc:
        return None, _attempt(program, example, trace, None, exc)
    return prediction, _attempt(program, example, trace, prediction, None)


async def arun_program(program: dspy.Module, example: dspy.Example, workers: AsyncWorkers
                       ) -> tuple[dspy.Prediction | None, Attempt]:
    """`run_program` as a coroutine on the event loop of `workers`: through the program's `acall` (DSPy's async path to
    the LM) where it has `aforward`, else its `forward` on one of the workers' threads."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            if hasattr(type(program), "aforward"):
                prediction = await program.acall(**example.inputs())
            else:
                prediction = await workers.offload(program, **example.inputs())
    except Exception as exc:
        return None, _attempt(program, example, trace, None, exc)
    return prediction, _attempt(program, example, trace, prediction, None)


def _attempt(program: dspy.Module, example: dspy.Example, trace: list, prediction: Any,
             exc: Exception | None) -> Attempt:
    """One run of `program` (see `run_program`): what it returned, or the exception it raised."""
    outputs, error, failed, unparsed, bare = None, None, False, False, False
    if exc is None:
        bare = not isinstance(prediction, dspy.Prediction)  # None, a string: the metric gets it as it is
        outputs = {"returned": jsonable(prediction)} if bare else jsonable(dict(prediction.items()))
        if not bare:
            _say_untyped(output_types(program), prediction)
    else:
        error, cause = f"{type(exc).__name__}: {exc}", exc
        while cause is not None and not failed:  # the provider's failure or empty reply, wherever in the chain
            failed, unparsed = no_answer(cause), unparsed or isinstance(cause, AdapterParseError)
            cause = cause.__cause__ or cause.__context__
        unparsed = unparsed and not failed
    steps = [{"predictor": name, "inputs": jsonable(inputs), "outputs": jsonable(dict(out.items()))}
             for name, (_, inputs, out) in zip(predictor_names(program, trace), trace)]
    # the attempt as the learning calls read it, cut to MAX_ATTEMPT_CHARS (the runner says so)
    text = format_attempt(dict(example.inputs().items()), outputs, steps, error, limit=None)
    return Attempt(outputs=outputs, error=error, failed=failed, unparsed=unparsed, trace=steps,
                   tool_calls=count_tool_calls(outputs), text=clip(text, MAX_ATTEMPT_CHARS),
                   text_chars=len(text) if len(text) > MAX_ATTEMPT_CHARS else None, bare=bare,
                   prediction=None if exc is not None else prediction)


_SAID: set[str] = set()  # what this process has warned of once


def _say_once(key: str, message: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        logger.warning(message, *args)


def predictor_names(program: dspy.Module, trace: list) -> list[str]:
    """The name (`program.named_predictors()`) of the predictor of each call in `trace`. A wrapper that runs a copy of
    its module (dspy.BestOfN, dspy.Refine) calls predictors the program does not hold; a copy shares its original's
    signature, which names it. A call no predictor of the program can be told from keeps its class name (its demos
    reach nothing), said once."""
    named = program.named_predictors()
    by_id = {id(p): name for name, p in named}
    by_signature: dict[int, list[str]] = {}
    for name, p in named:
        by_signature.setdefault(id(p.signature), []).append(name)
    names = []
    for predictor, _, _ in trace:
        name = by_id.get(id(predictor))
        if name is None and len(found := by_signature.get(id(getattr(predictor, "signature", None)), [])) == 1:
            name = found[0]
        if name is None:
            name = type(predictor).__name__
            _say_once(f"unnamed {name}", "A call of a %s that is not among the program's predictors (named_predictors) "
                      "and shares no signature with exactly one of them: a demo of that call reaches no predictor",
                      name)
        names.append(name)
    return names


def output_types(program: dspy.Module) -> dict[str, Any]:
    """The type of each output field of the program's predictors (by field name; a later predictor's wins)."""
    return {name: f.annotation for _, p in program.named_predictors() for name, f in p.signature.output_fields.items()}


def _say_untyped(types: dict, prediction: dspy.Prediction) -> None:
    for name, value in prediction.items():
        if name not in types and value is not None and not isinstance(value, (str, int, float, bool, list, dict)):
            _say_once(f"untyped {name}", "The program's output %r (%s) is the output of no predictor's signature: an "
                      "attempt read back from log_dir gives the metric its JSON form (%s)", name,
                      type(value).__name__, type(jsonable(value)).__name__)


def typed(program: dspy.Module, attempt: Attempt) -> Attempt:
    """`attempt` (read back from a checkpoint or a Ray node) with its `prediction` rebuilt from the saved outputs as
    the program returned it (`rebuilt`, by the types of the program's output fields)."""
    if attempt.prediction is not None or attempt.outputs is None or attempt.bare:
        return attempt
    return dataclasses.replace(attempt, prediction=dspy.Prediction(**rebuilt(output_types(program), attempt.outputs)))


def rebuilt(types: dict[str, Any], outputs: dict) -> dict:
    """Saved `outputs` with each field of `types` validated to its type (pydantic's `TypeAdapter` of the annotation:
    a model, an Enum, a tuple, a date), any other as saved. One that does not validate is kept as saved, said once."""
    values = dict(outputs)
    for name, value in outputs.items():
        if name in types and value is not None and types[name] not in (str, Any):
            try:
                values[name] = pydantic.TypeAdapter(types[name]).validate_python(value)
            except Exception as exc:  # noqa: BLE001 - said, and the saved value used
                _say_once(f"rebuild {name}", "The saved output %r does not rebuild to its type %s (%s): the metric "
                          "gets it as saved", name, types[name], str(exc).splitlines()[0])
    return values


async def arun_attempt(program: dspy.Module, example: dspy.Example, workers: AsyncWorkers) -> Attempt:
    """`run_program`'s attempt as a coroutine (`arun_program`)."""
    return (await arun_program(program, example, workers))[1]


def _no_answer(example: dspy.Example, error: str) -> Attempt:
    """An attempt that got no answer because it never ran to the end (a Ray task lost with its node)."""
    return Attempt(outputs=None, error=error, failed=True, trace=[], tool_calls=0,
                   text=format_attempt(dict(example.inputs().items()), None, [], error))


EMPTY_REPLY = "The LM returned an empty or null response"  # what DSPy's adapters raise for a reply with no content


def no_answer(exc: BaseException) -> bool:
    """Whether `exc` says the provider gave no answer: an LM call that failed, or a reply with nothing to parse (DSPy's
    adapters raise an `AdapterParseError` for no choices, or an empty content such as a content filter leaves)."""
    return isinstance(exc, LMError) or (isinstance(exc, AdapterParseError) and EMPTY_REPLY in str(exc))


# what a reply with nothing to read held (`empty_reply`), and the fix that fits it
EMPTY_REPLIES = {
    "no choices": "the provider sent no choices at all (a fault on its side, an outage or a refusal): a resume asks "
                  "again; check the provider's status",
    "filtered": "the provider's content filter emptied the reply (finish_reason content_filter): asked again, the same "
                "prompt is likely filtered again; see what the learning prompts quote (the task inputs and attempts)",
    "reasoning, cut": "the model put all of its reply in its reasoning (reasoning_content) and was cut at max_tokens "
                      "before any content: give the reflection LM more max_tokens, or lower its reasoning effort",
    "reasoning": "the model put all of its reply in its reasoning (reasoning_content), none in its content: use a "
                 "reflection model that answers in its content, or lower its reasoning effort",
    "cut": "the reply was cut at max_tokens before any content (finish_reason length): give the reflection LM more "
           "max_tokens",
    "empty": "the provider sent an empty content (finish_reason stop): a fault on its side; a resume asks again",
}


def empty_reply(history: list[dict]) -> str | None:
    """Which of `EMPTY_REPLIES` the last reply with nothing to read in `history` (DSPy's records of LM calls, a
    response each: DSPy's own or LiteLLM's) was, or None where none was empty or none was recorded."""
    def get(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    for entry in reversed(history):
        if _holds_text(entry.get("outputs") or []):
            continue  # a reply with something in it
        response = entry.get("response")
        raw = get(response, "provider_data") if isinstance(get(response, "provider_data"), dict) else response
        choices = get(raw, "choices")
        if isinstance(choices, list) and not choices:
            return "no choices"
        choice = choices[0] if choices else None
        finish = get(choice, "finish_reason") if choice is not None else get(response, "finish_reason")
        parts = get(get(response, "message"), "parts") or ()
        thought = get(get(choice, "message"), "reasoning_content") or any(get(p, "type") == "thinking" for p in parts)
        if finish == "content_filter":
            return "filtered"
        if thought:
            return "reasoning, cut" if finish == "length" else "reasoning"
        return "cut" if finish == "length" else "empty"
    return None


def answered(record: Any) -> bool:
    """Whether a reply DSPy caches (`dspy.cache`: its own record of a call, or a provider's raw response) holds
    anything: a text or a tool call in some choice. A record of another kind (an embedding) counts as answered."""
    if isinstance(record, dict) and "_dspy_format" in record:
        outputs = record.get("outputs") or []
    else:
        choices = record.get("choices") if isinstance(record, dict) else getattr(record, "choices", None)
        if choices is None:
            return True
        outputs = []
        for choice in choices:
            message = (choice.get("message") if isinstance(choice, dict) else getattr(choice, "message", None)) or {}
            if not isinstance(message, dict):  # a LiteLLM response's Message
                message = {"content": getattr(message, "content", None), "tool_calls": getattr(message, "tool_calls",
                                                                                              None)}
            outputs.append({"text": message.get("content"), "tool_calls": message.get("tool_calls")})
    return _holds_text(outputs)


def _holds_text(outputs: list) -> bool:
    """Whether some output of an LM call (DSPy's outputs: a text, or a dict with "text" and "tool_calls") has a text or
    a tool call in it."""
    return any(bool(o.strip()) if isinstance(o, str) else
               isinstance(o, dict) and bool((o.get("text") or "").strip() or o.get("tool_calls")) for o in outputs)


def guard_cache() -> None:
    """Keep replies with nothing in them (no choices, an empty content) out of DSPy's cache, and pass over one an
    earlier run left there: a retry or a resume after such a reply asks the provider again, where DSPy would serve
    the empty reply back from its cache forever. Installed on `dspy.cache` once (each compile checks)."""
    cache = dspy.cache
    if getattr(cache.put, "tfgrpo_guard", False):
        return
    put, get = cache.put, cache.get

    def guarded_put(request, value, *args, **kwargs):
        if answered(value):
            put(request, value, *args, **kwargs)

    def guarded_get(request, *args, **kwargs):
        value = get(request, *args, **kwargs)
        return value if value is None or answered(value) else None

    guarded_put.tfgrpo_guard = True
    cache.put, cache.get = guarded_put, guarded_get


def rollout_id(*parts) -> int:
    """A stable rollout ID for DSPy's cache and the provider's sampling, from `parts` (seed, step, attempt)."""
    return int(digest(list(parts)), 16) % 2**31


@dataclass
class StageBars:
    """A tqdm bar per stage on stderr, as DSPy draws its own: the progress callback when the caller gives none, for the
    overlapping stages of a pipelined step (a stage's total may grow as groups reach it); `close()` them when it is
    over. Drawn only when stderr is a terminal: in a log file or CI a redrawn bar is a stream of escape codes.
    `resumed=True` takes a stage's first report for work done before (a resume's), not for progress, so that the rate
    and ETA count from it (the whole run's bar)."""

    resumed: bool = False
    bars: dict = field(default_factory=dict)  # stage -> its tqdm bar

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.bars:
            self.bars[stage] = tqdm.tqdm(total=total, desc=stage, dynamic_ncols=True, file=sys.stderr,
                                         disable=not sys.stderr.isatty(), initial=done if self.resumed else 0)
        bar = self.bars[stage]
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


class DaemonPool:
    """A fixed pool of daemon threads with `ThreadPoolExecutor`'s submit and shutdown. The standard pool's threads
    are joined when the interpreter exits, so one call that hangs (a metric, a tool) would keep a stopped run alive
    forever; these threads are abandoned instead, and a Ctrl-C ends the process at once."""

    def __init__(self, num_threads: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"tfgrpo-worker-{i}")
                         for i in range(max(1, num_threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking work; `cancel_futures` cancels what has not started; `wait` waits for what runs."""
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


class Workers:
    """A bounded pool for the units of work of one stage or step: `map(stage, fn, items)` runs `fn` over `items` on at
    most `num_threads` threads in all and returns the results in order, and may be called from several threads at
    once (one per group of a step, `each`), so that a group's learning calls start while other groups still roll out.

    A unit runs with the caller's DSPy settings (the runner meters each unit itself); `progress(stage, done, total)`
    is told of each finished unit. Nothing is swallowed: the first unit that raises stops everything
    (units not started are cancelled, running ones finish) and its exception is raised by the `with` block's
    `map`/`each`; on Ctrl-C nothing is waited for: a unit that hangs is abandoned on its daemon thread."""

    def __init__(self, num_threads: int, *, progress: Callable[[str, int, int], None] | None = None):
        from dspy.dsp.utils.settings import thread_local_overrides

        self._overrides = thread_local_overrides
        self._parent = thread_local_overrides.get().copy()
        self._bars = StageBars() if progress is None else None
        self.progress = progress or self._bars
        self._pool, self._groups = DaemonPool(num_threads), None
        self._counts: dict[str, list[int]] = {}  # stage -> [done, submitted]
        self._lock = threading.Lock()
        self._stopped = False  # a unit failed: nothing more is started

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, error, tb) -> None:
        interrupted = kind is not None and issubclass(kind, KeyboardInterrupt)
        for pool in (self._pool, self._groups):
            if pool is not None:  # never wait on Ctrl-C; after an error, wait for running units (they finish)
                pool.shutdown(wait=not interrupted, cancel_futures=kind is not None)
        if self._bars is not None:
            self._bars.close()

    def _in_context(self, fn: Callable, overrides: dict) -> Callable:
        def run(*args):
            token = self._overrides.set(overrides)
            try:
                return fn(*args)
            finally:
                self._overrides.reset(token)
        return run

    def map(self, stage: str, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]`, run on the pool, in order."""
        overrides = self._overrides.get().copy()
        with self._lock:
            if self._stopped:
                raise Cancelled()
            self._counts.setdefault(stage, [0, 0])[1] += len(items)
            futures = [self._pool.submit(self._in_context(fn, overrides), item) for item in items]
        results = []
        for future in futures:
            try:
                results.append(future.result())  # a unit that raised stops the caller here
            except CancelledError:  # cancelled because another unit failed: that one's error is raised instead
                raise Cancelled() from None
            with self._lock:
                self._counts[stage][0] += 1
                self.progress(stage, *self._counts[stage])  # one at a time: bars and callbacks need no lock
        return results

    def each(self, fn: Callable, items: list) -> list:
        """`[fn(item) for item in items]`, each item on a thread of its own (a group of a step: it waits on its units,
        which run on the bounded pool), in order; the first that raises stops the others' units not yet started, and
        is raised here once the rest have ended."""
        if self._groups is None:
            self._groups = DaemonPool(max(1, len(items)))
        futures = [self._groups.submit(self._in_context(fn, self._parent.copy()), item) for item in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            with self._lock:
                self._stopped = True
            self._pool.shutdown(wait=False, cancel_futures=True)  # the other items end with their units
            wait(futures)
            raise next((f.exception() for f in futures if f.exception() is not None
                        and not isinstance(f.exception(), Cancelled)), failed.exception())
        return [f.result() for f in futures]


class Cancelled(Exception):
    """A unit of work was cancelled because another one failed: the failure that caused it is raised instead."""


class AsyncWorkers(Workers):
    """`backend="async"`: a scope's attempts as coroutines on one event loop (a thread of its own), up to `in_flight`
    at once, each through DSPy's async path to the LM (`arun_program`), so that hundreds of attempts can wait on a
    provider without a thread each. `gather(stage, fns)` runs coroutine functions there; everything else keeps
    `Workers`' verbs on its pool of `in_flight` threads: the metric, a program with only `forward`, the learning calls
    (`map`; tfgrpo's learning modules have no async path), the groups side by side (`each`). The same rules hold: a
    unit runs with the caller's DSPy settings, the first unit that raises stops the units not yet
    started and is raised by its `gather`, and on Ctrl-C nothing is waited for."""

    def __init__(self, in_flight: int, *, progress: Callable[[str, int, int], None] | None = None):
        super().__init__(in_flight, progress=progress)
        self.loop = asyncio.new_event_loop()
        # LiteLLM builds each async request on the loop's default executor (`run_in_executor`); at its default size
        # (6 threads on 2 cores) hundreds of requests queue there for seconds after their pacer start: one thread each
        self._builders = ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="tfgrpo-litellm")
        self.loop.set_default_executor(self._builders)
        self._slots = asyncio.Semaphore(max(1, in_flight))
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="tfgrpo-async")
        self._thread.start()

    def __exit__(self, kind, error, tb) -> None:
        if kind is None or not issubclass(kind, KeyboardInterrupt):  # after an error, running units finish
            asyncio.run_coroutine_threadsafe(self._drain(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._builders.shutdown(wait=False, cancel_futures=True)
        super().__exit__(kind, error, tb)

    @staticmethod
    async def _drain() -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.gather(*others, return_exceptions=True)

    def gather(self, stage: str, fns: list[Callable[[], Any]]) -> list:
        """`[await fn() for fn in fns]`, the coroutines side by side on the loop (at most `in_flight` of the scope's at
        once), in order; called from any thread, which waits for them."""
        overrides = self._overrides.get().copy()
        with self._lock:
            if self._stopped:
                raise Cancelled()
            self._counts.setdefault(stage, [0, 0])[1] += len(fns)
        futures = [asyncio.run_coroutine_threadsafe(self._unit(stage, fn, overrides), self.loop) for fn in fns]
        try:
            return [future.result() for future in futures]  # a unit that raised stops the caller here
        except BaseException:
            with self._lock:
                self._stopped = True
            raise

    async def _unit(self, stage: str, fn: Callable[[], Any], overrides: dict) -> Any:
        async with self._slots:
            if self._stopped:  # another unit failed while this one waited for a slot
                raise Cancelled()
            token = self._overrides.set(overrides)
            try:
                value = await fn()
            finally:
                self._overrides.reset(token)
        with self._lock:
            self._counts[stage][0] += 1
            self.progress(stage, *self._counts[stage])
        return value

    async def offload(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` on one of the pool's threads, in the calling coroutine's context, without holding the
        loop."""
        context = contextvars.copy_context()
        return await asyncio.wrap_future(self._pool.submit(functools.partial(context.run, fn, *args, **kwargs)))


class RayAttempts:
    """The attempts of a run as Ray tasks: `attempt` returns `run_program`'s attempt, run on any node of the
    cluster (RAY_ADDRESS, else the one `ray.init()` finds or starts; a cluster the caller connected to is used as it
    is). What travels: the program (its LM copies with their settings), the example, and DSPy's `lm` and `adapter`
    settings; what comes back: the attempt (its outputs, rebuilt here to their types for the metric, which runs on
    this machine) and the usage of its LM calls, metered here as a local call is. A task whose worker or node dies is
    sent again by Ray (`max_retries`); lost for good, it is an attempt with no answer (`failed`, never scored), as a
    failed LM call is. The program's classes must import on the nodes: tfgrpo's do wherever it is installed; a class
    of the caller's own module needs that module there (installed, or Ray's `runtime_env`), except a file the CLI
    imported by its path, whose code travels by value. Before the first task, each node's tfgrpo, DSPy and Python
    versions are compared with this process's: a node with others is refused unless `other_versions`."""

    max_retries = 3  # sends of one task whose worker or node died, after the first

    def __init__(self, prices: dict | None = None, *, other_versions: bool = False):
        try:
            import ray
        except ImportError:
            raise ImportError('backend="ray" needs Ray on this machine and the nodes: pip install -e ".[ray]" in a '
                              "clone of tfgrpo") from None
        if not ray.is_initialized():
            _check_address()
            _token_auth_if_any()
            ray.init(logging_level="WARNING")
        for name, module in list(sys.modules.items()):  # a program or metric file the CLI imported by its path has
            if name.startswith(USER_MODULE_PREFIX):  # a name the nodes cannot import: its code travels by value
                ray.cloudpickle.register_pickle_by_value(module)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        logger.info("backend ray: attempts run as tasks on %d node(s), %g CPU(s) (%s)", len(nodes),
                    ray.cluster_resources().get("CPU", 0), ray.get_runtime_context().gcs_address)
        _check_versions(ray, nodes, other_versions)
        self._ray, self.prices = ray, prices
        self._task = ray.remote(_remote_attempt).options(max_retries=self.max_retries, retry_exceptions=False)
        self._lock, self._running = threading.Lock(), set()

    def attempt(self, program: dspy.Module, example: dspy.Example) -> Attempt:
        settings = {"lm": dspy.settings.lm, "adapter": dspy.settings.adapter}
        if paced(settings["lm"]) or any(paced(p.lm) for p in program.predictors()):
            raise ValueError('backend="ray" sends the attempts\' calls from the nodes, where a RequestPacer '
                             "(max_requests_per_minute) paces nothing: leave it off and let the provider's 429s and "
                             'num_retries pace the run, or use backend="threads"')
        try:
            ref = self._task.remote(program, example, settings, self.prices)
        except Exception as exc:  # the program does not pickle (Ray's message is long and names neither the part nor
            part = unpicklable(program, "program", self._ray.cloudpickle.dumps)  # its type): said in one line first
            if part is None:
                raise
            raise TypeError(f'backend="ray" sends the program to the nodes, and {part} does not pickle: keep it out of '
                            f"the program (build it inside forward, or hold it in a module-level object), or use "
                            f'backend="threads" ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})') from exc
        with self._lock:
            self._running.add(ref)
        try:
            attempt, usage = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:  # the task's own error (a program that cannot unpickle)
            raise exc.as_instanceof_cause() from None
        except self._ray.exceptions.RayError as exc:  # its worker or node died more than max_retries times
            attempt, usage = _no_answer(example, f"RayTaskLost: {type(exc).__name__}: {exc}"), {}
        finally:
            with self._lock:
                self._running.discard(ref)
        if dspy.settings.usage_tracker is not None:  # the unit's own meter
            dspy.settings.usage_tracker.absorb(usage)
        return typed(program, attempt)

    def cancel(self) -> None:
        """End the tasks still running (Ctrl-C on the driver)."""
        with self._lock:
            running, self._running = list(self._running), set()
        for ref in running:
            try:
                self._ray.cancel(ref, force=True)
            except Exception as exc:  # noqa: BLE001 - a task that ended meanwhile; Ctrl-C goes on stopping the run
                logger.debug("ray.cancel: %s", exc)


def versions() -> dict[str, str]:
    """What a Ray node must share with the driver: tfgrpo's version (as installed), DSPy's and Python's."""
    return {"tfgrpo": installed_version("tfgrpo"), "dspy": dspy.__version__, "python": platform.python_version()}


def _check_versions(ray: Any, nodes: list[dict], other_versions: bool) -> None:
    """Each node's `versions()`, from a task pinned to it (on the job's runtime_env), against the driver's: a node
    with others is refused (RuntimeError naming it), or with `other_versions` said once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here, probe = versions(), ray.remote(num_cpus=0)(versions)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    differ = []
    for node, ref in zip(nodes, refs):
        try:
            found = ray.get(ref, timeout=60)
        except ray.exceptions.TaskUnschedulableError:  # a node the cluster still lists that has left it
            continue
        if found != here:
            differ.append(f"{node.get('NodeManagerAddress', node['NodeID'])} has {found}")
    if not differ:
        return
    said = f"this process has {here}, but " + "; ".join(differ)
    if not other_versions:
        raise RuntimeError(f'backend="ray": {said}. Install the same tfgrpo, DSPy and Python on every node (or give '
                           "them through ray.init(runtime_env=...)), or pass ray_other_versions=True to run there all "
                           "the same")
    logger.warning('backend="ray": %s; running there as ray_other_versions=True asks', said)


def _check_address() -> None:
    """Before `ray.init()`: the cluster it would join (RAY_ADDRESS, else the address file a cluster leaves in
    /tmp/ray, which a cluster killed without `ray stop` leaves behind) answers, else a ConnectionError at once that
    names the address and the fix (where ray.init would retry it for minutes)."""
    import ray._private.utils as ray_utils

    given = os.environ.get("RAY_ADDRESS")
    address, source = (given, "RAY_ADDRESS") if given else (ray_utils.read_ray_address(), "/tmp/ray/ray_current_cluster")
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except (OSError, ValueError):
        fix = "start the cluster (`ray start --head`), or unset RAY_ADDRESS to have a local one started" if given \
            else "the cluster that wrote it is gone: run `ray stop --force` (or delete the file) to have a local one " \
                 "started, or start one with `ray start --head`"
        raise ConnectionError(f'backend="ray": no Ray cluster answers at {address} (from {source}): {fix}') from None


def _token_auth_if_any() -> None:
    """With RAY_AUTH_MODE unset and a Ray token at hand (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH),
    connect with token authentication, as `ray start --head` turns it on for its cluster where a token is at hand
    (a driver that connects without it is refused: InvalidAuthToken). RAY_AUTH_MODE set is used as it is."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def unpicklable(value: Any, path: str, dumps: Callable, depth: int = 0) -> str | None:
    """The deepest part of `value` that does not pickle, as "path (type)": its attributes, items and elements looked
    into in turn; None when `value` pickles."""
    try:
        dumps(value)
        return None
    except Exception:  # noqa: BLE001 - what does not pickle is what is looked for
        pass
    if isinstance(value, dict):
        parts = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        parts = [(f"{path}.{k}", v) for k, v in getattr(value, "__dict__", {}).items()]
    for where, part in parts if depth < 8 else ():
        if (found := unpicklable(part, where, dumps, depth + 1)) is not None:
            return found
    return f"{path} ({type(value).__module__}.{type(value).__qualname__})"


_WORKER_PRICES: dict[str, dict] = {}  # a Ray worker's price lookups by the run's `prices`, kept for its later tasks


def _remote_attempt(program: dspy.Module, example: dspy.Example, settings: dict, prices: dict | None
                    ) -> tuple[Attempt, dict]:
    """A Ray task's body: the attempt (without its prediction, which need not unpickle on the driver) and its LM
    calls' usage (`UsageMeter.usage_data`)."""
    meter = UsageMeter(_WORKER_PRICES.setdefault(digest(prices), {}), custom=prices)
    with dspy.context(usage_tracker=meter, **settings):
        attempt = run_program(program, example)[1]
    return dataclasses.replace(attempt, prediction=None), dict(meter.usage_data)
