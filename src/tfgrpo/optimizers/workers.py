"""Where a run's attempts and other units run, and what an attempt runs: a program on an example (`run_program`).

The backend is chosen once per run (the `backend` knob) and is the one seam of concurrency: `Threads` runs every unit on
one pool of `num_threads` daemon threads; `Async` runs the attempts as coroutines on one event loop, hundreds in
flight, and the rest on its threads; `Ray` runs each attempt as a task on a Ray cluster, the rest on its threads.
Each unit runs in a copy of its caller's context (DSPy's settings, and the record's tag with them: record.py). The
step's `Scope` (runner.py) submits the units and waits for them.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import functools
import logging
import os
import platform
import queue
import re
import socket
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import dspy
import tqdm
from dspy.utils.exceptions import AdapterParseError, LMError

from tfgrpo.base.util import USER_MODULE_PREFIX, clip, digest, jsonable
from tfgrpo.optimizers.record import TAG, Record, Tag, holds_text, install
from tfgrpo.optimizers.records import Attempt
from tfgrpo.optimizers.spend import paced
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


async def arun_program(program: dspy.Module, example: dspy.Example, offload: Callable
                       ) -> tuple[dspy.Prediction | None, Attempt]:
    """`run_program` as a coroutine: through the program's `acall` (DSPy's async path to the LM) where it has
    `aforward`, else its `forward` on a thread (`offload(fn, **kwargs)`)."""
    trace: list = []
    try:
        with dspy.context(trace=trace):
            if hasattr(type(program), "aforward"):
                prediction = await program.acall(**example.inputs())
            else:
                prediction = await offload(program, **example.inputs())
    except Exception as exc:
        return None, _attempt(program, example, trace, None, exc)
    return prediction, _attempt(program, example, trace, prediction, None)


def _attempt(program: dspy.Module, example: dspy.Example, trace: list, prediction: Any,
             exc: Exception | None) -> Attempt:
    """One run of `program` (see `run_program`): what it returned (kept as it is for the metric), or the exception it
    raised; its outputs, trace and text as JSON-safe copies for the learning calls and the demos."""
    outputs, error, failed, unparsed, bare = None, None, False, False, False
    if exc is None:
        bare = not isinstance(prediction, dspy.Prediction)  # None, a string: the metric gets it as it is
        outputs = {"returned": jsonable(prediction)} if bare else jsonable(dict(prediction.items()))
    else:
        error, cause = f"{type(exc).__name__}: {exc}", exc
        while cause is not None and not failed:  # the provider's failure or empty reply, wherever in the chain
            failed, unparsed = no_answer(cause), unparsed or isinstance(cause, AdapterParseError)
            cause = cause.__cause__ or cause.__context__
        unparsed = unparsed and not failed
    steps = [{"predictor": name, "inputs": jsonable(inputs), "outputs": jsonable(dict(out.items()))}
             for name, (_, inputs, out) in zip(predictor_names(program, trace), trace)]
    completions = _completions(prediction) if exc is None and not bare else []
    # the attempt as the learning calls read it, cut to MAX_ATTEMPT_CHARS (the scope says so)
    text = format_attempt(dict(example.inputs().items()), outputs, steps, error, completions=completions, limit=None)
    return Attempt(outputs=outputs, error=error, failed=failed, unparsed=unparsed, trace=steps,
                   tool_calls=count_tool_calls(outputs), text=clip(text, MAX_ATTEMPT_CHARS),
                   text_chars=len(text) if len(text) > MAX_ATTEMPT_CHARS else None, bare=bare,
                   prediction=None if exc is not None else prediction)


def _completions(prediction: dspy.Prediction) -> list[dict]:
    """Every completion of a prediction that holds several (`dspy.Predict(..., n=3)`,
    `Prediction.from_completions`), as JSON-safe fields; [] for one."""
    completions = getattr(prediction, "completions", None)
    try:
        return [jsonable(dict(c.items())) for c in completions] if completions is not None and len(completions) > 1 \
            else []
    except (TypeError, AttributeError):  # a completions object of another shape
        return []


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
                      "and shares no signature with exactly one of them, as one built inside forward() is: neither the "
                      "library nor a demo reaches it. Declare it in __init__ (self.name = dspy.Predict(...)) to have "
                      "it learn", name)
        names.append(name)
    return names


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
        if holds_text(entry.get("outputs") or []):
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
    return holds_text(outputs)


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


class Cancelled(Exception):
    """A unit of work was cancelled because another one failed: the failure that caused it is raised instead."""


# -- the backends -----------------------------------------------------------------------------------------------------
def in_context(fn: Callable, *args) -> Callable[[], Any]:
    """`fn(*args)`, to run later (on another thread) in a copy of this thread's context: DSPy's settings, and the
    record's tag among them."""
    return functools.partial(contextvars.copy_context().run, fn, *args)


