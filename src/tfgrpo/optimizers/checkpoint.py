"""What a run keeps in `log_dir` besides its record of LM calls: what it was started with, and what it finished.

Layout:
    run.json              what the run was started with (a fingerprint; a resume must match it), and with
                          backend="ray" the versions each node runs (`nodes`)
    calls.jsonl           every LM call of the run, with its reply, usage and price (record.py): what a resume reads
    steps/0003.json       step 3 is finished: the state after it (library, demos) and its record (`StepResult`)
    steps/0003.attempts.jsonl   its attempts (rollouts and probe): what each wrote, its reward; for people to read
    epochs/0.json         the validation after epoch 0
    worth.json            the attribution's result (`WorthResult`); refit.json, a refit's
    mlflow_run.json       the MLflow run the compile logs to (tfgrpo.tracking)

A finished step is reused whole; an unfinished one runs again, its LM calls answered from the record. Files are written
atomically (`tfgrpo.base.util.write_atomic`), so a kill at any moment leaves either the old state or the new one, never
a torn file (a kill mid-write leaves a hidden `.tmp` file, which the next start removes).

One compile at a time writes into a log_dir: two compiles writing into one folder would mix their work, and a later
resume would reuse that mixture without a word. `locked()` holds an exclusive `flock` on `<log_dir>/.lock` (`RunLock`)
for the compile's lifetime and writes who holds it (pid, host, command, since) into that file; a second compile is
refused at once with a `RunLockedError` naming the holder. The kernel drops a flock when its process dies, however it
dies, so a lock left by a killed run is simply taken over. The lock is re-entrant within one thread (the CLI holds it
around the whole command, the optimizer again around its compile); where `fcntl` is missing (Windows) nothing is locked.
On read-only storage a log_dir that holds a run is opened under a shared lock: a finished run is read (its steps
reused, no call made); one with work left stops at its first write, with the fix (copy the folder).
A saved file that does not parse (written by something else) is treated as absent and made again. run.json is
different: without it nothing says which settings the saved work was made with, so a log_dir that holds work but no
readable run.json is refused, never reused; and so is a log_dir an earlier tfgrpo wrote (one file per unit of work,
under steps/0003/), which this version cannot read.

A resume must match run.json on every fingerprinted setting: the knobs that change what a run computes (see
`knobs.py`), the data, the program's instructions and code (`code_fingerprint`), the metric (its name and code), the
target predictors, the starting library and the models of the policy and reflection LMs. Everything else
(num_threads, max_failure_rate, the budgets, progress, constrained_decoding, LM endpoints and keys) may change
between a run and its resume. A run.json beside no saved work protects nothing: a run that stopped before its first
call (a refusal, an outage in its first calls) never blocks the corrected run, whose settings replace it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tfgrpo.base.util import digest, remove_stale_tmp, write_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)


class RunMismatchError(ValueError):
    """The log_dir holds a run started with other settings or data (`changes`: one line per difference), or saved
    units whose settings are unknown (no readable run.json; `changes` is empty)."""

    def __init__(self, message: str, changes: list[str] | None = None):
        super().__init__(message)
        self.changes = changes or []


class Keys:
    """Where the run's own files are (paths under log_dir, without `.json`): the layout above, in one place."""

    step = "steps/{:04d}".format  # (step): a finished step
    attempts = "steps/{:04d}.attempts".format  # (step): its attempts, one a line
    epoch = "epochs/{}".format  # (epoch): its validation
    worth, refit = "worth", "refit"


