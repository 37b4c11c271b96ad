#!/usr/bin/env bash
# The GPU benchmark as one command on a GPU host, after `pip install -e '.[cuda]'` (or '.[rocm]';
# torch and transformers for the torch stage): kernel checks, the paged-MLA crossover, step timings
# for the demo pair and a K3-width slice, plain vs speculative generate() on the demo pair's real
# weights (the smollm2-135m preset) and transformers' decoding of the same weights. See
# benchmarks/gpu_bench.py for the stages and flags.
# Usage: scripts/gpu_bench.sh OUT_DIR [--stages a,b,...] [--budget_s S] [other gpu_bench flags]
# Writes OUT_DIR/results.json, OUT_DIR/table.md, OUT_DIR/bench.log. $PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR [gpu_bench flags]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m benchmarks.gpu_bench --out "$out" "$@"
