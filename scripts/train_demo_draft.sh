#!/usr/bin/env bash
# The demo draft's recipe: the shipped dspark_jax/drafts/smollm2-135m-dspark (a 2-layer MLA DSpark
# draft for SmolLM2-135M-Instruct with a 16,384-id draft vocabulary) distilled from scratch with the
# package's own programs:
#   1. data and answers    scripts/fetch_data.sh: GSM8K-train, IFEval and chat answers of the target
#                          (restored from datasets/; minutes)
#   2. vocabulary          train.vocab: the 16,384 most frequent answer tokens (no model: seconds)
#   3. base run            train.distill from a random init on the whole answer mix: 2,900 steps of
#                          64 sequences, peak lr 3e-4, cosine to 0; the mean of its last 5 exports
#   4. writing/role-play   two runs from the base on the writing and role-play answers alone (lr
#                          1e-4 for 250 steps of 16, 3e-4 for 200), cosine to 0; the mean of each
#                          run's last 5 exports, averaged with the base
#   5. long runs           two runs from that draft on the whole mix at a constant lr (1e-4 and
#                          2e-4) for 606 and 617 steps of 16; the draft is the mean of the two runs'
#                          means of their last 5 exports -> $OUT/smollm2-135m-dspark
#   6. evaluation          benchmarks.acceptance beside the shipped draft (GSM8K test, MT-Bench)
# Step 5 repeats the shipped draft's last two runs as they were made (data, lr, steps, seeds,
# averaging). Before them the shipped path had three rounds of runs on the writing and role-play
# answers, each averaged with its start; step 4 is the two-run round, once. The shipped draft's
# base came from shorter runs on growing parts of the same answers (about 3,100 steps of 16 on a
# CPU, then 2,153 steps of 64 on a GPU at peak lr 3e-4, cosine to 0, where 1e-4 measured worse),
# with an 8,192-id vocabulary widened to 16,384 before the long runs; here the base is one run of
# about as many sequences (186k) with every answer and the final vocabulary from the start. The
# recipe in this condensed form has not been run end to end: expect a comparable draft, not the
# same bytes (step 6 measures both side by side).
#
# Time on 2 cores of an Intel Xeon (KVM guest, AMX + AVX512-BF16; bf16 compute), from the shipped
# draft's own runs of the same shapes (December 2026): step 3 about 22 s per 16 sequences, about 70
# hours (on one NVIDIA H200, GPU=1: 0.09 s per step plus 80-105 s of compilation, JAX 0.11.2: about
# 6 minutes of training); step 4 two runs at once, one per core, 25-33 s per step, about 2 hours;
# step 5 two runs at once, 28-31 s per step when nothing else runs, 5-6 hours. bf16 compute is fast
# on CPUs with AVX512-BF16 (docs/profile.md). Every step resumes where it stopped: rerun the same
# command after an interruption, or set TIME_BUDGET to train in slices:
#     TIME_BUDGET=7200 nohup scripts/train_demo_draft.sh > runs/demo-draft.log 2>&1 &
#     DRY_RUN=1 scripts/train_demo_draft.sh          # the commands, without running them
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

OUT=${OUT:-runs/demo-draft}         # everything it writes (answers under $OUT/data)
GPU=${GPU:-0}                       # 1: train on the accelerator JAX sees (pip install -e '.[cuda]')
BASE_STEPS=${BASE_STEPS:-2900}      # the base run's length in steps of 64 sequences (sets its cosine schedule)
TIME_BUDGET=${TIME_BUDGET:-}        # seconds each training run may train per invocation (empty: to the end)
DRY_RUN=${DRY_RUN:-0}               # 1: print the commands instead of running them

