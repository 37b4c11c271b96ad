#!/usr/bin/env bash
# Answer prompt pools on a lent GPU machine held for a fixed time: the target's greedy answers
# (bf16, the served chat template, <= 256 new tokens), BATCH sequences at once (default 256), with
# the target from `python -m benchmarks.gpu_payload pack`'s parts as in gpu_distill.sh. Each pool of
# POOLS ("name:prompts.jsonl:archive_dir ...", the prompts built here and carried in DATA_TAR or
# tracked) is answered into $WORK/regen-NAME.jsonl, restored first from its archive (committed
# parts of 500), under `train.regen --time_budget`: the time left is shared equally by the pools
# not yet answered, and a stop leaves each pool's first prompts answered. Then, per pool:
#   - its archive's whole parts (all of them once the pool is answered) go into OUT/answers.tar
#     (untar it in the repository and commit the parts: the next session resumes from them);
#   - $WORK/answers-NAME.jsonl, the snapshot of the pool's longest head that the archive holds
#     (`train.regen --snapshot_archived`: rebuilt later from the committed parts alone), stays on the
#     machine for gpu_distill.sh's DATA in the same command (`&&`; the machine keeps ignored files
#     between calls while it is held);
#   - OUT/answers.jsonl: a line per pool (pool size, answered, archived, snapshot size, seconds).
# Usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S
# Environment: POOLS (required), BATCH, MAX_NEW_TOKENS, RESERVE (seconds kept for the snapshots
# and the tar, default 30), DATA_TAR, TARGET, WORK (default runs/gpu-answers), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S}
budget=${2:?usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S}
t0=$(date +%s)
deadline=$((t0 + budget))
: "${POOLS:?POOLS: the pools to answer, \"name:prompts.jsonl:archive_dir ...\"}"
BATCH=${BATCH:-256}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
RESERVE=${RESERVE:-30}
WORK=${WORK:-runs/gpu-answers}
mkdir -p "$out" "$WORK"
rm -f "$WORK/answers.jsonl.tmp"
log="$out/gpu_answers.log"
say() { echo "[gpu_answers $(($(date +%s) - t0))s] $*" | tee -a "$log"; }
. scripts/gpu_env.sh

regen() {   # name prompts archive, more train.regen flags
    $PY -m train.regen --prompts "$2" --out "$WORK/regen-$1.jsonl" --model "$TARGET" --dtype bfloat16 \
        --max_new_tokens "$MAX_NEW_TOKENS" --batch_size "$BATCH" --temperature 0 --archive "$3" "${@:4}"
}

n_left=$(wc -w <<< "$POOLS")
archives=()
for spec in $POOLS; do
    IFS=: read -r name prompts archive <<< "$spec"
    [ -s "$prompts" ] || { say "$name: no prompt pool at $prompts"; exit 1; }
    share=$(( (deadline - $(date +%s) - RESERVE) / n_left ))
    n_left=$((n_left - 1))
    if [ "$share" -lt 20 ]; then say "$name: no time left (${share}s)"; continue; fi
    say "$name: answering $prompts, $share s"
    s0=$(date +%s)
    regen "$name" "$prompts" "$archive" --time_budget "$share" --snapshot "$WORK/answers-$name.jsonl" \
        --snapshot_archived 2>&1 | grep -v "^\s*$" | tail -n 6 | tee -a "$log"
    s1=$(date +%s)
    answered=$(wc -l < "$WORK/regen-$name.jsonl")
    total=$(wc -l < "$prompts")
    archived=$( (zcat "$archive"/part-*.jsonl.gz 2>/dev/null || true) | wc -l)
    head=$(wc -l < "$WORK/answers-$name.jsonl")
    if [ "$archived" -gt 0 ]; then archives+=("$archive"); fi
    say "$name: $answered of $total answered in $((s1 - s0)) s, $archived archived, snapshot of the first $head"
    printf '{"name": "%s", "pool": %d, "answered": %d, "archived": %d, "snapshot": %d, "seconds": %d}\n' \
        "$name" "$total" "$answered" "$archived" "$head" "$((s1 - s0))" >> "$WORK/answers.jsonl.tmp"
done
if [ -f "$WORK/answers.jsonl.tmp" ]; then mv "$WORK/answers.jsonl.tmp" "$out/answers.jsonl"; fi
if [ "${#archives[@]}" -gt 0 ]; then
    tar -cf "$out/answers.tar" "${archives[@]}"
    say "done: $out/answers.tar ($(du -h "$out/answers.tar" | cut -f1)), $out/answers.jsonl"
else
    say "done: nothing archived"
fi
