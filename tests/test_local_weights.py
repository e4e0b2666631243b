"""Tests of tfgrpo.local_weights: joining the chunks of a tiny fake model, whose "part packages" are created
in a temp dir, into a verified GGUF file; rebuilding or refusing damaged ones."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os

import pytest

from tfgrpo import local_weights as lw
from tfgrpo.local_weights import LocalModelError, ModelSpec


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
    monkeypatch.setitem(lw.MODELS, "fake", spec)
    return spec, site, blob, tmp_path / "cache"


def test_assembles_once_and_reuses(fake):
    spec, _, blob, cache = fake
    path = lw.ensure_model("fake", cache_dir=cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == blob
    note = json.loads((cache / "fake.gguf.verified").read_text())
    assert note["sha256"] == spec.sha256
    assert not list(cache.glob("*.tmp")), "temp file left behind"
    inode, mtime = path.stat().st_ino, path.stat().st_mtime_ns
    assert lw.ensure_model("fake", cache_dir=cache) == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, mtime), "reassembled although valid"


def test_env_var_sets_cache_dir(fake, monkeypatch):
    _, _, blob, cache = fake
    monkeypatch.setenv("TFGRPO_CACHE_DIR", str(cache / "from-env"))
    assert lw.default_cache_dir() == cache / "from-env"
    assert lw.ensure_model("fake").read_bytes() == blob


def test_truncated_cache_is_rebuilt(fake):
    _, _, blob, cache = fake
    path = lw.ensure_model("fake", cache_dir=cache)
    path.write_bytes(blob[:100])
    assert lw.ensure_model("fake", cache_dir=cache).read_bytes() == blob


def test_corrupted_cache_is_rebuilt(fake):
    _, _, blob, cache = fake
    path = lw.ensure_model("fake", cache_dir=cache)
    st = path.stat()
    path.write_bytes(b"XXXX" + blob[4:])  # same size, new mtime -> note no longer matches
    assert lw.ensure_model("fake", cache_dir=cache).read_bytes() == blob
    # damage that keeps size and mtime is invisible to the cheap check, but verify=True sees it
    path.write_bytes(blob[:-1] + b"\x00")
    os.utime(path, ns=(st.st_atime_ns, path.stat().st_mtime_ns))
    lw._write_note(lw.MODELS["fake"], path)
    assert lw.ensure_model("fake", cache_dir=cache, verify=True).read_bytes() == blob


def test_corrupted_cache_without_parts_is_refused(fake):
    _, site, _, cache = fake
    path = lw.ensure_model("fake", cache_dir=cache)
    path.write_bytes(b"GGUF")
    (site / "tfgrpo_fake_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(LocalModelError, match=r"tfgrpo-fake-part2==1\.0.*pip install -e \"\.\[local\]\""):
        lw.ensure_model("fake", cache_dir=cache)


def test_missing_part_package(fake):
    _, site, _, cache = fake
    (site / "tfgrpo_fake_part3" / "__init__.py").unlink()
    (site / "tfgrpo_fake_part3" / "data" / "part03.bin").unlink()
    (site / "tfgrpo_fake_part3" / "data").rmdir()
    (site / "tfgrpo_fake_part3").rmdir()
    importlib.invalidate_caches()
    with pytest.raises(LocalModelError, match=r"missing tfgrpo-fake-part3==1\.0.*\.\[local\]"):
        lw.ensure_model("fake", cache_dir=cache)
    assert not (cache / "fake.gguf").exists()


def test_damaged_chunk_fails_sha256(fake):
    _, site, blob, cache = fake
    (site / "tfgrpo_fake_part2" / "data" / "part02.bin").write_bytes(b"\0" * 2000)
    with pytest.raises(LocalModelError, match="sha256"):
        lw.ensure_model("fake", cache_dir=cache)
    assert not (cache / "fake.gguf").exists() and not list(cache.glob("*.tmp"))


def test_wrong_size_and_bad_magic(fake, monkeypatch):
    spec, site, blob, cache = fake
    monkeypatch.setitem(lw.MODELS, "fake", dataclasses.replace(spec, size=spec.size + 1))
    with pytest.raises(LocalModelError, match="add up to"):
        lw.ensure_model("fake", cache_dir=cache)
    bad = b"NOPE" + blob[4:]
    (site / "tfgrpo_fake_part1" / "data" / "part01.bin").write_bytes(bad[:1004])
    monkeypatch.setitem(lw.MODELS, "fake", dataclasses.replace(spec, sha256=hashlib.sha256(bad).hexdigest()))
    with pytest.raises(LocalModelError, match="not a GGUF"):
        lw.ensure_model("fake", cache_dir=cache)


def test_unknown_model():
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b"):
        lw.ensure_model("gpt-5")
