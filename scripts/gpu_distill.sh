#!/usr/bin/env bash
# Distil the demo draft on a GPU host within a fixed time (after `pip install -e '.[cuda]'` or
# '.[rocm]'): the target is TARGET (default the smollm2-135m preset), the answers regen snapshots
# (DATA; DATA_TAR, a tar of them, is extracted first). Several runs (RUNS) train at once on the one
# GPU, each a cosine run from INIT. Their length is planned from a short probe of the first run
# alone to end inside BUDGET seconds, with train.distill --time_budget as the backstop: the runs
# share the GPU, so a step of all of them is taken to cost the probe's step times their number
# (NVIDIA H200, 64 sequences of 512 tokens, 2026-12-04: 0.09 s alone, 0.17-0.19 s two at once).
# Probing all runs at once measures too little: their compilations end tens of seconds apart, so
# their probe steps do not overlap. Each run's mean of its last AVG exports is written to
# OUT/NAME/ (model.safetensors, config.json), and OUT/summary.json lists the runs with the
# model's sha256, the last step's metrics and the config.
# Usage: scripts/gpu_distill.sh OUT_DIR BUDGET_S [more train.distill flags]
# Environment: DATA (comma-separated snapshots, required), DATA_TAR (a tar extracted into the
# repository first), RUNS ("name:lr:seed[:flag,flag] ...": the flags, e.g.
# --draft_vocab=vocab.json, only for that run), STEPS (the runs' length: no probe, and runs a time
# budget stopped resume; OVERHEAD their start-up seconds, default 90), STEP_S (seconds per step of
# all runs at once, measured before: no probe, the length planned from it; OVERHEAD default 120),
# INIT, TARGET (default smollm2-135m), BATCH, MICRO, ANCHORS,
# MAX_LEN, AVG, PROBE (probe steps), RESERVE (seconds kept for averaging and the summary), WORK (run
# directories), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_distill.sh OUT_DIR BUDGET_S [train.distill flags]}
budget=${2:?usage: scripts/gpu_distill.sh OUT_DIR BUDGET_S [train.distill flags]}
shift 2
t0=$(date +%s)
deadline=$((t0 + budget))
RUNS=${RUNS:-"a:1e-4:30"}
INIT=${INIT:-dspark_jax/drafts/smollm2-135m-dspark}
BATCH=${BATCH:-64}
MICRO=${MICRO:-32}
ANCHORS=${ANCHORS:-128}
MAX_LEN=${MAX_LEN:-512}
AVG=${AVG:-5}
PROBE=${PROBE:-12}
RESERVE=${RESERVE:-45}
WORK=${WORK:-runs/gpu}
mkdir -p "$out" "$WORK"
log="$out/gpu_distill.log"
say() { echo "[gpu_distill $(($(date +%s) - t0))s] $*" | tee -a "$log"; }
. scripts/gpu_env.sh
: "${DATA:?DATA: the comma-separated regen snapshots to train on}"
# the probe's compiled steps serve the main runs (same shapes)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
n_runs=$(wc -w <<< "$RUNS")
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$("$PY" -c "print(round(0.9 / $n_runs, 2))")}

distill() {   # name lr seed run_dir total_steps run_flags (comma-separated), more flags
    local name=$1 lr=$2 seed=$3 dir=$4 steps=$5 own=(); shift 5
    IFS=, read -r -a own <<< "$1"; shift
    $PY -m train.distill --target "$TARGET" --target_dtype bfloat16 --data "$DATA" --init_from "$INIT" \
        --run_dir "$dir" --total_steps "$steps" --global_batch "$BATCH" --micro_batch "$MICRO" \
        --max_len "$MAX_LEN" --num_anchors "$ANCHORS" --lr "$lr" --lr_schedule cosine --warmup_frac 0.02 \
        --clip 1.0 --compute_dtype bfloat16 --log_every 10 --seed "$seed" "$@" "${own[@]}" > "$dir.log" 2>&1
}
at_once() {   # phase (probe|main), total steps, more flags: every run of RUNS at once (probe: the first)
    local phase=$1 steps=$2 pids=() spec name lr seed flags dir rc=0 specs=$RUNS; shift 2
    [ "$phase" = probe ] && specs=${RUNS%% *}
    for spec in $specs; do
        IFS=: read -r name lr seed flags <<< "$spec"
        dir="$WORK/$phase-$name"
        [ "$phase" = probe ] && rm -rf "$dir"
        mkdir -p "$dir"
        distill "$name" "$lr" "$seed" "$dir" "$steps" "$flags" "$@" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for spec in $specs; do
        IFS=: read -r name _ <<< "$spec"
        grep -E "step [0-9]+/|error|Error" "$WORK/$phase-$name.log" | tail -n 3 | sed "s/^/[$phase-$name] /" | tee -a "$log"
    done
    return $rc
}

