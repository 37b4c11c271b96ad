#!/usr/bin/env bash
# The demo draft's next GPU stage, in one device call once the payload is there (README "Stage 22's
# data on a GPU"; named for its data, chosen before the CPU's stage 22 made v22): new writing
# requests (Magpie, steered like the "open" pools: MT-Bench's writing first turns are the draft's
# weakest, 1.66 tok/fwd against 1.92 for role-play with v21), the target's
# answers to them (gpu_answers.sh, ANSWERS_S seconds, SAMPLE_S of them sampling), then distillation
# from the shipped draft (v31) on stage 22's data, the fourth writing pool (answered on the CPU) and
# those answers, both named twice (gpu_distill.sh,
# the rest of BUDGET_S).
# Inputs come in DATA_TAR, made here by `TAR=... scripts/demo_data.sh`: the snapshots and their
# --data list ($RUN/data-s22.txt), the earlier writing pools, the 16,384-id vocabulary and the
# decontamination files. Returns OUT/answers.tar and the runs' parts + summary.json.
# Usage: scripts/gpu_stage22.sh OUT_DIR BUDGET_S
# Environment: DATA_TAR, RUNS (default one run, K = 16,384, peak lr 3e-4), ANSWERS_S (default 2/5
# of the budget), SAMPLE_S (default 2/5 of ANSWERS_S), ANSWER_BATCH (256), TRAIN_BATCH (64), MICRO
# (32), STEP_S (the training plan's seconds per step, default 0.1 per run); the two scripts' other
# settings pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_stage22.sh OUT_DIR BUDGET_S}
budget=${2:?usage: scripts/gpu_stage22.sh OUT_DIR BUDGET_S}
t0=$(date +%s)
RUN=${RUN:-runs/demo}
ANSWERS_S=${ANSWERS_S:-$((budget * 2 / 5))}
# the writing pools' Magpie settings (scripts/demo_data.sh): a resumed cache must match them
OPENERS="Write,Compose,Draft,Craft,Describe,Imagine,Pretend,Act as,Create,Tell me a story,Edit,Rewrite"

SAMPLE="open5:$RUN/prompts-magpie-open-5.jsonl:datasets/answers-smollm2-135m-magpie-open-5" \
MAGPIE_CACHE="$RUN/magpie-open.jsonl" MAGPIE_ARCHIVE=datasets/magpie-open-smollm2-135m.jsonl.gz \
MAGPIE_OPENERS="$OPENERS" MAGPIE_EXCLUDE="$(echo "$RUN"/prompts-magpie-open{,-2,-3,-4}.jsonl | tr ' ' ,)" \
SAMPLE_S=${SAMPLE_S:-$((ANSWERS_S * 2 / 5))} AIME="$RUN/offline-data/aime2026.jsonl" \
DSPARK_DATA_DIR="$RUN/offline-data" BATCH=${ANSWER_BATCH:-256} \
    scripts/gpu_answers.sh "$out" "$ANSWERS_S"

[ -s "$RUN/data-s22.txt" ] || { echo "$RUN/data-s22.txt missing: make DATA_TAR with TAR=... scripts/demo_data.sh"; exit 1; }
data=$(cat "$RUN/data-s22.txt")
data="$data,$RUN/answers-open4-2060.jsonl,$RUN/answers-open4-2060.jsonl"   # the fourth writing pool, CPU answers
new=runs/gpu-answers/answers-open5.jsonl
if [ -s "$new" ]; then data="$data,$new,$new"; fi
RUNS=${RUNS:-"k16:3e-4:34:--draft_vocab=$RUN/vocab-s22-16384.json"}
# no probe: a step of 64 took 0.09 s with one run on an H200, 0.17-0.19 s with two (stage 21)
DATA_TAR="" DATA="$data" RUNS="$RUNS" STEP_S=${STEP_S:-$(awk -v n="$(wc -w <<< "$RUNS")" 'BEGIN { print 0.1 * n }')} \
BATCH=${TRAIN_BATCH:-64} MICRO=${MICRO:-32} \
    scripts/gpu_distill.sh "$out" $((t0 + budget - $(date +%s)))
