#!/usr/bin/env bash
# Builds llama.cpp's own binaries (llama-bench, llama-server, llama-cli) from the sources vendored
# in the llama-cpp-python sdist on PyPI, for benchmarks.peers --llama_cpp_dir.
#
#   scripts/build_llama_cpp.sh [OUT_DIR]        (default build/llama.cpp)
#   env: LLAMA_CPP_PYTHON_VERSION (0.3.36), JOBS (nproc), PYTHON (.venv/bin/python or python3)
#
# The binaries land in OUT_DIR/bin. The build is portable (GGML_NATIVE=OFF) with the x86 extensions
# the host CPU lists in /proc/cpuinfo switched on one by one; AMX stays off because some virtual machines
# list AMX but fault on its instructions (a native build dies with SIGILL in an AMX kernel there).
#
# GGUFs of the demo target, from its converted HF safetensors, are made by
# scripts/convert_gguf.sh OUT_DIR (it uses the convert_hf_to_gguf.py unpacked here).
set -euo pipefail

OUT_DIR=${1:-build/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-$(nproc)}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SRC_ROOT="$OUT_DIR/src"
SRC="$SRC_ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  mkdir -p "$SRC_ROOT"
  SDIST="$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$SDIST" ]]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC_ROOT"
  fi
  tar -xzf "$SDIST" -C "$SRC_ROOT"
  if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    echo "error: $SDIST has no vendor/llama.cpp/CMakeLists.txt" >&2
    exit 1
  fi
fi

# /proc/cpuinfo flag -> ggml CMake option. GGML_AVX512 compiles with F, CD, VL, DQ and BW together.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ "$CPU_FLAGS" == *" $f "* ]] || return 1; done; }
onoff() { if has "$@"; then echo ON; else echo OFF; fi; }
GGML_FLAGS=(
  -DGGML_SSE42="$(onoff sse4_2)"
  -DGGML_AVX="$(onoff avx)"
  -DGGML_AVX2="$(onoff avx2)"
  -DGGML_BMI2="$(onoff bmi2)"
  -DGGML_FMA="$(onoff fma)"
  -DGGML_F16C="$(onoff f16c)"
  -DGGML_AVX512="$(onoff avx512f avx512cd avx512vl avx512dq avx512bw)"
  -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
  -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
  -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
  -DGGML_AVX_VNNI="$(onoff avx_vnni)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  "${GGML_FLAGS[@]}"
)
echo "llama.cpp from llama-cpp-python==$VERSION ($SRC)"
echo "CPU: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "cmake flags: ${CMAKE_FLAGS[*]}"
echo "${CMAKE_FLAGS[*]}" > "$OUT_DIR/cmake_flags.txt"

cmake -S "$SRC" -B "$OUT_DIR/cmake" "${CMAKE_FLAGS[@]}"
cmake --build "$OUT_DIR/cmake" -j "$JOBS" --target llama-bench llama-server llama-cli
mkdir -p "$OUT_DIR/bin"
for b in llama-bench llama-server llama-cli; do
  cp "$OUT_DIR/cmake/bin/$b" "$OUT_DIR/bin/$b"
done
echo "built: $OUT_DIR/bin/{llama-bench,llama-server,llama-cli}"
