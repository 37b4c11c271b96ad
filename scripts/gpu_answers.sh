#!/usr/bin/env bash
# Answer prompt pools on a GPU host within a fixed time (after `pip install -e '.[cuda]'` or
# '.[rocm]'): the target's greedy answers (bf16, the served chat template, <= 256 new tokens),
# BATCH sequences at once (default 256), the target TARGET (default the smollm2-135m preset). Each
# pool of POOLS ("name:prompts.jsonl:archive_dir ...") is answered into $WORK/regen-NAME.jsonl,
# restored first from its archive (parts of 500 answers, meant to be committed), under
# `train.regen --time_budget`: the time left is shared equally by the pools not yet answered, and a
# stop leaves each pool's first prompts answered. Then, per pool:
#   - its archive's whole parts (all of them once the pool is answered) are in archive_dir (commit
#     them: a later call resumes from them);
#   - $WORK/answers-NAME.jsonl is the snapshot of the pool's longest head that the archive holds
#     (`train.regen --snapshot_archived`: rebuilt later from the committed parts alone), the DATA
#     of gpu_distill.sh;
#   - a line in OUT/answers.jsonl (pool size, answered, archived, snapshot size, seconds).
# Before them, SAMPLE="name:prompts.jsonl:archive_dir" first writes that pool: new chat requests
# (train.magpie into MAGPIE_CACHE, restored from and archived to MAGPIE_ARCHIVE, MAGPIE_OPENERS,
# BATCH at once) for SAMPLE_S seconds (at most SAMPLE_MAX more, default 20,000), then
# `train.prompts --sources magpie` over the cache's accepted requests less MAGPIE_EXCLUDE (its
# earlier pools, comma-separated) and their near duplicates, decontaminated against the benchmarks
# (DSPARK_DATA_DIR or the data cache; AIME: the file AIME names, if any); the pool joins POOLS.
# The log is OUT/gpu_answers.log.
# Usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S
# Environment: POOLS and/or SAMPLE, BATCH, MAX_NEW_TOKENS, RESERVE (seconds kept at the end,
# default 30), DATA_TAR (a tar of inputs extracted into the repository first), TARGET, WORK
# (default runs/gpu-answers), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S}
budget=${2:?usage: scripts/gpu_answers.sh OUT_DIR BUDGET_S}
t0=$(date +%s)
deadline=$((t0 + budget))
POOLS=${POOLS:-}
SAMPLE=${SAMPLE:-}
[ -n "$POOLS$SAMPLE" ] || { echo "POOLS or SAMPLE: the pools to answer, \"name:prompts.jsonl:archive_dir ...\""; exit 1; }
BATCH=${BATCH:-256}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
RESERVE=${RESERVE:-30}
WORK=${WORK:-runs/gpu-answers}
mkdir -p "$out" "$WORK"
summary="$out/answers.jsonl"
rm -f "$summary"
log="$out/gpu_answers.log"
: > "$log"
say() { echo "[gpu_answers $(($(date +%s) - t0))s] $*" | tee -a "$log"; }
. scripts/gpu_env.sh

regen() {   # name prompts archive, more train.regen flags
    $PY -m train.regen --prompts "$2" --out "$WORK/regen-$1.jsonl" --model "$TARGET" --dtype bfloat16 \
        --max_new_tokens "$MAX_NEW_TOKENS" --batch_size "$BATCH" --temperature 0 --archive "$3" "${@:4}"
}

if [ -n "$SAMPLE" ]; then
    IFS=: read -r name prompts archive <<< "$SAMPLE"
    : "${MAGPIE_CACHE:?}" "${MAGPIE_ARCHIVE:?}" "${SAMPLE_S:?SAMPLE_S: seconds of request sampling}"
    accepted() { "$PY" -c "import sys; from dspark_jax.data import magpie; print(len(magpie.queries(sys.argv[1])))" "$1"; }
    if [ -f "$MAGPIE_ARCHIVE" ]; then
        $PY -c "import sys; from dspark_jax.data import magpie; magpie.restore_archive(*sys.argv[1:])" \
            "$MAGPIE_ARCHIVE" "$MAGPIE_CACHE"
    fi
    before=$( [ -s "$MAGPIE_CACHE" ] && accepted "$MAGPIE_CACHE" || echo 0)
    say "$name: sampling requests for $SAMPLE_S s into $MAGPIE_CACHE ($before accepted so far)"
    $PY -m train.magpie --model "$TARGET" --dtype bfloat16 --batch_size "$BATCH" --openers "${MAGPIE_OPENERS:-}" \
        --num_queries $((before + ${SAMPLE_MAX:-20000})) --time_budget "$SAMPLE_S" --out "$MAGPIE_CACHE" \
        --archive "$MAGPIE_ARCHIVE" 2>&1 | tail -n 2 | tee -a "$log"
    first=$(accepted "$MAGPIE_CACHE")
    $PY -m train.prompts --sources magpie --magpie_cache "$MAGPIE_CACHE" --magpie_first "$first" \
        ${MAGPIE_EXCLUDE:+--exclude_pool "$MAGPIE_EXCLUDE"} ${AIME:+--aime_file "$AIME"} --out "$prompts" \
        2>&1 | grep -E "removed|wrote|: [0-9]+ " | tee -a "$log"
    say "$name: $((first - before)) new requests; the pool is train.prompts --magpie_first $first over them"
    POOLS="$SAMPLE${POOLS:+ $POOLS}"
fi
n_left=$(wc -w <<< "$POOLS")
for spec in $POOLS; do
    IFS=: read -r name prompts archive <<< "$spec"
    if [ ! -s "$prompts" ]; then say "$name: no prompts in $prompts, skipped"; n_left=$((n_left - 1)); continue; fi
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
    say "$name: $answered of $total answered in $((s1 - s0)) s, $archived archived, snapshot of the first $head"
    printf '{"name": "%s", "pool": %d, "answered": %d, "archived": %d, "snapshot": %d, "seconds": %d}\n' \
        "$name" "$total" "$answered" "$archived" "$head" "$((s1 - s0))" >> "$summary"
done
touch "$summary"
say "done: $summary"
