"""The run's record: every LM call a compile makes, kept in `log_dir/calls.jsonl` as it returns, with its usage and
price. A run is a function of its LM replies, so the record is what a resume needs: a second compile on the same
log_dir runs the same code (the program's Python, its tools, the metric), each request answered before is answered
from the record at no cost, and only new requests are sent. The record is also the run's ledger: what a run has spent
is the sum of it, and the budget reads it before every call.

How a call finds the record: one hook on DSPy's `execution.execute` and `aexecute` (`install`), where every call of
every `dspy.BaseLM` leaves, after DSPy's own request cache; each unit of work runs with a `Tag` in DSPy's settings
(`dspy.context(tfgrpo_call=...)`, which DSPy carries into its own threads: `dspy.Parallel`, `asyncify`) naming the
record, the scope (a step, a validation, the attribution) and the stage. So the program's calls, its metric's (an LLM
judge's) and the learning calls all pass there; a call made outside a tag passes untouched.

A request is known by DSPy's own cache key of it (the model, the messages, every setting and the `rollout_id`; the API
key and base left out), and by the unit of work that makes it (`Tag.unit`). The k-th identical request of a
process is answered by the k-th reply recorded for it: a resume gets back what the run got, and a program that asks the
same thing twice of an LM without a cache still gets two samples (two such calls made at once by one attempt may get
them the other way round, as they might have in the first run). A reply with nothing in it (no choices, an empty
content) is never recorded: a resume asks again.

One JSON object a line, appended and flushed as each call returns (a kill mid-write leaves a torn last line, dropped at
the next start; a line that does not parse is passed over, said once):
    {"key", "scope", "stage", "model", "usage": {...}, "cost", "reply"}   an LM call: `reply` is DSPy's own form of the
        result (`CallResult.dump()`); `cost` None where no price is known; `"free": true` where DSPy's cache answered
    {"metric": 1, "scope", "stage"}   an attempt the metric scored (what `max_metric_calls` counts); a scope's n-th is
        recorded once, so a resume that scores the scope's attempts again does not count them twice

The budget (`max_cost`, `max_total_tokens`, `max_metric_calls`) is charged before each call and each attempt: what the
record holds, plus what is in flight, plus this one's expected share (the mean of its stage's recorded calls, else of
all) must stay within each limit, else `BudgetExhausted`. The limits hold over any number of resumes, the metric's
calls included.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dspy

from tfgrpo.optimizers.spend import call_cost, model_price, totals, usage_of

logger = logging.getLogger(__name__)

FILE = "calls.jsonl"
TAG = "tfgrpo_call"  # the DSPy setting a unit of work runs under (`Tag`)
# whose calls a stage's are: the program's ("policy"), the metric's (an LLM judge's); every other stage is a learning
# path's: "reflection"
ROLE = {"rollout": "policy", "reward": "metric", "probe": "policy", "validation": "policy", "attribution": "policy"}
LIMITS = {"cost": "max_cost", "tokens": "max_total_tokens", "metric_calls": "max_metric_calls"}


def role(stage: str) -> str:
    """Whose calls a stage's are: "policy", "metric" or "reflection" (see `ROLE`)."""
    return ROLE.get(stage, "reflection")


class BudgetExhausted(BaseException):
    """The next call would pass `max_cost`, `max_total_tokens` or `max_metric_calls`: the run stops there, with every
    reply kept, and a resume with a larger budget goes on from it. A BaseException, as `KeyboardInterrupt` is: it
    stops the run from inside the program's own code (a `dspy.BestOfN` or a `try` of yours would take an Exception
    for one try's failure and go on)."""


