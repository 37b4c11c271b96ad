#!/usr/bin/env bash
# The GPU checks as one command on a GPU host with JAX for CUDA (or ROCm) and Flax installed
# (`pip install -e '.[cuda]'` or '.[rocm]'): the kernel and step stages of scripts/gpu_bench.sh,
#   1. every Pallas kernel compiled with the Triton lowering against its pure-JAX reference, and
#      timed (benchmarks.gpu_kernel_check), one kernel group at a time so one hang costs one group;
#   2. what a step costs: a target built from TARGET_CONFIG_JSON (default SmolLM2-135M) with random
#      weights and the demo draft, bf16, batch 1 / 8 / 32, with the kernels (`auto`) and with the
#      pure-JAX references (`off`) (benchmarks.decode_speed.step_costs).
# Usage: scripts/gpu_check.sh OUT_DIR [TARGET_CONFIG_JSON]. The whole benchmark: scripts/gpu_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [TARGET_CONFIG_JSON]}
cfg=${2:-dspark_jax/configs/smollm2-135m.json}
exec scripts/gpu_bench.sh "$out" --stages kernels,steps_demo --demo_config "$cfg"