def backend(knobs: Any) -> Threads:
    """The run's backend, as the `backend` knob names it."""
    if knobs.backend == "async":
        return Async(knobs.num_threads)
    if knobs.backend == "ray":
        return Ray(knobs.num_threads, other_versions=knobs.ray_other_versions)
    return Threads(knobs.num_threads)


class Threads:
    """backend="threads": every unit of the run on one pool of `num_threads` daemon threads (`submit`; an attempt runs
    its program there, `run`), and each group of a step on a thread of its own (`spawn`), which waits on its units.
    Daemon threads: a call that hangs (a metric, a tool) never keeps a stopped run alive, and on Ctrl-C nothing is
    waited for."""

    def __init__(self, num_threads: int):
        self.pool = DaemonPool(num_threads)

    def submit(self, fn: Callable[[], Any]) -> Future:
        """`fn()` on the pool, in the caller's context."""
        return self.pool.submit(in_context(fn))

    @staticmethod
    def spawn(fn: Callable[[], Any]) -> Future:
        """`fn()` on a thread of its own, in the caller's context."""
        future: Future = Future()
        run = in_context(fn)

        def target():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(run())
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(exc)
        threading.Thread(target=target, daemon=True, name="tfgrpo-group").start()
        return future

    def submit_attempt(self, scope: Any, stage: str, program: dspy.Module, example: dspy.Example, *,
                       score: bool = False) -> Future:
        """`scope.attempt(...)` on the pool."""
        return self.submit(functools.partial(scope.attempt, stage, program, example, score=score))

    def run(self, program: dspy.Module, example: dspy.Example) -> Attempt:
        """One attempt of `program` on `example`."""
        return run_program(program, example)[1]

    def close(self, *, interrupted: bool = False) -> None:
        """The run is over: nothing more starts; after an error, the units running are waited for (never on
        Ctrl-C)."""
        self.pool.shutdown(wait=not interrupted, cancel_futures=True)