if [ -n "${STEPS:-}" ]; then
    # a planned length given (e.g. a second call with the same WORK): no probe; main runs resume
    # from their run directories' checkpoints
    step_s=0 overhead=${OVERHEAD:-90} steps=$STEPS
    left=$((deadline - $(date +%s) - RESERVE))
elif [ -n "${STEP_S:-}" ]; then
    # a known step time (seconds per step of all runs at once): no probe, whose compilation costs
    # as much as the main runs'; OVERHEAD is their cold start-up
    step_s=$STEP_S overhead=${OVERHEAD:-120}
    left=$((deadline - $(date +%s) - RESERVE))
    steps=$("$PY" -c "print(max(10, int(($left - $overhead - 30) / $step_s)))")
else
p0=$(date +%s)
say "probe: $PROBE steps of $BATCH sequences, run ${RUNS%% *} alone; runs: $RUNS"
if ! at_once probe 100000 --stop_after "$PROBE" --save_every 100000 --keep_exports 1; then
    MICRO=$((MICRO / 2))       # out of memory is the likely cause: once more with half the micro-batch
    [ "$MICRO" -ge 1 ] || { say "probe failed"; exit 1; }
    say "probe failed; again with micro-batch $MICRO"
    p0=$(date +%s)
    at_once probe 100000 --stop_after "$PROBE" --save_every 100000 --keep_exports 1 || { say "probe failed"; exit 1; }
fi
p1=$(date +%s)
read -r step_s overhead <<< "$("$PY" - "$WORK" "$RUNS" "$((p1 - p0))" <<'EOF'
import json, statistics, sys
work, runs, wall = sys.argv[1], sys.argv[2].split(), float(sys.argv[3])
rows = [json.loads(l) for l in open(f"{work}/probe-{runs[0].split(':')[0]}/metrics.jsonl")]
alone = statistics.median(r["step_seconds"] for r in rows[2:])
# start-up: loading, compiling (the first step) and saving, all counted again for the main runs
print(f"{alone * len(runs):.4f} {wall - len(rows) * alone:.1f}")
EOF
)"
left=$((deadline - $(date +%s) - RESERVE))
# 30 s more for the main runs' 20 checkpoints and exports
steps=$("$PY" -c "print(max(10, int(($left - $overhead - 30) / $step_s)))")
fi
train_s=$((left - ${overhead%.*}))
[ "$train_s" -ge 10 ] || { say "no time left to train: ${left}s left, ${overhead}s start-up"; exit 1; }
every=$(( steps / 20 > 0 ? steps / 20 : 1 ))
say "plan: ${step_s}s/step with every run at once (0: not probed), ${overhead}s start-up and compilation; main runs: $steps steps, exports every $every, ${left}s left"
at_once main "$steps" --save_every "$every" --keep_exports "$AVG" --time_budget "$train_s" "$@" \
    || say "a main run failed (its log: $WORK/main-NAME.log)"

summary=()
for spec in $RUNS; do
    IFS=: read -r name lr seed _ <<< "$spec"
    dir="$WORK/main-$name"
    ls -d "$dir"/export/step_* > /dev/null 2>&1 || { say "$name: no export"; continue; }
    rm -rf "$dir-avg"
    $PY -m train.average --drafts "$dir/export/step_*" --last "$AVG" --out "$dir-avg" 2>&1 | tail -n 1 | tee -a "$log"
    rm -rf "${out:?}/$name"
    cp -r "$dir-avg" "$out/$name"
    last=$(tail -n 1 "$dir/metrics.jsonl")
    summary+=("$name" "$lr" "$seed" "$(sha256sum "$dir-avg/model.safetensors" | cut -d' ' -f1)" "$last"
              "$dir-avg/config.json")
done
"$PY" - "$out/summary.json" "$step_s" "$steps" "$BATCH" "${summary[@]}" <<'EOF'
import json, sys
path, step_s, steps, batch, rest = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
keys = ("name", "lr", "seed", "sha256", "last_step", "config")
runs = [dict(zip(keys, rest[i:i + len(keys)])) for i in range(0, len(rest), len(keys))]
for r in runs:
    r["last_step"] = json.loads(r["last_step"])
    r["config"] = json.load(open(r["config"]))   # the draft's config.json (a run may change its vocabulary)
json.dump({"probe_step_seconds": step_s, "planned_steps": steps, "global_batch": batch, "runs": runs},
          open(path, "w"), indent=1)
EOF
say "done: $out/summary.json"
