"""Tests of tfgrpo.local_model: weight assembly, and the llama.cpp server lifecycle.

The assembly logic is exercised on a tiny fake model whose "part packages" are created
in a temp dir. Tests marked ``local_model`` use the real 0.5B model (assembled once per
session into a temp cache dir) and a real llama_cpp server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tfgrpo import local_model as lm
from tfgrpo.local_model import LocalModelError, LocalServer, LocalServerError, ModelSpec

SMALL = "qwen2.5-coder-0.5b"


def _real_model_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[local]')"
    try:
        lm.find_parts(lm.MODELS[SMALL])
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


# --------------------------------------------------------------- assembly (fake model)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part fake model whose part packages live in a temp dir on sys.path."""
    site = tmp_path / "site"
    chunks = [b"GGUF" + os.urandom(1000), os.urandom(2000), os.urandom(500)]
    for n, chunk in enumerate(chunks, start=1):
        pkg = site / f"tfgrpo_fake_part{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(chunk)
    blob = b"".join(chunks)
    spec = ModelSpec(
        "fake", "fake", "tfgrpo-fake-part{n}", "1.0", parts=3, size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(), filename="fake.gguf",
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(lm.MODELS, "fake", spec)
    return spec, site, blob, tmp_path / "cache"


def test_assembles_once_and_reuses(fake):
    spec, _, blob, cache = fake
    path = lm.ensure_model("fake", cache_dir=cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == blob
    note = json.loads((cache / "fake.gguf.verified").read_text())
    assert note["sha256"] == spec.sha256
    assert not list(cache.glob("*.tmp")), "temp file left behind"
    inode, mtime = path.stat().st_ino, path.stat().st_mtime_ns
    assert lm.ensure_model("fake", cache_dir=cache) == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, mtime), "reassembled although valid"


def test_env_var_sets_cache_dir(fake, monkeypatch):
    _, _, blob, cache = fake
    monkeypatch.setenv("TFGRPO_CACHE_DIR", str(cache / "from-env"))
    assert lm.default_cache_dir() == cache / "from-env"
    assert lm.ensure_model("fake").read_bytes() == blob


def test_truncated_cache_is_rebuilt(fake):
    _, _, blob, cache = fake
    path = lm.ensure_model("fake", cache_dir=cache)
    path.write_bytes(blob[:100])
    assert lm.ensure_model("fake", cache_dir=cache).read_bytes() == blob


def test_corrupted_cache_is_rebuilt(fake):
    _, _, blob, cache = fake
    path = lm.ensure_model("fake", cache_dir=cache)
    st = path.stat()
    path.write_bytes(b"XXXX" + blob[4:])  # same size, new mtime -> note no longer matches
    assert lm.ensure_model("fake", cache_dir=cache).read_bytes() == blob
    # damage that keeps size and mtime is invisible to the cheap check, but verify=True sees it
    path.write_bytes(blob[:-1] + b"\x00")
    os.utime(path, ns=(st.st_atime_ns, path.stat().st_mtime_ns))
    lm._write_note(lm.MODELS["fake"], path)
    assert lm.ensure_model("fake", cache_dir=cache, verify=True).read_bytes() == blob


def test_corrupted_cache_without_parts_is_refused(fake):
    _, site, _, cache = fake
    path = lm.ensure_model("fake", cache_dir=cache)
    path.write_bytes(b"GGUF")
    (site / "tfgrpo_fake_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(LocalModelError, match=r"tfgrpo-fake-part2==1\.0.*pip install -e \"\.\[local\]\""):
        lm.ensure_model("fake", cache_dir=cache)


def test_missing_part_package(fake):
    _, site, _, cache = fake
    (site / "tfgrpo_fake_part3" / "__init__.py").unlink()
    (site / "tfgrpo_fake_part3" / "data" / "part03.bin").unlink()
    (site / "tfgrpo_fake_part3" / "data").rmdir()
    (site / "tfgrpo_fake_part3").rmdir()
    importlib.invalidate_caches()
    with pytest.raises(LocalModelError, match=r"missing tfgrpo-fake-part3==1\.0.*\.\[local\]"):
        lm.ensure_model("fake", cache_dir=cache)
    assert not (cache / "fake.gguf").exists()


def test_damaged_chunk_fails_sha256(fake):
    _, site, blob, cache = fake
    (site / "tfgrpo_fake_part2" / "data" / "part02.bin").write_bytes(b"\0" * 2000)
    with pytest.raises(LocalModelError, match="sha256"):
        lm.ensure_model("fake", cache_dir=cache)
    assert not (cache / "fake.gguf").exists() and not list(cache.glob("*.tmp"))


def test_wrong_size_and_bad_magic(fake, monkeypatch):
    spec, site, blob, cache = fake
    monkeypatch.setitem(lm.MODELS, "fake", dataclasses.replace(spec, size=spec.size + 1))
    with pytest.raises(LocalModelError, match="add up to"):
        lm.ensure_model("fake", cache_dir=cache)
    bad = b"NOPE" + blob[4:]
    (site / "tfgrpo_fake_part1" / "data" / "part01.bin").write_bytes(bad[:1004])
    monkeypatch.setitem(lm.MODELS, "fake", dataclasses.replace(spec, sha256=hashlib.sha256(bad).hexdigest()))
    with pytest.raises(LocalModelError, match="not a GGUF"):
        lm.ensure_model("fake", cache_dir=cache)


def test_unknown_model():
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b"):
        lm.ensure_model("gpt-5")


# ------------------------------------------------------------------- state file only


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
    lm.ensure_model(SMALL, cache_dir=cache)
    return cache


@real
def test_real_model_is_verified(real_cache):
    spec = lm.MODELS[SMALL]
    path = real_cache / spec.filename
    assert path.stat().st_size == spec.size == 491_400_064
    assert path.open("rb").read(4) == b"GGUF"
    t0 = time.monotonic()
    assert lm.ensure_model(SMALL, cache_dir=real_cache) == path
    assert time.monotonic() - t0 < 0.5, "cached model should be reused without rehashing"
    assert lm.ensure_model(SMALL, cache_dir=real_cache, verify=True) == path  # full sha256


@real
def test_owned_server_lifecycle(real_cache, capfd):
    server = LocalServer(SMALL, n_ctx=2048, cache_dir=real_cache)
    with server:
        pid = server.pid
        assert server.api_base.startswith("http://127.0.0.1:") and server.api_base.endswith("/v1")
        models = json.loads(urllib.request.urlopen(f"{server.api_base}/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == [SMALL]
        answer = _chat(server.api_base, "What is 2+3? Answer with a number.")
        assert answer["choices"][0]["message"]["content"].strip()
        # several client threads at once: the server queues them, none fails
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda i: _chat(server.api_base, f"Say {i}.", 4, stream=False), range(6)))
        assert all(r["choices"][0]["message"]["content"] is not None for r in replies)
        js = _chat(server.api_base, "Return a JSON object with key a = 1.", 32, response_format={"type": "json_object"})
        assert isinstance(json.loads(js["choices"][0]["message"]["content"]), dict)
    assert server.proc is None and _wait_gone(pid, timeout=1), "server process survived stop()"
    out, err = capfd.readouterr()
    assert "llama" not in (out + err).lower(), "server output leaked to our terminal"
    assert "POST /v1/chat/completions" in server.log_path.read_text()
    server.stop()  # idempotent


@real
def test_dspy_can_use_it(real_cache):
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
def test_stopped_on_exception_and_ctrl_c(real_cache, monkeypatch):
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
def test_no_orphan_when_parent_exits(real_cache, tmp_path, how):
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
def test_detached_server_is_reused_then_stopped(real_cache):
    try:
        info = lm.start_detached(SMALL, n_ctx=2048, cache_dir=real_cache)
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


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_early_death_reports_log_tail(tmp_path, monkeypatch):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 4096)
    monkeypatch.setattr(lm, "ensure_model", lambda *a, **k: bogus)
    server = LocalServer(SMALL, cache_dir=tmp_path, startup_timeout_s=60)
    with pytest.raises(LocalServerError, match=r"(?s)exited with code 1 during startup.*Failed to load model"):
        server.start()
    assert server.proc is None