class Checkpoint:
    def __init__(self, log_dir: str | Path | None):
        self.root = Path(log_dir) if log_dir is not None else None
        self.closed = False  # set when the compile ends: a worker still running (a hung call) writes nothing more

    @contextlib.contextmanager
    def locked(self):
        """Hold the log_dir's lock while the block runs (a second compile on it is refused with `RunLockedError`);
        when the block ends, however it ends, nothing more is written."""
        try:
            with RunLock(self.root):
                yield self
        finally:
            self.closed = True

    def check(self, fingerprint: dict[str, Any], *, other_versions: bool = False, quiet: bool = False) -> dict:
        """What a run of this fingerprint would go on from (`saved`), read without writing anything (the plan's check).

        Raises `RunMismatchError` naming each setting that differs (old -> new), when the folder holds work but its
        run.json is missing or unreadable (its settings are then unknown), and when an earlier tfgrpo wrote it. The
        versions that make the prompts (tfgrpo, DSPy, LiteLLM, the adapter) count as settings unless `other_versions`:
        then a change of them is said (unless `quiet`: the compile's `start` says it) and the run goes on, its recorded
        replies answering the requests that are the same."""
        saved = self.saved()
        if self.root is None or not self.root.exists():
            return saved
        if any(p.is_dir() for p in (self.root / "steps").glob("[0-9]*")):
            raise RunMismatchError(
                f"{self.root} holds a run saved by an earlier tfgrpo (one file per unit of work, under steps/NNNN/), "
                "which this version cannot resume: it keeps a run's LM replies instead (calls.jsonl). Finish that run "
                "with the tfgrpo that started it, or use a new log_dir (or delete this one to start over)")
        path, work = self.root / "run.json", saved["steps"] + saved["calls"]
        old = self._read(path)
        if not isinstance(old, dict) or "knobs" not in old:
            if work:
                state = "missing" if not path.exists() else "unreadable"
                raise RunMismatchError(
                    f"{self.root} holds a run's work ({_said(saved)}) but its run.json is {state}, so nothing says "
                    "which settings it was made with and it cannot be reused safely; use a new log_dir, or delete "
                    f"{self.root} to start over")
            return saved
        changes = fingerprint_changes(old, fingerprint)
        versions = [c for c in changes if c.startswith("versions ")]
        if versions and other_versions and work:
            if not quiet:
                logger.warning("%s: going on from work made under other versions (%s; %s): resume_other_versions=True",
                               self.root, _said(saved), "; ".join(versions))
            changes = [c for c in changes if c not in versions]
        if changes and work:
            anyway = ("\nits recorded replies answered prompts made by those versions; to go on from them anyway, "
                      "pass resume_other_versions=True (resume_other_versions = true in a config's [optimizer])"
                      if versions and len(versions) == len(changes) else "")
            raise RunMismatchError(
                f"{self.root} holds a run started with different settings or data:\n  " + "\n  ".join(changes) +
                "\nresume with the same settings and data, or use a new log_dir (or delete this one to start over)"
                + anyway, changes)
        if changes:
            logger.info("%s: the run recorded there saved no work; started again with these settings (%s)", self.root,
                        "; ".join(changes))
        return saved

    def start(self, fingerprint: dict[str, Any], *, other_versions: bool = False) -> dict:
        """Check the run's fingerprint against the one already there (`check`), then record it; what was saved."""
        if self.root is None:
            return self.saved()
        self.root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(self.root)  # left by a run killed mid-write; safe under the lock, which a start holds
        saved, path = self.check(fingerprint, other_versions=other_versions), self.root / "run.json"
        old, record = self._read(path), dict(fingerprint)
        earlier = list(old.get("earlier_versions", [])) if isinstance(old, dict) else []
        if saved["steps"] + saved["calls"] and isinstance(old, dict) and old.get("versions") not in (
                None, fingerprint.get("versions")):
            earlier.append(old["versions"])  # a resume under other versions: those the saved work was made by
        if earlier:  # (not compared: a key only run.json has)
            record["earlier_versions"] = earlier
        if old != record:  # a new run, or one that had saved nothing (or an older run.json's fields)
            write_atomic(path, json.dumps(record, ensure_ascii=False))
        return saved

    def note(self, key: str, value: Any) -> None:
        """Add `key` to run.json, beside the fingerprint (never compared on a resume: what the run ran on)."""
        if self.root is not None and isinstance(record := self._read(self.root / "run.json"), dict):
            write_atomic(self.root / "run.json", json.dumps({**record, key: value}, ensure_ascii=False))

    def saved(self) -> dict[str, int]:
        """What the folder holds of a run: its finished steps, and the LM calls its record holds."""
        if self.root is None:
            return {"steps": 0, "calls": 0}
        calls = self.root / "calls.jsonl"
        return {"steps": sum(1 for p in (self.root / "steps").glob("[0-9]*.json")),
                "calls": sum(line.startswith(b'{"key"') for line in calls.read_bytes().splitlines()) if calls.exists()
                else 0}

    def get(self, key: str) -> Any | None:
        """The value saved under `key`, or None."""
        return self._read(self.root / f"{key}.json") if self.root is not None else None

    def put(self, key: str, value: Any) -> None:
        self._write(f"{key}.json", json.dumps(value, ensure_ascii=False))

    def put_rows(self, key: str, rows: list[dict]) -> None:
        """Save `rows` under `key` as JSON lines (`key.jsonl`)."""
        self._write(f"{key}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def _write(self, name: str, text: str) -> None:
        if self.root is not None and not self.closed:
            try:
                write_atomic(self.root / name, text)
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES):
                    raise
                raise _unwritable(self.root, exc) from None

    @staticmethod
    def _read(path: Path) -> Any | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def _said(saved: dict[str, int]) -> str:
    return f"{saved['steps']} finished step(s), {saved['calls']} recorded LM call(s)"


