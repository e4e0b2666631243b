"""Tests of tfgrpo.local_model: the llama-server lifecycle and its speculative decoding modes.

Tests marked ``local_model`` use the real 0.5B model (assembled once per session into a temp cache dir).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tfgrpo import local_model as lm
from tfgrpo import local_weights as lw
from tfgrpo.local_model import LocalServer, LocalServerError
from tfgrpo.local_weights import LocalModelError

SMALL = "qwen2.5-coder-0.5b"


def _real_model_missing() -> str | None:
    try:
        lw.find_parts(lw.MODELS[SMALL])
    except LocalModelError as exc:
        return str(exc)
    return None


_SKIP = _real_model_missing()


def real(test):
    """Mark a test as using the real 0.5B model and llama_cpp; skip it if they are absent."""
    skip = pytest.mark.skipif(_SKIP is not None, reason=f"real local model unavailable: {_SKIP}")
    return pytest.mark.local_model(skip(test))


def _gone(pid: int) -> bool:
    """True if ``pid`` is no longer a running process (reaping it if it is our child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not lm._pid_alive(pid)


def _wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _chat(api_base: str, content: str, max_tokens: int = 16, **extra) -> dict:
    body = {"model": SMALL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    req = urllib.request.Request(
        f"{api_base}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture
def llama_server():
    """llama.cpp's server must be installed for the lifecycle tests; CI (TFGRPO_REQUIRE_LOCAL_MODEL) fails rather
    than skips."""
    if lm.server_command() is None:
        reason = "llama.cpp's server is not installed (bash scripts/setup.sh)"
        if os.environ.get("TFGRPO_REQUIRE_LOCAL_MODEL"):
            pytest.fail(f"llama-server is required here but unavailable: {reason}")
        pytest.skip(reason)


# ------------------------------------------------------------ binary, arguments, state file (no model)


def test_server_binary_is_required(monkeypatch, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TFGRPO_LLAMA_SERVER", str(fake))
    assert lm.find_llama_server() == str(fake) and lm.server_command() == [str(fake)]
    assert LocalServer(SMALL, cache_dir=tmp_path).engine == str(fake)
    monkeypatch.setenv("TFGRPO_LLAMA_SERVER", str(tmp_path / "missing"))  # named, so neither wheel nor PATH stands in
    with pytest.raises(LocalServerError, match=r"TFGRPO_LLAMA_SERVER=.*missing is no executable"):
        LocalServer(SMALL, cache_dir=tmp_path)


def test_without_a_binary_the_wheel_serves_and_without_both_setup_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("TFGRPO_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(lm.sys, "executable", str(tmp_path / "python"))  # no llama-server next to it
    monkeypatch.setenv("PATH", str(tmp_path))
    assert lm.server_command() == [str(tmp_path / "python"), "-m", "tfgrpo.llama_server"]  # xllamacpp is installed
    assert LocalServer(SMALL, cache_dir=tmp_path).engine == "xllamacpp"  # what `tfgrpo lm start` and the log say
    monkeypatch.setattr(lm.importlib.util, "find_spec", lambda name: None)  # as if it were not
    with pytest.raises(LocalServerError, match=r"server was not found \(no xllamacpp, no llama-server\).*setup.sh"):
        LocalServer(SMALL, cache_dir=tmp_path)


def test_the_wheel_server_takes_llama_servers_flags():
    """tfgrpo.llama_server maps the flags LocalServer passes onto xllamacpp's parameters, and refuses others."""
    from tfgrpo import llama_server

    server = LocalServer.__new__(LocalServer)  # only for its flags: no model, no process
    server.command, server.model_path, server.model_alias, server.host, server.port = [], "m.gguf", "q", "127.0.0.1", 9
    server.n_ctx, server.parallel, server.n_threads, server.speculative = 2048, 2, 3, "ngram-mod"
    server.draft_path = Path("d.gguf")
    p = llama_server.params(llama_server.parse(server.server_args()))
    assert (p.model.path, p.model_alias, p.hostnames, p.port) == ("m.gguf", {"q"}, ["127.0.0.1"], 9)
    assert (p.n_ctx, p.n_parallel, p.kv_unified, p.n_batch) == (4096, 2, True, 512)
    assert (p.cpuparams.n_threads, p.cpuparams_batch.n_threads, p.endpoint_metrics, p.ui) == (3, 3, True, False)
    assert [t.name for t in p.speculative.types] == ["COMMON_SPECULATIVE_TYPE_NGRAM_MOD"]
    assert (p.speculative.draft.mparams.path, p.speculative.draft.cpuparams.n_threads) == ("d.gguf", 3)
    for spec_type in llama_server.SPEC_TYPES:  # every speculative mode of LocalServer has its xllamacpp type
        llama_server.params(llama_server.parse(["-m", "m.gguf", "--port", "9", "--spec-type", spec_type]))
    with pytest.raises(SystemExit):
        llama_server.parse(["-m", "m.gguf", "--port", "9", "--flash-attn"])


def test_llama_server_arguments(monkeypatch, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TFGRPO_LLAMA_SERVER", str(fake))
    server = LocalServer(SMALL, n_ctx=4096, parallel=3, cache_dir=tmp_path)
    server.model_path, server.port = tmp_path / "m.gguf", 1234
    args = server.server_args()
    assert args[0] == str(fake)  # the launcher execs the binary (keeping the parent-death signal)
    assert args[args.index("-np") + 1] == "3" and args[args.index("-c") + 1] == str(3 * 4096)  # n_ctx per request
    assert "--metrics" in args
    assert "--spec-type" not in args and "--spec-draft-model" not in args  # speculation is off by default
    ngram = LocalServer(SMALL, speculative="ngram-mod", cache_dir=tmp_path)
    ngram.model_path, ngram.port = tmp_path / "m.gguf", 1234
    assert ngram.server_args()[-2:] == ["--spec-type", "ngram-mod"]
    with pytest.raises(ValueError, match="parallel"):
        LocalServer(SMALL, parallel=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown speculative mode 'eagle'; choose one of off, ngram-simple"):
        LocalServer(SMALL, speculative="eagle", cache_dir=tmp_path)


def test_state_file_of_an_older_version_still_reads(tmp_path):
    """A detached server started before engines existed must still be found (and stopped), not orphaned."""
    old = {"pid": 1, "port": 9, "host": "127.0.0.1", "model": SMALL, "model_alias": SMALL,
           "api_base": "http://127.0.0.1:9/v1", "log_path": "x.log", "model_path": "x.gguf", "started_at": 0.0}
    (tmp_path / lm.STATE_FILE).write_text(json.dumps(old))
    info = lm._read_state(tmp_path)
    assert (info.parallel, info.speculative) == (1, "off")


def test_stale_state_file_is_cleaned(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    info = lm.ServerInfo(dead.pid, 9, "127.0.0.1", SMALL, SMALL, "http://127.0.0.1:9/v1", "x.log", "x.gguf", 0.0)
    state = tmp_path / lm.STATE_FILE
    state.write_text(json.dumps(dataclasses.asdict(info)))
    assert lm.status(cache_dir=tmp_path) is None
    assert not state.exists()
    state.write_text("{not json")
    assert lm.status(cache_dir=tmp_path) is None and not state.exists()
    assert lm.stop_detached(cache_dir=tmp_path) is False


# ------------------------------------------------------------ real model and server


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    if _SKIP:
        pytest.skip(_SKIP)
    cache = tmp_path_factory.mktemp("tfgrpo-cache")
    lw.ensure_model(SMALL, cache_dir=cache)
    return cache


@real
def test_real_model_is_verified(real_cache):
    spec = lw.MODELS[SMALL]
    path = real_cache / spec.filename
    assert path.stat().st_size == spec.size == 491_400_064
    assert path.open("rb").read(4) == b"GGUF"
    t0 = time.monotonic()
    assert lw.ensure_model(SMALL, cache_dir=real_cache) == path
    assert time.monotonic() - t0 < 0.5, "cached model should be reused without rehashing"
    assert lw.ensure_model(SMALL, cache_dir=real_cache, verify=True) == path  # full sha256


@real
def test_owned_server_lifecycle(real_cache, llama_server, capfd):
    server = LocalServer(SMALL, n_ctx=2048, cache_dir=real_cache, parallel=2)
    with server:
        pid = server.pid
        assert lm._pid_alive(pid)
        assert server.api_base.startswith("http://127.0.0.1:") and server.api_base.endswith("/v1")
        models = json.loads(urllib.request.urlopen(f"{server.api_base}/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == [SMALL]
        answer = _chat(server.api_base, "What is 2+3? Answer with a number.")
        assert answer["choices"][0]["message"]["content"].strip()
        # several client threads at once: the server decodes or queues them, none fails
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda i: _chat(server.api_base, f"Say {i}.", 4, stream=False), range(6)))
        assert all(r["choices"][0]["message"]["content"] is not None for r in replies)
        js = _chat(server.api_base, "Return a JSON object with key a = 1.", 32, response_format={"type": "json_object"})
        assert isinstance(json.loads(js["choices"][0]["message"]["content"]), dict)
    assert server.proc is None and _wait_gone(pid, timeout=1), "server process survived stop()"
    out, err = capfd.readouterr()
    assert "llama" not in (out + err).lower(), "server output leaked to our terminal"
    assert "slot" in server.log_path.read_text()
    server.stop()  # idempotent


@real
def test_dspy_can_use_it(real_cache, llama_server):
    dspy = pytest.importorskip("dspy")
    with LocalServer(SMALL, n_ctx=4096, cache_dir=real_cache) as server:
        from tfgrpo.lms import local_dspy_lm

        lm_ = local_dspy_lm(server.model_alias, server.api_base, max_tokens=256, temperature=0.3, cache=False)
        with dspy.context(lm=lm_):
            pred = dspy.Predict("question -> answer")(question="What is 2+3?")
        assert isinstance(pred.answer, str) and pred.answer.strip()
        # the reply limit reaches the server (DSPy's own field for it, max_completion_tokens, is ignored there)
        short = local_dspy_lm(server.model_alias, server.api_base, max_tokens=12, temperature=0.3, cache=False)
        short("Count from 1 to 500, one number per line.")
        assert short.history[-1]["usage"]["completion_tokens"] <= 12


@real
def test_stopped_on_exception_and_ctrl_c(real_cache, llama_server, monkeypatch):
    server = LocalServer(SMALL, n_ctx=1024, cache_dir=real_cache)
    with pytest.raises(RuntimeError, match="boom"):
        with server:
            pid = server.pid
            raise RuntimeError("boom")
    assert _wait_gone(pid, timeout=1)
    # Ctrl-C while waiting for readiness: the half-started server is killed too
    started = []

    def interrupted(*a, **k):
        started.append(server.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(lm, "_probe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert started and _wait_gone(started[0], timeout=1)


@real
@pytest.mark.parametrize("how", ["atexit", "sigkill"])
def test_no_orphan_when_parent_exits(real_cache, llama_server, tmp_path, how):
    code = f"""
        import threading, time
        from pathlib import Path
        from tfgrpo.local_model import LocalServer
        s = LocalServer({SMALL!r}, n_ctx=1024, cache_dir=Path({str(real_cache)!r}))
        if {how!r} == "atexit":  # from a worker thread: no parent-death signal, atexit alone must stop it
            t = threading.Thread(target=s.start)
            t.start()
            t.join()
        else:
            s.start()
        print(s.pid, flush=True)
        if {how!r} == "sigkill":  # atexit never runs: the kernel's parent-death signal must stop it
            time.sleep(60)
    """
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    if how == "sigkill":
        parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    assert _wait_gone(pid), f"server {pid} outlived its parent ({how})"


@real
def test_detached_server_is_reused_then_stopped(real_cache, llama_server):
    try:
        info = lm.start_detached(SMALL, n_ctx=2048, cache_dir=real_cache, speculative="off")
        assert info.speculative == "off"
        assert lm.status(cache_dir=real_cache) == info
        assert json.loads((real_cache / lm.STATE_FILE).read_text())["pid"] == info.pid
        assert lm.start_detached(SMALL, cache_dir=real_cache) == info  # idempotent
        with pytest.raises(LocalServerError, match="stop it first"):
            lm.start_detached("qwen2.5-coder-1.5b", cache_dir=real_cache)
        api_base, owned = lm.ensure_server(SMALL, cache_dir=real_cache)
        assert (api_base, owned) == (info.api_base, None)
        assert _chat(api_base, "Hi")["choices"]
        assert lm.stop_detached(cache_dir=real_cache) is True
        assert _wait_gone(info.pid, timeout=1)
        assert lm.status(cache_dir=real_cache) is None and not (real_cache / lm.STATE_FILE).exists()
        assert lm.stop_detached(cache_dir=real_cache) is False
        # nothing detached any more: ensure_server starts (and hands us) an owned server
        api_base, owned = lm.ensure_server(SMALL, n_ctx=1024, cache_dir=real_cache)
        try:
            assert owned is not None and api_base == owned.api_base != info.api_base
        finally:
            owned.stop()
        # a detached server that died leaves a stale state file, which status() removes
        info = lm.start_detached(SMALL, n_ctx=1024, cache_dir=real_cache)
        os.killpg(info.pid, signal.SIGKILL)
        assert _wait_gone(info.pid)
        assert lm.status(cache_dir=real_cache) is None and not (real_cache / lm.STATE_FILE).exists()
    finally:
        lm.stop_detached(cache_dir=real_cache)


def test_early_death_reports_log_tail(tmp_path, monkeypatch, llama_server):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 4096)
    monkeypatch.setattr(lm, "ensure_model", lambda *a, **k: bogus)
    server = LocalServer(SMALL, cache_dir=tmp_path, startup_timeout_s=60)
    with pytest.raises(LocalServerError, match=r"(?s)exited with code \d+ during startup.*(Failed to load model|failed to load)"):
        server.start()
    assert server.proc is None


def test_a_server_that_crashes_says_which_signal_and_what_to_rebuild(tmp_path, monkeypatch):
    """A llama-server built with CPU features the machine cannot run dies by a signal, not with an error code."""
    crashing = tmp_path / "llama-server"
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr(lm, "ensure_model", lambda *a, **k: model)
    monkeypatch.setenv("TFGRPO_LLAMA_SERVER", str(crashing))
    server = LocalServer(SMALL, cache_dir=tmp_path, startup_timeout_s=30)
    with pytest.raises(LocalServerError, match=r"exited with code -11 during startup \(Segmentation fault; .*AMX"):
        server.start()
    assert server.proc is None


@real
@pytest.mark.parametrize("mode", ["ngram-mod", "draft"])
def test_speculative_modes_draft_tokens(real_cache, llama_server, mode):
    """A reply that copies its prompt is drafted (n-grams of the prompt, or the draft model) and mostly accepted."""
    text = "def solve(nums):\n    for a in nums:\n        for b in nums:\n            print(a + b, a * b)\n" * 3
    with LocalServer(SMALL, n_ctx=2048, cache_dir=real_cache, speculative=mode) as server:
        reply = _chat(server.api_base, f"Copy this code exactly, with nothing else:\n{text}", 96, temperature=0.0)
    timings = reply["timings"]
    assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings
