#!/usr/bin/env bash
# The GPU benchmark of issue 19 as one command for a lent GPU machine (no network; its image has
# JAX with CUDA or ROCm, Flax, torch and transformers): kernel checks, the paged-MLA crossover,
# step timings for the demo pair and a K3-width slice, plain vs speculative generate() on the demo
# pair's real weights and transformers' decoding of the same weights. See benchmarks/gpu_bench.py
# for the stages and flags and README "Benchmarks" for the run plan (the weights arrive in parts:
# `python -m benchmarks.gpu_payload pack` here first).
# Usage: scripts/gpu_bench.sh OUT_DIR [--stages a,b,...] [--budget_s S] [other gpu_bench flags]
# Writes OUT_DIR/results.json, OUT_DIR/table.md, OUT_DIR/bench.log. $PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR [gpu_bench flags]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m benchmarks.gpu_bench --out "$out" "$@"