# fingerprint entries kept as digests: only that they differ is known
DIGESTS = {"instructions": "the program's instructions", "trainset": "the trainset", "valset": "the valset",
           "initial_library": "the starting library", "initial_demos": "the demos the student carries", "metric_code": "the metric's code",
           "program_code": "the program's code (its module classes)"}


SIMPLE = (str, int, float, bool, type(None), tuple)  # values whose repr says what they are


def _code(obj) -> tuple[str, str | None]:
    """(module.qualname, what it computes with) of a function, method, class, callable object or `functools.partial`:
    its source, and beside it what the source does not show: a partial's bound arguments, a callable object's attributes,
    a closure's values, and the module-level constants and helper functions its code names (the helpers' source, and
    in turn what theirs names). The source is None where Python cannot read it (typed into a REPL, built in): the name
    then stands for it alone."""
    extra = []
    while isinstance(obj, functools.partial):
        extra.append(repr((obj.args, sorted(obj.keywords.items()))))
        obj = obj.func
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    if target is not obj:
        extra += [f"{k}={v!r}" for k, v in sorted(vars(obj).items()) if isinstance(v, SIMPLE)]
    name = f"{getattr(target, '__module__', None)}.{target.__qualname__}"
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = None
    functions = [target] if inspect.isfunction(target) else [v for v in vars(target).values() if inspect.isfunction(v)]
    seen = set(functions)
    while functions:
        fn = functions.pop(0)
        extra += [repr(c.cell_contents) for c in fn.__closure__ or () if isinstance(c.cell_contents, SIMPLE)]
        for used in fn.__code__.co_names:
            value = fn.__globals__.get(used)
            if isinstance(value, SIMPLE):
                extra.append(f"{used}={value!r}")
            elif inspect.isfunction(value) and value.__module__ == fn.__module__ and value not in seen:
                seen.add(value)
                functions.append(value)
                with contextlib.suppress(OSError, TypeError):
                    extra.append(inspect.getsource(value))
    return name, "\n".join([source or "", *extra]) if source or extra else None


def prompt_versions() -> dict[str, str]:
    """The versions that make a run's prompts and replies: tfgrpo's, DSPy's, LiteLLM's, and the adapter that renders
    every call (`dspy.settings.adapter`, else DSPy's ChatAdapter) by name and a digest of its code."""
    import dspy  # (here, not above: the command line reads checkpoints before it loads DSPy)
    from dspy.adapters import ChatAdapter

    adapter = type(dspy.settings.adapter) if dspy.settings.adapter is not None else ChatAdapter
    name, source = _code(adapter)
    return {"tfgrpo": installed_version("tfgrpo"), "dspy": dspy.__version__, "litellm": installed_version("litellm"),
            "adapter": name,
            "adapter_code": digest(source)}


