# Sourced by the GPU scripts (gpu_distill.sh, gpu_answers.sh): the interpreter, the target (TARGET,
# default the smollm2-135m preset, installed and converted on first use) and DATA_TAR (a tar of
# inputs) extracted into the repository. Needs `say` and `log`.
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# the pure-JAX attention, as on a CPU (the same numerics as CPU-made answers and drafts);
# DSPARK_KERNELS=auto runs the Pallas kernels
export DSPARK_KERNELS=${DSPARK_KERNELS:-off}
TARGET=${TARGET:-smollm2-135m}
if [ -n "${DATA_TAR:-}" ]; then tar -xf "$DATA_TAR"; say "extracted $DATA_TAR"; fi