class Async(Threads):
    """backend="async": the attempts as coroutines on one event loop (a thread of its own), up to `num_threads` in
    flight, each through DSPy's async path to the LM (`arun_program`), so that hundreds of attempts can wait on a
    provider without a thread each; everything else (the metric, a program with only `forward`, the learning calls,
    the groups) on `Threads`' pool of `num_threads` threads. A coroutine runs in its submitter's context, as
    `asyncio.run_coroutine_threadsafe` carries it."""

    def __init__(self, num_threads: int):
        super().__init__(num_threads)
        self.loop = asyncio.new_event_loop()
        # LiteLLM builds each async request on the loop's default executor (`run_in_executor`); at its default size
        # (6 threads on 2 cores) hundreds of requests queue there for seconds after their pacer start: one thread each
        self._builders = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="tfgrpo-litellm")
        self.loop.set_default_executor(self._builders)
        self._slots = asyncio.Semaphore(max(1, num_threads))
        threading.Thread(target=self.loop.run_forever, daemon=True, name="tfgrpo-async").start()

    def submit_attempt(self, scope: Any, stage: str, program: dspy.Module, example: dspy.Example, *,
                       score: bool = False) -> Future:
        async def attempt():
            async with self._slots:
                return await scope.aattempt(stage, program, example, score=score)
        # a future of its own: cancelling it (the scope stopped) leaves a coroutine already running to finish
        future, running = Future(), asyncio.run_coroutine_threadsafe(attempt(), self.loop)
        running.add_done_callback(functools.partial(_settle, future))
        return future

    async def arun(self, program: dspy.Module, example: dspy.Example) -> Attempt:
        return (await arun_program(program, example, self.offload))[1]

    async def offload(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` on one of the pool's threads, in the calling coroutine's context, without holding the
        loop."""
        return await asyncio.wrap_future(self.submit(functools.partial(fn, *args, **kwargs)))

    def close(self, *, interrupted: bool = False) -> None:
        if not interrupted:  # after an error, the coroutines running finish
            asyncio.run_coroutine_threadsafe(self._drain(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._builders.shutdown(wait=False, cancel_futures=True)
        super().close(interrupted=interrupted)

    @staticmethod
    async def _drain() -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.gather(*others, return_exceptions=True)


def _settle(future: Future, source: Future) -> None:
    """Hand `source`'s outcome to `future`, unless `future` was cancelled."""
    if source.cancelled():
        future.cancel()
    elif future.set_running_or_notify_cancel():
        if source.exception() is not None:
            future.set_exception(source.exception())
        else:
            future.set_result(source.result())


class Ray(Threads):
    """backend="ray": each attempt a task on a Ray cluster (RAY_ADDRESS, else the one `ray.init()` finds or starts; a
    cluster the caller connected to is used as it is), `num_threads` in flight (a pool thread waits on each); the
    metric, the learning calls and the record stay in this process. What travels: the program (its LM copies with
    their settings), the example, DSPy's `lm` and `adapter` settings and the replies the record holds for the step;
    what comes back: the attempt, with what the program returned (the metric gets it as the program made it), and the
    task's LM calls, recorded and priced here. Each attempt is charged to the budget before it is sent, at what an
    attempt's calls have cost so far (the node's own calls cannot be stopped one by one). A task whose worker or node
    dies is sent again by Ray (`max_retries`); lost for good, it is an attempt with no answer (`failed`, never scored),
    as a failed LM call is. The program's classes must import on the nodes: tfgrpo's do wherever it is installed; a
    class of the caller's own module needs that module there (installed, or Ray's `runtime_env`), except a file the
    CLI imported by its path, whose code travels by value. Before the first task, each node's tfgrpo, DSPy and Python
    versions are compared with this process's: a node with others is refused unless `other_versions`."""

    max_retries = 3  # sends of one task whose worker or node died, after the first

    def __init__(self, num_threads: int, *, other_versions: bool = False):
        super().__init__(num_threads)
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
        self.nodes = _check_versions(ray, nodes, other_versions)
        self._ray = ray
        self._task = ray.remote(_remote_attempt).options(max_retries=self.max_retries, retry_exceptions=False)
        self._lock, self._running, self._shipped, self._calls = threading.Lock(), set(), {}, []

    def run(self, program: dspy.Module, example: dspy.Example) -> Attempt:
        tag = dspy.settings.get(TAG)
        settings = {"lm": dspy.settings.lm, "adapter": dspy.settings.adapter}
        if paced(settings["lm"]) or any(paced(p.lm) for p in program.predictors()):
            raise ValueError('backend="ray" sends the attempts\' calls from the nodes, where a RequestPacer '
                             "(max_requests_per_minute) paces nothing: leave it off and let the provider's 429s and "
                             'num_retries pace the run, or use backend="threads"')
        with self._lock:  # the replies recorded for the scope before this process: what a resumed attempt asks
            if tag.scope not in self._shipped:
                self._shipped[tag.scope] = self._ray.put(tag.record.replies_of(tag.scope))
            shipped, calls = self._shipped[tag.scope], max(1, round(sum(self._calls) / max(len(self._calls), 1)))
        share = tag.record.charge(tag.stage, calls)
        try:
            attempt, lines = self._send(program, example, settings, shipped, tag)
        finally:
            tag.record.take(None, share)
        for line in lines:
            tag.record.take(json.loads(line))
        with self._lock:
            self._calls.append(len(lines))
        return attempt

    def _send(self, program: dspy.Module, example: dspy.Example, settings: dict, shipped: Any, tag: Tag
              ) -> tuple[Attempt, list[str]]:
        try:
            ref = self._task.remote(program, example, settings, shipped, dataclasses.replace(tag, record=None))
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
            return self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:  # the task's own error (a program that cannot unpickle)
            raise exc.as_instanceof_cause() from None
        except self._ray.exceptions.RayError as exc:  # its worker or node died more than max_retries times
            return _no_answer(example, f"RayTaskLost: {type(exc).__name__}: {exc}"), []
        finally:
            with self._lock:
                self._running.discard(ref)

    def close(self, *, interrupted: bool = False) -> None:
        if interrupted:  # Ctrl-C ends the run's tasks on the cluster too
            with self._lock:
                running, self._running = list(self._running), set()
            for ref in running:
                try:
                    self._ray.cancel(ref, force=True)
                except Exception as exc:  # noqa: BLE001 - a task that ended meanwhile; Ctrl-C goes on stopping the run
                    logger.debug("ray.cancel: %s", exc)
        super().close(interrupted=interrupted)


def versions() -> dict[str, str]:
    """What a Ray node must share with the driver: the tfgrpo it imports (its version, and a digest of its source, so
    that a package shipped through `runtime_env` is told from the one installed), DSPy's version and Python's."""
    return {"tfgrpo": _package().__version__, "tfgrpo_code": source_digest(), "dspy": dspy.__version__,
            "python": platform.python_version()}


def _package() -> Any:
    """The tfgrpo package this module was imported from (the one a Ray node's runtime_env shipped, say)."""
    return sys.modules[__name__.split(".")[0]]


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of the source of the tfgrpo package this process imported (its .py files, by path and content)."""
    root = os.path.dirname(_package().__file__)
    files = sorted(os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root)
                   for name in names if name.endswith(".py"))
    return digest([[name, open(os.path.join(root, name), "rb").read().decode("utf-8", "replace")] for name in files])


def _check_versions(ray: Any, nodes: list[dict], other_versions: bool) -> dict[str, dict]:
    """Each node's `versions()`, from a task pinned to it (run as an attempt's task runs: on the job's runtime_env),
    against the driver's: a node with others is refused (RuntimeError naming it), or with `other_versions` said once.
    Returns each node's versions, by its address."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here, probe = versions(), ray.remote(num_cpus=0)(versions)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    differ, found = [], {}
    for node, ref in zip(nodes, refs):
        address = node.get("NodeManagerAddress", node["NodeID"])
        try:
            found[address] = ray.get(ref, timeout=60)
        except ray.exceptions.TaskUnschedulableError:  # a node the cluster still lists that has left it
            continue
        if found[address] != here:
            said = {k: v for k, v in found[address].items() if v != here.get(k)}
            differ.append(f"{address} has {said}")
    if not differ:
        return found
    said = f"this process has {here}, but " + "; ".join(differ)
    if not other_versions:
        raise RuntimeError(f'backend="ray": {said}. Install the same tfgrpo, DSPy and Python on every node (or give '
                           "them through ray.init(runtime_env=...)), or pass ray_other_versions=True to run there all "
                           "the same")
    logger.warning('backend="ray": %s; running there as ray_other_versions=True asks', said)
    return found


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


def _remote_attempt(program: dspy.Module, example: dspy.Example, settings: dict, replies: dict[str, list[dict]],
                    tag: Tag) -> tuple[Attempt, list[str]]:
    """A Ray task's body: the attempt, its calls answered from `replies` (the step's, as the driver's record holds
    them) where they ask the same, and the calls it sent, as the record's lines (the driver records and prices them).
    What the program returned must pickle to travel back: else a TypeError names the part that does not."""
    install()
    record = Record.answering(replies)
    with dspy.context(**settings, **{TAG: dataclasses.replace(tag, record=record)}):
        attempt = run_program(program, example)[1]
    import ray

    returned, dumps = attempt.prediction, ray.cloudpickle.dumps
    fields = returned.items() if isinstance(returned, dspy.Prediction) else [("", returned)]
    part = next((p for k, v in fields if (p := unpicklable(v, f"prediction.{k}" if k else "prediction", dumps))), None)
    if part is not None:
        raise TypeError(f'backend="ray" sends what the program returned back to the driver for the metric, and {part} '
                        f'does not pickle: return it in a form that does (its text, say), or use backend="threads"')
    return attempt, record.lines

