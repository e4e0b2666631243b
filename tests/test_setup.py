"""The setup a newcomer runs: `scripts/setup.sh` with the pip their Python ships.

pip 23.x resolves a dependency's extra (`lxml[html_clean]`, asked for by justext) apart from the lock's pin of the same
package: it takes the newest release on the index for it, and hash mode then refuses the install. The script puts the
pip pinned in `requirements-pip.lock` into `.venv` first. Here the case is rebuilt offline with two small wheels of the
test's own on a local index: the lock pins `host==1.0` and `dep==1.0`, `host` asks for `dep[extra]`, and the index
also has `dep==2.0`.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def wheel(folder: Path, name: str, version: str, requires: list[str] = (), extras: list[str] = ()) -> Path:
    """A minimal pure-Python wheel of `name` (one empty module), with its requirements and extras."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Provides-Extra: {e}" for e in extras] + [f"Requires-Dist: {r}" for r in requires]
    files = {f"{name}.py": "", f"{info}/METADATA": "\n".join(meta) + "\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for file, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{file},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        for file, text in files.items():
            zf.writestr(file, text)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> tuple[Path, Path]:
    """A local index with the extras case, and a hash-pinned lock of it."""
    folder = tmp_path_factory.mktemp("index")
    host = wheel(folder, "host", "1.0", requires=["dep[extra]>=1"])
    dep = wheel(folder, "dep", "1.0", extras=["extra"])
    wheel(folder, "dep", "2.0", extras=["extra"])  # a newer release than the lock's, as lxml 6.2.0 was
    lock = folder / "requirements.lock"
    lock.write_text(f"dep==1.0 --hash=sha256:{sha256(dep)}\nhost==1.0 --hash=sha256:{sha256(host)}\n")
    return folder, lock


def install(python: Path, folder: Path, lock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(folder),
                           "--require-hashes", "-r", str(lock), "--disable-pip-version-check"],
                          capture_output=True, text=True, env={"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"})


def pip_version(python: Path) -> tuple[int, ...]:
    out = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in re.match(r"pip (\d+)\.(\d+)", out).groups())


def test_the_pinned_pip_installs_a_lock_whose_dependency_names_an_extra(index):
    folder, lock = index
    pinned = re.search(r"^pip==([\d.]+)", (ROOT / "requirements-pip.lock").read_text(), re.M).group(1)
    assert pip_version(Path(sys.executable)) == tuple(int(x) for x in pinned.split(".")[:2]), \
        "this environment's pip is not the one requirements-pip.lock pins: run bash scripts/setup.sh"
    done = install(Path(sys.executable), folder, lock)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dep-1.0" in done.stdout and "dep-2.0" not in done.stdout


def test_the_pip_a_python_ships_may_refuse_it_so_setup_replaces_it_first(index, tmp_path):
    """The interpreter's own pip, in a new venv as a newcomer makes it: pip 23.x refuses the lock (the case setup.sh
    exists for); a newer bundled pip installs it as the pinned one does."""
    folder, lock = index
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    done = install(python, folder, lock)
    if pip_version(python) < (23, 3):
        assert done.returncode != 0 and "must have their versions pinned with ==" in done.stderr, done.stdout
    else:
        assert done.returncode == 0, done.stdout + done.stderr


def test_setup_puts_the_pinned_pip_in_before_the_lock():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert script.index("requirements-pip.lock") < script.index("-r requirements.lock")
    assert re.search(r"^pip==[\d.]+ \\\n(    --hash=sha256:[0-9a-f]{64}.*\n)+", (ROOT / "requirements-pip.lock").read_text(),
                     re.M)