DATA=$OUT/data
CONFIG=dspark_jax/configs/smollm2-135m-dspark.json
# sequences per forward pass (the optimizer steps stay 64 or 16 sequences); on a GPU the paired runs
# of steps 4 and 5 go one after the other, on a CPU at once, one per half of the cores
if [ "$GPU" = 1 ]; then MICRO64=32 MICRO16=16; else MICRO64=4 MICRO16=4; fi
# every run: bf16 teacher and compute, 512 tokens, 128 anchors per sequence, the last 5 exports kept,
# served tok/fwd on the 8 held-out chat requests at the start and every --eval_every steps
COMMON=(--target smollm2-135m --target_dtype bfloat16 --compute_dtype bfloat16 --max_len 512 --num_anchors 128
        --clip 1.0 --keep_exports 5 --eval_prompts_file "$DATA/heldout-magpie-8.jsonl"
        ${TIME_BUDGET:+--time_budget "$TIME_BUDGET"})

run() {   # a command, or with DRY_RUN=1 its line only; LOG=file appends its output there
    if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "$@"; echo "${LOG:+ >> $LOG}"
    elif [ -n "${LOG:-}" ]; then "$@" >> "$LOG" 2>&1
    else "$@"; fi
}
finished() { [ -d "$1/export/step_$(printf %07d "$2")" ]; }   # run dir, its last step
distill() {   # run dir, its last step, train.distill flags: trains or resumes the run, unless finished
    local dir=$1 last=$2; shift 2
    [ "$DRY_RUN" != 1 ] && finished "$dir" "$last" && return 0
    echo "[train_demo_draft] $dir to step $last (log: $dir.log)"
    LOG=$dir.log run ${PIN:-} python -m train.distill --run_dir "$dir" "${COMMON[@]}" "$@"
}
both() {   # two run functions: at once on a CPU (half the cores each), one after the other on a GPU
    local n; n=$(nproc)
    if [ "$GPU" = 1 ] || [ "$n" -lt 2 ] || [ "$DRY_RUN" = 1 ]; then "$1"; "$2"; return; fi
    local rc=0 a b
    PIN="taskset -c 0-$((n / 2 - 1))" "$1" & a=$!
    PIN="taskset -c $((n / 2))-$((n - 1))" "$2" & b=$!
    wait "$a" || rc=1
    wait "$b" || rc=1
    return $rc
}
stop_unless_finished() {   # run dir, last step, ...: a time budget stopped a run: rerun to go on
    [ "$DRY_RUN" = 1 ] && return 0
    while [ $# -gt 0 ]; do
        finished "$1" "$2" || { echo "[train_demo_draft] $1 stopped before step $2: rerun to continue"; exit 0; }
        shift 2
    done
}
mean() {   # out dir, drafts (directories and globs, comma-separated), more train.average flags
    local out=$1; shift
    [ -d "$out" ] || run python -m train.average --drafts "$@" --out "$out"
}

if [ "$DRY_RUN" != 1 ]; then
    mkdir -p "$OUT"
    exec 9>"$OUT/.lock"
    flock -n 9 || { echo "another train_demo_draft.sh is running in $OUT"; exit 1; }
fi

# 1. data and answers: the snapshots below and the held-out chat requests (scripts/fetch_data.sh)
DRY_RUN=$DRY_RUN scripts/fetch_data.sh "$DATA"
a=$DATA/answers
GENERAL="$a-gsm-ifeval-8009.jsonl,$a-magpie-2960.jsonl,$a-magpie2-2998.jsonl,$a-magpie3-2994.jsonl"
GENERAL="$GENERAL,$a-magpie4-2997.jsonl"
WRITING="$a-open-1500.jsonl,$a-open2-1498.jsonl,$a-open3-444.jsonl,$a-open4-2060.jsonl"
ROLE="$a-role-1500.jsonl,$a-role2-1500.jsonl,$a-role3-375.jsonl,$a-role4-1429.jsonl"
# the whole mix: about 40,000 sequences, the writing and role-play answers (MT-Bench's first turns
# are writing and role-play) named twice
MIX="$GENERAL,$WRITING,$WRITING,$ROLE,$ROLE"

# 2. vocabulary: the most frequent answer tokens covering 99 % of them (at least 16,383) and ids 2
# and 0 (end of turn, end of text): 16,384 ids, the only ones the draft's lm_head and Markov output
# side cover
VOCAB=$OUT/vocab-16384.json
[ -s "$VOCAB" ] || run python -m train.vocab --data "$GENERAL,$WRITING,$ROLE" --vocab_size 49152 --coverage 0.99 \
    --always 2,0 --min_size 16383 --out "$VOCAB"

# 3. base run: a fresh draft (random init) at that vocabulary, 2 % warmup, cosine to 0, exported
# every 100 steps; the mean of the last 5 exports
distill "$OUT/base" "$BASE_STEPS" --draft_config "$CONFIG" --draft_vocab "$VOCAB" --data "$MIX" \
    --total_steps "$BASE_STEPS" --global_batch 64 --micro_batch "$MICRO64" --lr 3e-4 --lr_schedule cosine \
    --warmup_frac 0.02 --seed 31 --save_every 100 --log_every 10 --eval_every 250
stop_unless_finished "$OUT/base" "$BASE_STEPS"
mean "$OUT/base-last5" "$OUT/base/export/step_*" --last 5

# 4. writing and role-play: two cosine runs from the base on those answers alone (about 10,100
# sequences), steps of 16; each run's mean of its last 5 exports, then the mean of those two means
# and the base (apart by seed and lr, the two runs average to a better draft than either, and the
# base keeps GSM8K)
chat() {   # name, peak lr, steps, seed
    distill "$OUT/chat-$1" "$3" --init_from "$OUT/base-last5" --data "$WRITING,$ROLE" --total_steps "$3" \
        --global_batch 16 --micro_batch "$MICRO16" --lr "$2" --lr_schedule cosine --warmup_frac 0.02 --seed "$4" \
        --save_every 10 --log_every 1 --eval_every 50
}
chat_a() { chat a 1e-4 250 41; }
chat_b() { chat b 3e-4 200 42; }
both chat_a chat_b
stop_unless_finished "$OUT/chat-a" 250 "$OUT/chat-b" 200
mean "$OUT/chat-a-last5" "$OUT/chat-a/export/step_*" --last 5
mean "$OUT/chat-b-last5" "$OUT/chat-b/export/step_*" --last 5
mean "$OUT/chat-soup" "$OUT/chat-a-last5,$OUT/chat-b-last5,$OUT/base-last5"

# 5. long runs: two runs from that soup on the whole mix, constant lr after 30 warmup steps (1 % of
# a 3,000-step schedule), steps of 16, stopped at steps 606 and 617 (a constant lr makes any step
# a valid stop); the draft is the mean of the two runs' means of their last 5 exports
long() {   # name, lr, last step, seed
    distill "$OUT/long-$1" "$3" --init_from "$OUT/chat-soup" --data "$MIX" --total_steps 3000 --stop_at "$3" \
        --global_batch 16 --micro_batch "$MICRO16" --lr "$2" --lr_schedule constant --warmup_frac 0.01 \
        --seed "$4" --save_every 10 --log_every 1 --eval_every 50
}
long_a() { long a 1e-4 606 51; }
long_b() { long b 2e-4 617 52; }
both long_a long_b
stop_unless_finished "$OUT/long-a" 606 "$OUT/long-b" 617
mean "$OUT/long-a-last5" "$OUT/long-a/export/step_*" --last 5
mean "$OUT/long-b-last5" "$OUT/long-b/export/step_*" --last 5
FINAL=$OUT/smollm2-135m-dspark
mean "$FINAL" "$OUT/long-a-last5,$OUT/long-b-last5"
echo "[train_demo_draft] the draft: $FINAL (config.json + model.safetensors; load_draft(\"$FINAL\"))"

# 6. evaluation: served tok/fwd (T = 7 drafts, greedy, float32 target, 128 new tokens) on the first
# 60 GSM8K test questions and MT-Bench's first 20 first turns, the new draft beside the shipped one;
# `python -m benchmarks.acceptance --compare A.json,B.json` pairs two result files prompt by prompt
[ -s "$OUT/acceptance.json" ] || run python -m benchmarks.acceptance --drafts "$FINAL,smollm2-135m-dspark" \
    --gsm8k 60 --mt_bench 20 --max_new_tokens 128 --output_json "$OUT/acceptance.json"