def installed_version(package: str) -> str:
    """`package`'s version as installed, or "unknown" (run from a source tree that is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def code_fingerprint(metric, program) -> dict[str, str]:
    """The fingerprint entries of the code a run calls, which its instructions and data do not show: the metric's
    qualified name and a digest of what it computes with (`_code`), and a digest of the same for the program's module
    classes (its own class, `forward` and the module helpers it calls included, and that of every module inside it)
    with the plain settings each module holds (`Agent("normal")` against `Agent("wrong")`). An edit of either changes
    what the saved rewards and attempts mean, so a resume after one is refused."""
    name, source = _code(metric)
    modules = list(program.named_sub_modules())
    classes = dict(map(_code, {type(module) for _, module in modules}))
    settings = {path: {k: repr(v) for k, v in sorted(vars(module).items()) if not k.startswith("_")
                       and isinstance(v, SIMPLE)} for path, module in modules
                if not type(module).__module__.startswith("dspy.")}  # (DSPy's own: their signatures say it all)
    return {"metric": name, "metric_code": digest(source), "program_code": digest([classes, settings])}


# Knobs an earlier version had, with the value that computes what this version computes: a run recorded with that
# value resumes; one recorded with another value made work this version cannot continue.
RETIRED_KNOBS = {"probe_alpha": 1.0, "keep_tied_demos": False, "num_explore_generations": 0, "focus_on_failures": False,
                 "max_resampled_queries": 0, "max_excerpt_lines": 0, "excerpt_whole_attempt": False}


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per setting that differs between two fingerprints: "knob temperature: 0.7 -> 1.5". An entry the
    old fingerprint lacks (recorded by an earlier version, before that setting existed) is not compared, nor is a
    knob it lacks; a retired knob at the value this version computes with is no difference."""
    changes = []
    if isinstance(old.get("knobs"), dict):
        old = {**old, "knobs": {k: v for k, v in old["knobs"].items()
                                if not (k in RETIRED_KNOBS and v == RETIRED_KNOBS[k])}}
    for key in sorted(set(old) & set(new)):
        if old[key] == new[key]:
            continue
        if key in DIGESTS:
            changes.append(f"{DIGESTS[key]}: not the same as before")
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            label = "knob" if key == "knobs" else key
            changes += [f"{label} {k}: {old[key][k]!r} -> {new[key].get(k, '(unset)')!r}"
                        for k in sorted(old[key]) if old[key][k] != new[key].get(k)]
        else:
            changes.append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return changes


LOCK_FILE = ".lock"
_held: dict[str, list] = {}  # resolved lock path -> [owning thread id, depth, open file]
_held_lock = threading.Lock()


class RunLockedError(RuntimeError):
    """The run directory is in use by another compile (`holder`: what its lock file says of it)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


def _unwritable(folder: Path, exc: OSError) -> OSError:
    """The error of a log_dir a compile cannot write to (read-only storage, another user's folder), with the fix."""
    return type(exc)(exc.errno, f"log_dir {folder} cannot be written ({exc.strerror}): a compile keeps its record of LM "
                                "calls and its finished steps there as it runs. Pass a writable log_dir; to go on from "
                                "a run stored there, copy the folder somewhere writable and pass the copy")


class RunLock:
    """`with RunLock(log_dir):` holds the run directory's lock, or raises `RunLockedError` naming the holder.
    `log_dir=None` locks nothing."""

    def __init__(self, log_dir: str | Path | None):
        self.path = Path(log_dir) / LOCK_FILE if log_dir is not None else None

    def __enter__(self) -> "RunLock":
        if self.path is None or fcntl is None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(self.path.parent, exc) from None
        key = str(self.path.resolve())
        with _held_lock:
            if key in _held and _held[key][0] == threading.get_ident():
                _held[key][1] += 1
                return self
            try:
                f = open(self.path, "a+", encoding="utf-8")
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES) or not self.path.is_file():
                    raise _unwritable(self.path.parent, exc) from None
                # read-only storage that holds a run: a finished run can still be read (its steps reused, its calls
                # answered from the record); whatever it would have to write fails then, with the same fix
                try:
                    f = open(self.path, encoding="utf-8")
                except OSError:
                    raise _unwritable(self.path.parent, exc) from None
            try:
                fcntl.flock(f.fileno(), (fcntl.LOCK_EX if f.writable() else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process (it has not written its name yet)"
                f.close()
                raise RunLockedError(
                    f"{self.path.parent} is in use by another compile ({holder}); two runs in one folder would mix "
                    "their work. Wait for it to end (or stop it), or use another log_dir/run_dir", holder) from None
            if f.writable():
                f.seek(0)
                f.truncate()
                f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                        f"{' '.join(sys.argv) or sys.executable}\n")
                f.flush()
            _held[key] = [threading.get_ident(), 1, f]
        return self

    def __exit__(self, *exc) -> None:
        if self.path is None or fcntl is None:
            return
        key = str(self.path.resolve())
        with _held_lock:
            entry = _held.get(key)
            if entry is None or entry[0] != threading.get_ident():
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                f = entry[2]
                if f.writable():  # the file stays (removing it would race a process about to lock it); it says nobody
                    f.truncate(0)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                f.close()
