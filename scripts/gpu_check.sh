#!/usr/bin/env bash
# The GPU checks as one command for a lent GPU machine whose image already has JAX with CUDA (or
# ROCm) and Flax, and no package registry:
#   1. every Pallas kernel compiled with the Triton lowering against its pure-JAX reference, and
#      timed (benchmarks.gpu_kernel_check), one kernel group at a time so one hang costs one group;
#   2. what a step costs: SmolLM2-135M built from its config.json with random weights (a step's
#      cost does not depend on the values) and the demo draft, bf16, batch 1 / 8 / 32, with the
#      kernels and with the pure-JAX references (benchmarks.decode_speed --steps_only).
# Usage: scripts/gpu_check.sh OUT_DIR [TARGET_CONFIG_JSON]   (the kernel part took 106 s on an H200,
# compiles included; the step timings have not run there yet)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [TARGET_CONFIG_JSON]}
cfg=${2:-dspark_jax/configs/smollm2-135m.json}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } | tee "$out/machine.txt"

status=0
for group in mla_paged mla_prefill kda block_sparse; do
    timeout "${GROUP_TIMEOUT:-120}" python3 -m benchmarks.gpu_kernel_check --only "$group" 2>&1 | tee "$out/kernels-$group.log"
    rc=${PIPESTATUS[0]}; echo "== kernels $group: exit $rc"; [ "$rc" = 0 ] || status=1
done
for mode in auto off; do     # auto = the Pallas kernels on a GPU; off = the pure-JAX references
    DSPARK_KERNELS=$mode timeout "${STEPS_TIMEOUT:-180}" python3 -m benchmarks.decode_speed --steps_only \
        --random_weights --model "$cfg" --dtype bfloat16 --batch_sizes 1,8,32 --step_reps 20 \
        --output_json "$out/steps-$mode.json" 2>&1 | grep --line-buffered -v -i warning | tee "$out/steps-$mode.log"
    rc=${PIPESTATUS[0]}; echo "== steps (kernels $mode): exit $rc"; [ "$rc" = 0 ] || status=1
done
exit $status