class RecordError(BaseException):
    """The run's record could not be written (a full disk, a folder where the file should be): the run stops, and
    compile raises the `OSError` itself (`error`). A BaseException on its way up, as `BudgetExhausted` is: no `except
    Exception` of the program takes it for one call's failure."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Tag:
    """What a unit of work's LM calls are charged and recorded to: the record, the scope and the stage; and `unit`,
    which tells it from the other units (an attempt: its example and its LMs' rollout IDs; a learning call: its place
    among the calls made with it), so that a request two units both make (a predictor built inside `forward`, on the
    configured LM; a `rollout_id` the program sets itself; the summaries of two attempts alike) is answered, on a
    resume, as it was for each."""

    record: Record
    scope: str
    stage: str
    unit: str | None = None


class Record:
    """The calls of a run (see the module docstring), read from `root/calls.jsonl` when it exists (None: kept in
    memory only), and the budget of `limits` (knob name -> limit or None)."""

    def __init__(self, root: str | Path | None = None, limits: dict | None = None, prices: dict | None = None):
        self.path = Path(root) / FILE if root is not None else None
        self.limits = {name: (limits or {}).get(knob) for name, knob in LIMITS.items()}
        self.custom_prices, self._prices = prices, {}
        self._lock = threading.Lock()
        self._replies: dict[str, list[dict]] = collections.defaultdict(list)  # key -> its replies, in order
        self._asked: collections.Counter = collections.Counter()  # key -> requests of it this process made
        self.calls: list[dict] = []  # every LM call's entry without its reply, in order; `loaded` were there before
        self.loaded = 0
        self._scored = collections.Counter()  # scope -> attempts scored, as recorded
        self._charged = collections.Counter()  # scope -> attempts charged in this process
        self.spent = {"cost": 0.0, "tokens": 0, "metric_calls": 0}
        self.in_flight = {"cost": 0.0, "tokens": 0, "metric_calls": 0}
        self._paid: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0])  # stage -> calls, cost, tokens
        self.served = 0  # replies answered from the record in this process
        self._direct = False  # the program has called an LM outside its predictors (said once)
        self.closed = False  # the compile has ended: a call still running (a hung one) records nothing more
        self.lines: list[str] | None = None  # on a Ray node: the lines of the calls made, for the driver to record
        self._file = None
        if self.path is not None and self.path.exists():
            self._load()

    @classmethod
    def answering(cls, replies: dict[str, list[dict]]) -> Record:
        """An attempt's record on a Ray node: it answers from `replies` (by key, as `replies_of` gives them) and keeps
        the lines of the calls it sends (`lines`); no budget."""
        record = cls(None)
        record._replies.update(replies)
        record.lines = []
        return record

    # -- the file ---------------------------------------------------------------------------------------------------
    def _load(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a write cut by a kill: the torn line goes
            data = data[: data.rfind(b"\n") + 1]
            with open(self.path, "r+b") as f:
                f.truncate(len(data))
        unreadable = 0
        for line in data.splitlines():
            try:
                entry = json.loads(line)
                self._add(entry)
            except (ValueError, KeyError, TypeError, AttributeError):
                unreadable += 1
        if unreadable:
            logger.warning("%s: %d line(s) do not read as calls of a run and are passed over (their requests are "
                           "asked again)", self.path, unreadable)
        self.loaded = len(self.calls)

    def _add(self, entry: dict) -> None:
        """Count an entry into the ledger (and its reply into those the record answers with); under the lock."""
        if entry.get("metric"):
            self._scored[str(entry["scope"])] += 1
            self.spent["metric_calls"] += 1
            return
        reply = entry.pop("reply")
        if not isinstance(reply, dict) or not isinstance(entry["key"], str):
            raise ValueError("not a call")
        self._replies[entry["key"]].append(reply)
        self.calls.append(entry)
        if not entry.get("free"):
            cost, tokens, paid = entry.get("cost") or 0.0, _tokens(entry["usage"]), self._paid[entry["stage"]]
            self.spent["cost"] += cost
            self.spent["tokens"] += tokens
            paid[0], paid[1], paid[2] = paid[0] + 1, paid[1] + cost, paid[2] + tokens

    def sync(self) -> None:
        """Have the file on disk (before a step's record says the step is done)."""
        with self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- replies ----------------------------------------------------------------------------------------------------
    def answer(self, key: str) -> dict | None:
        """The recorded reply to this process's next request of `key`, or None (it is to be sent)."""
        with self._lock:
            k, self._asked[key] = self._asked[key], self._asked[key] + 1
            replies = self._replies.get(key, ())
            if k < len(replies):
                self.served += 1
                return replies[k]
        return None

    def replies_of(self, scope: str) -> dict[str, list[dict]]:
        """The replies recorded for calls of `scope`, by key (what a Ray node needs to answer a resumed attempt)."""
        with self._lock:
            keys = {c["key"] for c in self.calls if c["scope"] == scope}
            return {key: list(self._replies[key]) for key in keys}

    def keep(self, tag: Tag, key: str | None, model: str, result: Any, share: dict | None) -> dict | None:
        """A call has returned (`result`, DSPy's `CallResult`; None: it raised): its share leaves the flight and, where
        the reply holds something, it is recorded and its usage spent. The entry, or None."""
        entry = None
        if role(tag.stage) == "policy" and not any(isinstance(m, dspy.Predict) for m in dspy.settings.caller_modules
                                                   or []):
            self._say_direct()
        if result is not None and key is not None and holds_text(result.outputs):
            entry = {"key": key, "scope": tag.scope, "stage": tag.stage, "model": model,
                     "usage": {} if result.cache_hit else usage_of(result.usage), "cost": None, "reply": result.dump()}
            if result.cache_hit:
                entry["free"] = True
        return self.take(entry, share)

    def _say_direct(self) -> None:
        """Say once that the program called an LM outside its predictors (a call of the metric's may do so freely)."""
        with self._lock:
            said, self._direct = self._direct, True
        if not said:
            logger.warning("The program called an LM outside its predictors (dspy.settings.lm(...) or an LM of its own, "
                           "called directly): tfgrpo puts what it learns into the predictors' instructions and demos, "
                           "so those calls get none of it. Make them through a dspy.Predict to have them learn too.")

    def take(self, entry: dict | None, share: dict | None = None) -> dict | None:
        """Record a call's `entry` (priced here: its `cost`; None: nothing to record) and release `share`."""
        if entry is not None and not entry.get("free"):
            if entry["model"] not in self._prices:
                self._prices[entry["model"]] = model_price(entry["model"], self.custom_prices)
            entry["cost"] = call_cost(self._prices[entry["model"]], entry["usage"])
        line = json.dumps(entry, ensure_ascii=False, default=str) if entry is not None else None
        with self._lock:
            for name, value in (share or {}).items():
                self.in_flight[name] -= value
            if entry is not None:
                self._add(json.loads(line))
                if self.path is not None and not self.closed:
                    self._write_line(line)
                if self.lines is not None:
                    self.lines.append(line)
        return entry

    def _write_line(self, line: str) -> None:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            raise RecordError(exc if exc.filename else type(exc)(exc.errno, exc.strerror, str(self.path))) from exc

    # -- the budget -------------------------------------------------------------------------------------------------
    def charge(self, stage: str, calls: int = 1) -> dict:
        """Before `calls` LM calls of `stage`: their expected share, now in flight; `BudgetExhausted` where it does not
        fit (nothing measured yet: the first calls of a run are the measurement)."""
        with self._lock:
            n, cost, tokens = self._paid[stage] if self._paid[stage][0] else \
                [sum(p[i] for p in self._paid.values()) for i in range(3)]
            share = {"cost": calls * cost / max(n, 1), "tokens": calls * tokens / max(n, 1)}
            for name in share:
                self._fits(name, share[name], stage)
            for name in share:
                self.in_flight[name] += share[name]
            return share

    def charge_attempt(self, scope: str) -> dict:
        """Before an attempt of `scope`: its metric call, now in flight; `BudgetExhausted` where it does not fit. The
        first attempts of a scope that the record holds as scored are the ones a resume scores again: free."""
        with self._lock:
            self._charged[scope] += 1
            if self._charged[scope] <= self._scored[scope]:
                return {}
            self._fits("metric_calls", 1, "")
            self.in_flight["metric_calls"] += 1
            return {"metric_calls": 1}

    def attempt_ended(self, scope: str, stage: str, share: dict, *, answered: bool) -> None:
        """An attempt charged with `share` has ended: with an answer, which the metric scores (a metric call made), or
        without (its LM call failed, or it was stopped)."""
        with self._lock:
            if share:
                self.in_flight["metric_calls"] -= 1
            if not answered:
                self._charged[scope] -= 1
            elif share:
                self._scored[scope] += 1
                self.spent["metric_calls"] += 1
                if self.path is not None and not self.closed:
                    self._write_line(json.dumps({"metric": 1, "scope": scope, "stage": stage}))

    def _fits(self, name: str, share: float, stage: str) -> None:
        limit = self.limits[name]
        if limit is not None and self.spent[name] + self.in_flight[name] + share > limit - (
                1e-12 if name == "cost" else 0) and (share or self.spent[name] >= limit):
            raise BudgetExhausted(self._why(name, stage, share))

    def reached(self, attempts: int = 0) -> str | None:
        """Why no more work fits (checked between steps): a budget is spent, or too little of one is left for the
        `attempts` the next step needs at least (each a metric call, at what an attempt, its calls and the metric's,
        has cost so far); else None."""
        with self._lock:
            scored = max(self.spent["metric_calls"], 1)
            spent = [p for stage, p in self._paid.items() if role(stage) != "reflection"]
            need = {"cost": attempts * sum(p[1] for p in spent) / scored,
                    "tokens": attempts * sum(p[2] for p in spent) / scored, "metric_calls": attempts}
            for name, limit in self.limits.items():
                if limit is not None and self.spent[name] >= limit:
                    return self._why(name, "", 0)
            for name, limit in self.limits.items():
                if limit is not None and need[name] and self.spent[name] + need[name] > limit:
                    return self._why(name, "", need[name], attempts)
        return None

    def _why(self, name: str, stage: str, share: float, attempts: int = 0) -> str:
        knob = LIMITS[name]
        show = (lambda v: f"${v:.4f}" if v >= 0.01 else f"${v:.6f}") if name == "cost" else (lambda v: f"{v:,.0f}")
        if attempts:  # the next step cannot be paid for
            left = show(self.limits[name] - self.spent[name])
            return (f"budget {knob}={self.limits[name]:g} cannot pay for another step: {left} left, a step needs "
                    f"~{show(share)} ({attempts} attempts: its rollouts, and a probe of the program and one edit, "
                    f"where it probes); more calls cannot pay")
        what = {"cost": "spent", "tokens": "tokens used", "metric_calls": "metric calls made"}[name]
        nxt = f"; the next {stage} call (~{show(share)}) would pass it" if stage else ""
        used = self.spent[name] + self.in_flight[name]  # (those in flight are as good as spent)
        return f"budget {knob}={self.limits[name]:g} reached: {show(used)} {what}{nxt}"

    # -- what was spent ---------------------------------------------------------------------------------------------
    def usage(self, *, scope: str | None = None, new: bool | None = None) -> dict[str, dict]:
        """Calls, tokens and dollars by stage (`totals`): of one `scope`, or all; `new`: only those this process sent
        (True) or only those recorded before it (False). A reply DSPy's cache gave is not counted."""
        with self._lock:
            calls = self.calls[self.loaded:] if new else self.calls[:self.loaded] if new is False else self.calls
            calls = [c for c in calls if not c.get("free") and (scope is None or c["scope"] == scope)]
        by_stage: dict[str, list[dict]] = {}
        for c in calls:
            by_stage.setdefault(c["stage"], []).append(c)
        return {stage: totals(entries) for stage, entries in by_stage.items()}

    def by_role(self, *, new: bool | None = None) -> dict[str, dict]:
        """`usage` summed by role ("policy", "reflection" and, where the metric calls an LM, "metric")."""
        roles: dict[str, dict] = {"policy": {}, "reflection": {}}
        for stage, used in self.usage(new=new).items():
            add_usage(roles.setdefault(role(stage), {}), used)
        return roles

    def scopes(self) -> set[str]:
        """The scopes the record holds calls of."""
        with self._lock:
            return {c["scope"] for c in self.calls} | set(self._scored)


def add_usage(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


def _tokens(usage: dict) -> int:
    return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)


def holds_text(outputs: Any) -> bool:
    """Whether an LM call's outputs (DSPy's: a text, or a dict with "text" and "tool_calls", per choice) hold a text
    or a tool call."""
    return any(bool(o.strip()) if isinstance(o, str) else
               isinstance(o, dict) and bool((o.get("text") or "").strip() or o.get("tool_calls")) for o in outputs or ())


# -- the hook ---------------------------------------------------------------------------------------------------------
def request_key(lm: Any, call: Any, tag: Tag) -> str | None:
    """The record's key of a call: DSPy's cache key of its request (the same for a sync and an async call), after the
    attempt's `unit`; None where DSPy cannot key it."""
    from dspy.clients.execution import IGNORED_CACHE_KEYS

    try:
        key = dspy.cache.cache_key(call.key(lm, False), IGNORED_CACHE_KEYS)
    except Exception:  # noqa: BLE001 - a request DSPy cannot key (it is sent, charged, and not recorded)
        return None
    return f"{tag.unit}/{key}" if tag.unit else key


def install() -> None:
    """Route every LM call made under a `Tag` through its record: answered from it, or charged, sent and kept.
    Installed once per process, on DSPy's `execution.execute` and `aexecute`."""
    from dspy.clients import execution
    from dspy.clients.call_result import CallResult

    if getattr(execution.execute, "tfgrpo_recorded", False):
        return
    execute, aexecute = execution.execute, execution.aexecute

    def recorded(lm, call):
        tag = dspy.settings.get(TAG)
        if tag is None:
            return execute(lm, call)
        key = request_key(lm, call, tag)
        if key is not None and (reply := tag.record.answer(key)) is not None:
            return CallResult.load(reply)
        share, result = tag.record.charge(tag.stage), None
        try:
            result = execute(lm, call)
        finally:
            tag.record.keep(tag, key, str(getattr(lm, "model", type(lm).__name__)), result, share)
        return result

    async def arecorded(lm, call):
        tag = dspy.settings.get(TAG)
        if tag is None:
            return await aexecute(lm, call)
        key = request_key(lm, call, tag)
        if key is not None and (reply := tag.record.answer(key)) is not None:
            return CallResult.load(reply)
        share, result = tag.record.charge(tag.stage), None
        try:
            result = await aexecute(lm, call)
        finally:
            tag.record.keep(tag, key, str(getattr(lm, "model", type(lm).__name__)), result, share)
        return result

    recorded.tfgrpo_recorded = arecorded.tfgrpo_recorded = True
    execution.execute, execution.aexecute = recorded, arecorded
