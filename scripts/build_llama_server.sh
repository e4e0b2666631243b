#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server), the only llama.cpp build tfgrpo needs, from the llama.cpp source
# vendored in the llama-cpp-python sdist pinned by hash in scripts/llama-cpp-source.lock, and put it next to the
# virtualenv's python (.venv/bin), where tfgrpo looks for it first. Optional: `scripts/setup.sh` installs the same
# server prebuilt (the xllamacpp wheel); a native build may decode faster on a CPU with features that wheel leaves
# out (AVX-512). Run it by hand, or as TFGRPO_BUILD_LLAMA_SERVER=1 bash scripts/setup.sh.
# Idempotent: skipped when the binary is there and reports the same llama.cpp build. ~10 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# Built native but without Intel AMX: some VMs list AMX in /proc/cpuinfo yet fault on its first tile instruction
# (seen here: llama.cpp died with SIGSEGV at `ldtilecfg` in its first matrix product). An explicit -mno-* wins over
# the -march=native that llama.cpp adds, whatever their order (compilers before gcc 11 know no AMX).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "$(uname -m)" = x86_64 ] && echo | "${CC:-cc}" $NO_AMX -E - > /dev/null 2>&1; then
    export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"
fi
VENV=${VENV:-.venv}
OUT="$VENV/bin/llama-server"
PIN=$(grep -A1 '^llama-cpp-python==' scripts/llama-cpp-source.lock)  # name==version and its sha256
VERSION=$(head -1 <<<"$PIN" | sed 's/^llama-cpp-python==\([^ ]*\).*/\1/')
STAMP="$OUT.source"  # which sdist, with which compiler flags (CFLAGS and CXXFLAGS), the binary was built from
BUILT="llama-cpp-python==$VERSION CFLAGS=${CFLAGS:-} CXXFLAGS=${CXXFLAGS:-}"
if [ -x "$OUT" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$BUILT" ]; then
    echo "llama-server ($BUILT) is built"; exit 0
fi
command -v cmake >/dev/null || { echo "cmake is needed to build llama-server (apt install cmake)" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
printf '%s\n' "$PIN" > "$WORK/req.txt"
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    --require-hashes -r "$WORK/req.txt" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
GEN=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
# Static, CPU only, no web UI (it would be downloaded), no TLS or curl (the server only listens locally).
cmake -S "$SRC" -B "$WORK/build" -G "$GEN" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    > "$WORK/configure.log" || { tail -30 "$WORK/configure.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    > "$WORK/build.log" || { tail -30 "$WORK/build.log" >&2; exit 1; }
install -m 755 "$WORK/build/bin/llama-server" "$OUT.tmp" && mv "$OUT.tmp" "$OUT"
echo "$BUILT" > "$STAMP"
echo "built $OUT"
