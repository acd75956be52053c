#!/usr/bin/env bash
# Build llama-server from the llama.cpp vendored in the pinned llama-cpp-python sdist, so the server
# and the Python binding share one llama.cpp and one state-file format. The binary is cached under
# ~/.cache/kvtier/llama-server-<pin>/ and this script does nothing when it is already there.
#
# GGML_NATIVE=OFF: a native build advertises AMX on these VMs and dies with SIGILL on the first
# quantized matmul (see DESIGN.md).
set -euo pipefail

pin="${1:?usage: build-llama-server.sh <llama-cpp-python version>}"
python="${PYTHON:-python3}"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
out="$cache/llama-server-$pin"
binary="$out/llama-server"

if [[ -x "$binary" ]]; then
    echo "llama-server $pin: cached at $binary"
    exit 0
fi

mkdir -p "$cache"
sdist_dir="$cache/sdist"
sdist="$sdist_dir/llama_cpp_python-$pin.tar.gz"
if [[ ! -f "$sdist" ]]; then
    mkdir -p "$sdist_dir"
    "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$pin" -d "$sdist_dir"
fi

work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$pin/vendor/llama.cpp"

jobs="$(nproc 2>/dev/null || echo 2)"
cmake -S "$src" -B "$work/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$jobs"

mkdir -p "$out.tmp"
cp "$work/build/bin/llama-server" "$out.tmp/llama-server"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "llama-server $pin: built at $binary"
