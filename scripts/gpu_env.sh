# Sourced by the GPU scripts (gpu_distill.sh, gpu_answers.sh): the interpreter, the payload's
# extras on PYTHONPATH (the GPU image lacks gguf and tensorboardX) and the target, assembled from
# `python -m benchmarks.gpu_payload pack`'s parts unless TARGET names one (then the preset name
# smollm2-135m, resolved to it); DATA_TAR (a tar of inputs) extracted into the repository. Needs
# `say` and `log`.
PY=${PYTHON:-python3}
payload=${DSPARK_GPU_PAYLOAD:-.gpu_payload}
export PYTHONUNBUFFERED=1
# the pure-JAX attention the CPU trains and answers with; DSPARK_KERNELS=auto runs the Pallas kernels
export DSPARK_KERNELS=${DSPARK_KERNELS:-off}
for z in "$payload"/extras/*.zip; do [ -f "$z" ] && export PYTHONPATH="$PWD/$z${PYTHONPATH:+:$PYTHONPATH}"; done
if [ -z "${TARGET:-}" ]; then
    $PY -m benchmarks.gpu_payload assemble --dir "$payload" 2>&1 | tail -n 2 | tee -a "$log"
    # the preset name resolves to the payload's converted target, so the caches and archives
    # written here pin the same `target` setting as those written on the CPU
    export DSPARK_CACHE="$PWD/$payload"
    TARGET=smollm2-135m
fi
if [ -n "${DATA_TAR:-}" ]; then tar -xf "$DATA_TAR"; say "extracted $DATA_TAR"; fi
