#!/usr/bin/env bash
# The demo draft: a 2-layer MLA DSpark draft for SmolLM2-135M-Instruct, distilled on this CPU
# machine with the package's own pipeline. Every stage resumes where it stopped, so rerunning this
# script after an interruption continues the run:
#     nohup scripts/demo_draft.sh > runs/demo/pipeline.log 2>&1 &
# Stages: (1) prompt pool; (2) the target's greedy answers (T=0, <= 256 new tokens, 16 at a time)
# to the first LIMIT prompts, frozen as a snapshot; (3) stage-1 distillation (online teacher, 64
# anchors per sequence, STEPS steps) = v0; (4) more answers (the first LIMIT2 prompts) and stage 2
# from stage 1's draft (128 anchors, STEPS2 steps) = v1; (5) stage 3 from v1 with the offline
# teacher: those answers' teacher states written once to shards, then STEPS3 steps streamed from
# them = v2; (6) the torch-layout draft copied to $RUN/$NAME; (7) acceptance beside the untrained
# draft. Outputs stay under runs/ (gitignored).
# The shipped draft (dspark_jax/drafts/smollm2-135m-dspark) is v31: this script's output with the
# defaults below (stage 29: two constant-lr runs from stage 26's soup, stopped at STOP29A and STOP29B,
# the mean of the two runs' means of their last 5 exports (v29: stopped at 372 and 385, that mean
# averaged with stage 26's soup, SOUP29=1); stage 26: v23 moved to 16,384 ids and
# trained, the mean of its last exports averaged with v23 at those ids; v23 = stage 23: two runs from v22 on this CPU, STEPS23A and STEPS23B steps, each the
# mean of its last AVG23 exports, averaged with v22; v22 = stage 22: v21 trained STEPS22 steps on this
# CPU, the mean of its last AVG22 exports averaged with v21; v21 = stage 21: v20 trained on a GPU,
# STEPS21 steps of BATCH21 sequences, the lr decayed to 0, the mean of its last AVG21 exports;
# v20 = stage 20: one run of STEPS20 steps, the mean of its last AVG20 exports, averaged with stage
# 19's draft;
# stages 6-12 hold a constant lr and stop at STOPn of 900, so any step is a valid stop there).
# STAGES=29 STOP29A=372 STOP29B=385 SOUP29=1 gives v29 (the previous shipped draft), 26 stage 26's soup (not shipped), 23 v23, 22 v22, 21 v21, 20 v20, 19 v19, 18 v18, 17 v17, 16 v16, 15 v15, 14 v14, 13 v13,
# 12 v12, 11 v11, 10 v10, 9 v9, 8 v8, 7 v7, 6 v6, STAGES=5 v5, STAGES=5 STOP5=210 v4, STAGES=4 STOP4=120 v3, STAGES=3 v2, 2 v1, 1 v0. Runs repeat the recipe,
# not the bits: v0 was trained on the same 591 rows in the cache's completion order (the snapshot
# holds them in pool order), and of v4/v5's 1,737 answers (v6's 2,400) the first 1,145 came from
# the float32 target and the rest from the bfloat16 one (each answer records its dtype). v6 was
# started from the shipped v5 file, which is stage 5's export at step 300; v7 from the shipped v6
# file (stage 6's mean), its run stopped and resumed at step 50, from where it ran this package's
# faster training step (the same loss; the bf16 teacher lm_head's rounding differs); v8 from the
# shipped v7 file (stage 7's mean), v9 from the shipped v8 file (stage 8's mean), v10 from the
# shipped v9 file, v12 from the shipped v11 file, v13 from the shipped v12 file, v14 from the
# shipped v13 file, v15 from the shipped v14 file, v16 from the shipped v15 file, v18 from the
# shipped v17 file, v19 from the shipped v18 file, v20 from the shipped v19 file, v21 from the
# shipped v20 file on an H200 (stopped by its time budget at step 1,145, resumed to 2,153 in a
# second device call), v22 from the shipped v21 file, v23 from the shipped v22 file, v17 from the
# shipped v16 file (v16's last 9 of 8,009 GSM8K/IFEval answers and 1 of 500 steered ones
# generated anew on an AMX CPU); the Magpie requests (the first 3,000 sampled on the ninth session's
# CPU, 3,000 more on the eleventh's, 3,000 on the twelfth's and thirteenth's, the steered ones on
# the fifteenth's, the role-play ones on the nineteenth's) are restored from their
# committed archives (sampling differs from CPU to CPU).
# Options: WARM=1 starts stage 1 from the target's weights (train.distill --warm_start) instead of a
# random init; EVAL_EVERY=N measures the held-out served tok/fwd (GSM8K test 60..67) every N steps
# in every stage (<run_dir>/eval.jsonl, learning_curve.png, TensorBoard eval/*); LR_SCHEDULE=constant
# holds the lr after warmup. The ablations at equal CPU time (vocabulary, warm start): scripts/ablate.sh.
# The DFlash-style ablation (no Markov head; the confidence head then reads h_k only), trained the
# same way as v0 on the same answers:  ABLATION=1 STAGES=1 scripts/demo_draft.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN=${RUN:-runs/demo}
LIMIT=${LIMIT:-591}           # stage 1: the first N prompts of the ~17k-prompt pool (589 usable answers)
STEPS=${STEPS:-80}            # stage 1: optimizer steps of 16 sequences (2.2 epochs)
LIMIT2=${LIMIT2:-882}         # stage 2: the first N prompts (880 usable answers)
STEPS2=${STEPS2:-80}          # stage 2: optimizer steps of 16 sequences
STEPS3=${STEPS3:-160}         # stage 3: optimizer steps of 16 sequences, offline teacher
LIMIT4=${LIMIT4:-1123}        # stage 4: the first N prompts, GSM8K train first
VOCAB_K=${VOCAB_K:-8192}      # stage 4: draft vocabulary size (at least)
STEPS4=${STEPS4:-300}         # stage 4: the run's length in optimizer steps of 16 sequences (sets the warmup)
STOP4=${STOP4:-140}           # stage 4: steps this invocation runs (constant lr: any step is a valid stop)
LIMIT5=${LIMIT5:-1737}        # stage 5: the first N prompts, GSM8K train first
STEPS5=${STEPS5:-600}         # stage 5: the run's length in optimizer steps (sets the warmup)
STOP5=${STOP5:-300}           # stage 5: steps this invocation runs (v5: 300, v4: 210)
LIMIT6=${LIMIT6:-2400}        # stage 6: the first N prompts, GSM8K train first
STEPS6=${STEPS6:-900}         # stage 6: the run's length in optimizer steps (sets the warmup)
STOP6=${STOP6:-140}           # stage 6: steps this invocation runs (v6: 140)
AVG6=${AVG6:-5}               # stage 6: the shipped draft is the mean of the last AVG6 exports (10 steps apart)
LIMIT7=${LIMIT7:-3150}        # stage 7: the first N prompts, GSM8K train first
STEPS7=${STEPS7:-900}         # stage 7: the run's length in optimizer steps (sets the warmup)
STOP7=${STOP7:-130}           # stage 7: steps this invocation runs (v7: 130)
AVG7=${AVG7:-5}               # stage 7: the mean of the last AVG7 exports
LIMIT8=${LIMIT8:-5280}        # stage 8: the first N prompts, GSM8K train first
STEPS8=${STEPS8:-900}         # stage 8: the run's length in optimizer steps (sets the warmup)
STOP8=${STOP8:-130}           # stage 8: steps this invocation runs (v8: 130)
AVG8=${AVG8:-5}               # stage 8: the mean of the last AVG8 exports
LIMIT9=${LIMIT9:-6790}        # stage 9: the first N prompts, GSM8K train first
STEPS9=${STEPS9:-900}         # stage 9: the run's length in optimizer steps (sets the warmup)
STOP9=${STOP9:-130}           # stage 9: steps this invocation runs (v9: 130)
AVG9=${AVG9:-5}               # stage 9: the mean of the last AVG9 exports
LIMIT10=${LIMIT10:-8009}      # stage 10: every GSM8K-train prompt, then every IFEval one
STEPS10=${STEPS10:-900}       # stage 10: the run's length in optimizer steps (sets the warmup)
STOP10=${STOP10:-90}          # stage 10: steps this invocation runs (v10: 90)
AVG10=${AVG10:-5}             # stage 10: the mean of the last AVG10 exports
MAGPIE11=${MAGPIE11:-1200}    # stage 11: answers to the first N of the target's own chat requests (Magpie)
REPEAT11=${REPEAT11:-4}       # stage 11: the chat answers named this many times in --data (oversampled)
STEPS11=${STEPS11:-900}       # stage 11: the run's length in optimizer steps (sets the warmup)
STOP11=${STOP11:-120}         # stage 11: steps this invocation runs (v11: 120)
AVG11=${AVG11:-5}             # stage 11: the mean of the last AVG11 exports
MAGPIE12=${MAGPIE12:-2960}    # stage 12: answers to the first N Magpie requests (all but the held-out 40)
REPEAT12=${REPEAT12:-3}       # stage 12: the chat answers named this many times in --data (oversampled)
STEPS12=${STEPS12:-900}       # stage 12: the run's length in optimizer steps (sets the warmup)
STOP12=${STOP12:-180}         # stage 12: steps this invocation runs (v12: 180)
AVG12=${AVG12:-5}             # stage 12: the mean of the last AVG12 exports
MAGPIE13=${MAGPIE13:-1060}    # stage 13: answers to the first N requests of the second Magpie pool
REPEAT13=${REPEAT13:-3}       # stage 13: those answers named this many times in --data
STEPS13=${STEPS13:-240}       # stage 13: the run's length in optimizer steps (cosine decay to 0 over it)
AVG13=${AVG13:-5}             # stage 13: the mean of the last AVG13 exports
MAGPIE14=${MAGPIE14:-2998}    # stage 14: answers to the first N requests of the second Magpie pool (all of it)
REPEAT14=${REPEAT14:-2}       # stage 14: those answers named this many times in --data
STEPS14=${STEPS14:-180}       # stage 14: the run's length in optimizer steps (cosine decay to 0 over it)
AVG14=${AVG14:-5}             # stage 14: the mean of the last AVG14 exports
MAGPIE15=${MAGPIE15:-2994}    # stage 15: answers to the first N requests of the third Magpie pool (all of it)
REPEAT15=${REPEAT15:-2}       # stage 15: those answers named this many times in --data
STEPS15=${STEPS15:-180}       # stage 15: the run's length in optimizer steps (cosine decay to 0 over it)
AVG15=${AVG15:-5}             # stage 15: the mean of the last AVG15 exports
MAGPIE16=${MAGPIE16:-500}     # stage 16: answers to the first N steered requests (train.magpie --openers)
REPEAT16=${REPEAT16:-5}       # stage 16: those answers named this many times in --data
STEPS16=${STEPS16:-180}       # stage 16: the run's length in optimizer steps (cosine decay to 0 over it)
AVG16=${AVG16:-5}             # stage 16: the mean of the last AVG16 exports
VOCAB16=${VOCAB16:-0}         # stage 16: 1 = the vocabulary re-chosen on its answers (v16c), 0 = stage 4's
MAGPIE17=${MAGPIE17:-1500}    # stage 17: answers to the first N steered requests (all of their pool)
REPEAT17=${REPEAT17:-3}       # stage 17: those answers named this many times in --data
STEPS17=${STEPS17:-180}       # stage 17: each run's length in optimizer steps (cosine decay to 0 over it)
AVG17=${AVG17:-5}             # stage 17: each run's mean of its last AVG17 exports
MAGPIE18=${MAGPIE18:-1498}    # stage 18: answers to the first N requests of the second steered pool (all)
REPEAT18A=${REPEAT18A:-3}     # stage 18: both steered pools' answers named this many times (run a) ...
REPEAT18B=${REPEAT18B:-2}     # ... and this many (run b)
STEPS18=${STEPS18:-180}       # stage 18: each run's length in optimizer steps (cosine decay to 0 over it)
AVG18=${AVG18:-5}             # stage 18: each run's mean of its last AVG18 exports
MAGPIE19=${MAGPIE19:-1509}    # stage 19: answers to the first N requests of the fourth Magpie pool
STEPS19=${STEPS19:-180}       # stage 19: the run's length in optimizer steps (cosine decay to 0 over it)
AVG19=${AVG19:-5}             # stage 19: the mean of the last AVG19 exports
ROLE20=${ROLE20:-1000}        # stage 20: answers to the first N role-play-steered requests
REPEAT20=${REPEAT20:-3}       # stage 20: those answers named this many times in --data
STEPS20=${STEPS20:-150}       # stage 20: the run's length in optimizer steps (cosine decay to 0 over it)
AVG20=${AVG20:-5}             # stage 20: the mean of the last AVG20 exports
STEPS21=${STEPS21:-2153}      # stage 21: the run's length in optimizer steps of BATCH21 sequences (cosine to 0)
BATCH21=${BATCH21:-64}        # stage 21: sequences per step (two micro-batches of 32)
LR21=${LR21:-3e-4}            # stage 21: peak lr (v21; 1e-4 measured worse)
AVG21=${AVG21:-5}             # stage 21: the mean of the last AVG21 exports (107 steps apart)
STEPS22=${STEPS22:-250}       # stage 22: the run's length in optimizer steps of 16 (cosine decay to 0 over it)
AVG22=${AVG22:-5}             # stage 22: the mean of the last AVG22 exports
STEPS23A=${STEPS23A:-250}     # stage 23: run a's length in optimizer steps of 16 (peak lr 1e-4)
STEPS23B=${STEPS23B:-200}     # stage 23: run b's length (peak lr 3e-4)
AVG23=${AVG23:-5}             # stage 23: each run's mean of its last AVG23 exports
STEPS26A=${STEPS26A:-400}     # stage 26: the schedule its first STOP26 steps ran on (cosine, peak lr 3e-4) ...
STOP26=${STOP26:-150}
STEPS26=${STEPS26:-340}       # ... and the one it then ran to its end on
AVG26=${AVG26:-5}             # stage 26: the mean of its last AVG26 exports
STOP29A=${STOP29A:-606}       # stage 29: the step run a (constant lr 1e-4) stops at ...
STOP29B=${STOP29B:-617}       # ... and run b (constant lr 2e-4); v29: STOP29A=372 STOP29B=385 SOUP29=1
SOUP29=${SOUP29:-0}           # stage 29: 1 = the runs' means averaged with the start (soup), 0 = the means alone
ROLE_OPENERS="Pretend you are,Act as a,Play the role of,Take on the role of,Imagine you are,You are a,Write an email,Write a blog post,Write a short story"
OPENERS="Write,Compose,Draft,Craft,Describe,Imagine,Pretend,Act as,Create,Tell me a story,Edit,Rewrite"
STAGES=${STAGES:-29}
for m in "$MAGPIE11" "$MAGPIE12"; do
    [ "$m" -le 2960 ] || { echo "MAGPIE11/12=$m: the Magpie pool's last 40 of 3,000 are held out (at most 2960)"; exit 2; }
done
EVAL_EVERY=${EVAL_EVERY:-0}   # held-out tok/fwd every N steps (0: off)
LR_SCHEDULE=${LR_SCHEDULE:-cosine}
CONFIG=dspark_jax/configs/smollm2-135m-dspark.json
NAME=smollm2-135m-dspark
if [ -n "${WARM:-}" ]; then NAME=$NAME-warm; fi   # its own run dirs: never resume a random-init run
mkdir -p "$RUN"
if [ -n "${ABLATION:-}" ]; then
    NAME=smollm2-135m-dflash-ablation
    python -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(markov_rank=0, confidence_head_with_markov=False); json.dump(c, open(sys.argv[2], 'w'), indent=1)" \
        "$CONFIG" "$RUN/$NAME.json"
    CONFIG="$RUN/$NAME.json"
fi

exec 9>"$RUN/$NAME.lock"
flock -n 9 || { echo "another demo_draft.sh is running for $RUN/$NAME"; exit 1; }

# (1) prompts: GSM8K train, MATH train, IFEval, stdlib code; deduplicated and decontaminated
if [ ! -s "$RUN/prompts.jsonl" ]; then
    python -m train.prompts --out "$RUN/prompts.jsonl"
fi

answers() {   # answers of the first $1 prompts, frozen in pool order as $RUN/answers-$1.jsonl (resumable)
    python -m train.regen --prompts "$RUN/prompts.jsonl" --out "$RUN/regen.jsonl" --model smollm2-135m \
        --dtype float32 --max_new_tokens 256 --batch_size 16 --temperature 0 --limit "$1" \
        --snapshot "$RUN/answers-$1.jsonl"
}
distill() {   # run dir, steps, anchors, data flags (resumes from the run dir's checkpoints)
    local dir=$1 steps=$2 anchors=$3; shift 3
    python -m train.distill --target smollm2-135m --target_dtype float32 \
        --run_dir "$dir" --total_steps "$steps" --global_batch 16 --micro_batch 4 --max_len 512 \
        --num_anchors "$anchors" --lr 6e-4 --warmup_frac 0.04 --min_lr_frac 0.1 --clip 1.0 \
        --compute_dtype float32 --save_every 5 --log_every 1 --lr_schedule "$LR_SCHEDULE" \
        --eval_every "$EVAL_EVERY" "$@"
}
last_export() { ls -d "$1"/export/step_* | sort | tail -1; }
gsm_answers() {   # the first $1 prompts, GSM8K train first, answered by the $2 target $3 at a time, frozen
    python -m train.regen --prompts "$RUN/prompts.jsonl" --out "$RUN/regen.jsonl" --model smollm2-135m \
        --dtype "$2" --max_new_tokens 256 --batch_size "$3" --temperature 0 --first_sources gsm8k_train \
        --archive datasets/answers-smollm2-135m --limit "$1" --snapshot "$RUN/answers-gsm-$1.jsonl"
}
distill_gsm() {   # stage, answers, total steps, steps this run, compute dtype, seed, more flags: from $final
    local stage=$1 limit=$2; shift 2
    distill_on "$stage" "$RUN/answers-gsm-$limit.jsonl" "$@"
}
distill_on() {   # stage, --data, total steps, steps this run, compute dtype, seed, more flags: from $final
    local stage=$1 data=$2 steps=$3 stop=$4 dtype=$5 seed=$6; shift 6
    python -m train.distill --target smollm2-135m --target_dtype bfloat16 --data "$data" \
        --init_from "$final" --run_dir "$RUN/distill-$NAME-$stage" --total_steps "$steps" --global_batch 16 \
        --micro_batch 4 --max_len 512 --num_anchors 128 --lr "${lr:-3e-4}" --lr_schedule "${schedule:-constant}" --warmup_frac 0.02 \
        --clip 1.0 --compute_dtype "$dtype" --save_every 10 --log_every 1 --eval_every 30 --seed "$seed" \
        --stop_after "$stop" "$@"
}
averaged_gsm() {   # stage, answers, total steps, steps this run, exports averaged, seed: bf16 answers 8 at a
    # time and bf16 compute, from $final; sets $final to the mean of the last exports
    local stage=$1 limit=$2 steps=$3 stop=$4 avg=$5 seed=$6
    gsm_answers "$limit" bfloat16 8
    averaged "$stage" "$RUN/answers-gsm-$limit.jsonl" "$steps" "$stop" "$avg" "$seed"
}
averaged() {   # stage, --data, total steps, steps this run, exports averaged, seed, more flags: bf16
    # compute, from $final; sets $final to the mean of the last exports
    local stage=$1 data=$2 steps=$3 stop=$4 avg=$5 seed=$6; shift 6
    distill_on "$stage" "$data" "$steps" "$stop" bfloat16 "$seed" --keep_exports "$avg" "$@"
    final="$RUN/distill-$NAME-$stage/average-$stop-last$avg"
    [ -d "$final" ] || python -m train.average --drafts "$RUN/distill-$NAME-$stage/export/step_*" --last "$avg" \
        --out "$final"
}

souped() {   # stage, steps, exports averaged, then peak lr, seed, --data of run a and of run b: two
    # cosine runs from $final (run them at once, one per core), each the mean of its last exports;
    # sets $final to the mean of the two means (a weight soup)
    local stage=$1 steps=$2 avg=$3 start=$final mean_a
    lr=$4 schedule=cosine averaged "${stage}a" "$6" "$steps" "$steps" "$avg" "$5" \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
    mean_a=$final
    final=$start
    lr=$7 schedule=cosine averaged "${stage}b" "$9" "$steps" "$steps" "$avg" "$8" \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
    [ -d "$RUN/distill-$NAME-$stage-soup" ] || python -m train.average --drafts "$mean_a,$final" \
        --out "$RUN/distill-$NAME-$stage-soup"
    final="$RUN/distill-$NAME-$stage-soup"
}

chat_mix() {   # the answers to the first $1 Magpie requests (restored from their archive, the rest
    # generated), frozen as a snapshot; sets $data to stage 10's answers plus that snapshot named $2 times
    python -m train.regen --prompts "$RUN/prompts-magpie.jsonl" --out "$RUN/regen-magpie.jsonl" --model smollm2-135m \
        --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive datasets/answers-smollm2-135m-magpie --limit "$1" --snapshot "$RUN/answers-magpie-$1.jsonl"
    data="$RUN/answers-gsm-ifeval-$LIMIT10.jsonl"
    for _ in $(seq "$2"); do data="$data,$RUN/answers-magpie-$1.jsonl"; done
}

magpie_pool() {   # pool number, requests sampled, earlier pools: the pool of the cache's first N requests
    # less the earlier pools' prompts, their near-duplicates and benchmark overlaps; its answers to
    # the first $4 requests (restored from their archive, the rest generated) frozen as
    # $RUN/answers-magpie$1-$4.jsonl
    local n=$1 first=$2 exclude=$3 limit=$4
    python -m train.magpie --dtype bfloat16 --num_queries "$first" --out "$RUN/magpie.jsonl" \
        --archive datasets/magpie-smollm2-135m.jsonl.gz
    [ -s "$RUN/prompts-magpie-$n.jsonl" ] || python -m train.prompts --sources magpie --magpie_cache "$RUN/magpie.jsonl" \
        --magpie_first "$first" --exclude_pool "$exclude" --aime_file ../shared/data/aime2026.jsonl \
        --out "$RUN/prompts-magpie-$n.jsonl"
    python -m train.regen --prompts "$RUN/prompts-magpie-$n.jsonl" --out "$RUN/regen-magpie-$n.jsonl" --model smollm2-135m \
        --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive "datasets/answers-smollm2-135m-magpie-$n" --limit "$limit" --snapshot "$RUN/answers-magpie$n-$limit.jsonl"
}

steered_answers() {   # the answers to the first $1 requests of steered pool $2 (default 1; restored
    # from their archive, the rest generated), frozen as $RUN/answers-open-$1.jsonl (pool 2: open2-)
    local suffix="" tag=open
    if [ "${2:-1}" != 1 ]; then suffix="-$2"; tag="open$2"; fi
    python -m train.regen --prompts "$RUN/prompts-magpie-open$suffix.jsonl" --out "$RUN/regen-magpie-open$suffix.jsonl" \
        --model smollm2-135m --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive "datasets/answers-smollm2-135m-magpie-open$suffix" --limit "$1" --snapshot "$RUN/answers-$tag-$1.jsonl"
}

# (2, 3) stage 1 (v0): SmolLM2's answers through generate() with the serving chat template, then
# distillation from a random init
[ -s "$RUN/answers-$LIMIT.jsonl" ] || answers "$LIMIT"
distill "$RUN/distill-$NAME-1" "$STEPS" 64 --data "$RUN/answers-$LIMIT.jsonl" --draft_config "$CONFIG" --seed 0 \
    ${WARM:+--warm_start}
final=$(last_export "$RUN/distill-$NAME-1")

# (4) stage 2 (v1): more answers, then distillation continued from stage 1's draft (fresh optimizer)
if [ "$STAGES" -ge 2 ]; then
    [ -s "$RUN/answers-$LIMIT2.jsonl" ] || answers "$LIMIT2"
    distill "$RUN/distill-$NAME-2" "$STEPS2" 128 --data "$RUN/answers-$LIMIT2.jsonl" --init_from "$final" --seed 1
    final=$(last_export "$RUN/distill-$NAME-2")
fi

# (5) stage 3 (v2): the same answers' teacher states written once to shards (offline teacher,
# 15 min, 3.3 GB: the target's prefill leaves the training step, ~20 % of its cost at 128
# anchors: 38-41 s/step alone), then STEPS3 steps streamed from them (2.9 epochs) from stage 2's draft
if [ "$STAGES" -ge 3 ]; then
    python -m train.teacher --target smollm2-135m --dtype float32 --data "$RUN/answers-$LIMIT2.jsonl" \
        --draft_config "$CONFIG" --out "$RUN/teacher-$LIMIT2" --shard_size 64 --batch_size 4 --max_len 512
    distill "$RUN/distill-$NAME-3" "$STEPS3" 128 --teacher_dir "$RUN/teacher-$LIMIT2" --init_from "$final" --seed 2
    final=$(last_export "$RUN/distill-$NAME-3")
fi

# (5b) stage 4 (v3, STAGES=4): GSM8K-train answers first (the committed archive
# datasets/answers-smollm2-135m restores the first ones), frozen as the first LIMIT4 of that order;
# a reduced draft vocabulary chosen on them (99.5 % of answer tokens, at least VOCAB_K ids); v2 cut
# down to it (train.distill --init_from v2 --draft_vocab) and trained STEPS4 steps at a constant lr
# with the held-out eval every 30 steps
if [ "$STAGES" -ge 4 ]; then
    gsm_answers "$LIMIT4" float32 32
    python -m train.vocab --data "$RUN/answers-gsm-$LIMIT4.jsonl" --vocab_size 49152 --coverage 0.995 \
        --always 2,0 --min_size "$VOCAB_K" --out "$RUN/vocab-gsm-$LIMIT4-$VOCAB_K.json"
    python -m train.distill --target smollm2-135m --target_dtype float32 --data "$RUN/answers-gsm-$LIMIT4.jsonl" \
        --init_from "$final" --draft_vocab "$RUN/vocab-gsm-$LIMIT4-$VOCAB_K.json" --run_dir "$RUN/distill-$NAME-4" \
        --total_steps "$STEPS4" --global_batch 16 --micro_batch 4 --max_len 512 --num_anchors 128 --lr 3e-4 \
        --lr_schedule constant --warmup_frac 0.03 --clip 1.0 --compute_dtype float32 --save_every 10 \
        --log_every 1 --eval_every 30 --seed 3 --stop_after "$STOP4"
    final="$RUN/distill-$NAME-4/export/step_$(printf %07d "$STOP4")"
fi

# (5c) stage 5 (v5, STAGES=5; v4 = STOP5=210): more GSM8K-train answers (the bf16 target: 2.5x the answers per
# CPU-hour, docs/profile.md), stage 4's draft trained on them with the bf16 online teacher
# (benchmarks.teacher_cost: the cheapest teacher per sequence here), constant lr, fresh optimizer
if [ "$STAGES" -ge 5 ]; then
    gsm_answers "$LIMIT5" bfloat16 32
    distill_gsm 5 "$LIMIT5" "$STEPS5" "$STOP5" float32 4
    final="$RUN/distill-$NAME-5/export/step_$(printf %07d "$STOP5")"
fi

# (5d) stage 6 (v6, STAGES=6): more GSM8K-train answers (the bf16 target, 8 at a time: the batch
# with the most tokens/s here, docs/profile.md), stage 5's draft trained on them with bf16 compute
# (about 20 % faster per step than float32 on a CPU with AVX512-BF16), the last exports kept and
# averaged (train.average: at a constant lr the mean of the last few accepts more than the last one)
if [ "$STAGES" -ge 6 ]; then
    averaged_gsm 6 "$LIMIT6" "$STEPS6" "$STOP6" "$AVG6" 6
fi

# (5e) stage 7 (v7, STAGES=7): more GSM8K-train answers, stage 6's mean trained on them the same
# way (fresh optimizer, seed 7), the mean of its last exports
if [ "$STAGES" -ge 7 ]; then
    averaged_gsm 7 "$LIMIT7" "$STEPS7" "$STOP7" "$AVG7" 7
fi

# (5f) stage 8 (v8, STAGES=8): more GSM8K-train answers, stage 7's mean trained on them the same
# way (seed 8), the mean of its last exports
if [ "$STAGES" -ge 8 ]; then
    averaged_gsm 8 "$LIMIT8" "$STEPS8" "$STOP8" "$AVG8" 8
fi

# (5g) stage 9 (v9, STAGES=9): more GSM8K-train answers, stage 8's mean trained on them the same
# way (seed 9), the mean of its last exports
if [ "$STAGES" -ge 9 ]; then
    averaged_gsm 9 "$LIMIT9" "$STEPS9" "$STOP9" "$AVG9" 9
fi

# (5h) stage 10 (v10, STAGES=10): every GSM8K-train and IFEval answer, stage 9's mean trained on
# them the same way (seed 10), the mean of its last exports
if [ "$STAGES" -ge 10 ]; then
    python -m train.regen --prompts "$RUN/prompts.jsonl" --out "$RUN/regen.jsonl" --model smollm2-135m \
        --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 --first_sources gsm8k_train,ifeval \
        --archive datasets/answers-smollm2-135m --limit "$LIMIT10" --snapshot "$RUN/answers-gsm-ifeval-$LIMIT10.jsonl"
    averaged 10 "$RUN/answers-gsm-ifeval-$LIMIT10.jsonl" "$STEPS10" "$STOP10" "$AVG10" 10
fi

# (5i) stage 11 (v11, STAGES=11): chat. The target's own requests (train.magpie; the committed
# archive restores them) filtered into a pool built from the first 3,000 (even where the archive
# holds more), the first MAGPIE11 answered (their archive restores the ones committed); stage 10's
# mean trained on stage 10's answers plus the chat answers named REPEAT11 times (seed 11), watched
# on the pool's last 8 requests (never trained on), the mean of its last exports
if [ "$STAGES" -ge 11 ]; then
    python -m train.magpie --dtype bfloat16 --num_queries 3000 --out "$RUN/magpie.jsonl" \
        --archive datasets/magpie-smollm2-135m.jsonl.gz
    [ -s "$RUN/prompts-magpie.jsonl" ] || python -m train.prompts --sources magpie --magpie_cache "$RUN/magpie.jsonl" \
        --magpie_first 3000 --out "$RUN/prompts-magpie.jsonl"
    tail -n 8 "$RUN/prompts-magpie.jsonl" > "$RUN/heldout-magpie-8.jsonl"
    chat_mix "$MAGPIE11" "$REPEAT11"
    averaged 11 "$data" "$STEPS11" "$STOP11" "$AVG11" 11 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5j) stage 12 (v12, STAGES=12): the answers to the first MAGPIE12 Magpie requests (every one but
# the held-out 40) named REPEAT12 times beside stage 10's answers (about half the sequences chat),
# stage 11's mean trained on them the same way (seed 12), the mean of its last exports
if [ "$STAGES" -ge 12 ]; then
    chat_mix "$MAGPIE12" "$REPEAT12"
    averaged 12 "$data" "$STEPS12" "$STOP12" "$AVG12" 12 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5k) stage 13 (v13, STAGES=13): the second Magpie pool (the cache's first 6,000 requests, even
# where the archive holds more, less the first pool's prompts and their near-duplicates), the
# answers to its first MAGPIE13 requests named REPEAT13 times beside stage 12's data with the first
# pool's answers named twice (about half the sequences chat), stage 12's mean trained on them with
# the lr decayed to 0 over STEPS13 steps (cosine; seed 13), the mean of its last exports
if [ "$STAGES" -ge 13 ]; then
    magpie_pool 2 6000 "$RUN/prompts-magpie.jsonl" "$MAGPIE13"
    chat_mix "$MAGPIE12" 2
    for _ in $(seq "$REPEAT13"); do data="$data,$RUN/answers-magpie2-$MAGPIE13.jsonl"; done
    schedule=cosine averaged 13 "$data" "$STEPS13" "$STEPS13" "$AVG13" 13 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5l) stage 14 (v14, STAGES=14): the whole second Magpie pool's answers named REPEAT14 times beside
# stage 10's answers and the first pool's once, stage 13's mean trained on them with the lr decayed
# to 0 over STEPS14 steps (cosine; seed 14), the mean of its last exports
if [ "$STAGES" -ge 14 ]; then
    magpie_pool 2 6000 "$RUN/prompts-magpie.jsonl" "$MAGPIE14"
    chat_mix "$MAGPIE12" 1
    for _ in $(seq "$REPEAT14"); do data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl"; done
    schedule=cosine averaged 14 "$data" "$STEPS14" "$STEPS14" "$AVG14" 14 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5m) stage 15 (v15, STAGES=15): a third Magpie pool (the cache's first 9,000 requests less the
# first two pools and their near-duplicates), its answers named REPEAT15 times beside stage 10's
# answers and the first two pools' once, stage 14's mean trained on them the same way (seed 15), the
# mean of its last exports
if [ "$STAGES" -ge 15 ]; then
    magpie_pool 3 9000 "$RUN/prompts-magpie.jsonl,$RUN/prompts-magpie-2.jsonl" "$MAGPIE15"
    chat_mix "$MAGPIE12" 1
    data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl"
    for _ in $(seq "$REPEAT15"); do data="$data,$RUN/answers-magpie3-$MAGPIE15.jsonl"; done
    schedule=cosine averaged 15 "$data" "$STEPS15" "$STEPS15" "$AVG15" 15 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5n) stage 16 (v16, STAGES=16): steered requests (train.magpie --openers: each opens with one of
# $OPENERS, as MT-Bench's writing and role-play turns do; their own archive), the answers to the
# first MAGPIE16 of their pool named REPEAT16 times beside stage 10's answers and the three Magpie
# pools' once; stage 15's mean trained on them the same way (seed 17), the mean of its last exports.
# VOCAB16=1 (the ablation v16c, not shipped) re-chooses the draft vocabulary as the 8,192 most
# frequent tokens of those answers (stage 4 chose it on 1,123 GSM8K answers: it holds 85.5 % of the
# target's MT-Bench answer tokens, the new one 92.2 %); the ids it adds start with zero Markov rows
if [ "$STAGES" -ge 16 ]; then
    python -m train.magpie --dtype bfloat16 --num_queries 3000 --openers "$OPENERS" --out "$RUN/magpie-open.jsonl" \
        --archive datasets/magpie-open-smollm2-135m.jsonl.gz
    [ -s "$RUN/prompts-magpie-open.jsonl" ] || python -m train.prompts --sources magpie \
        --magpie_cache "$RUN/magpie-open.jsonl" --magpie_first 1500 --out "$RUN/prompts-magpie-open.jsonl"
    steered_answers "$MAGPIE16"
    chat_mix "$MAGPIE12" 1
    data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl,$RUN/answers-magpie3-$MAGPIE15.jsonl"
    vocab=()
    if [ "$VOCAB16" = 1 ]; then
        python -m train.vocab --data "$data,$RUN/answers-open-$MAGPIE16.jsonl" --vocab_size 49152 --coverage 0.9 \
            --always 2,0 --min_size 8191 --out "$RUN/vocab-16.json"
        vocab=(--draft_vocab "$RUN/vocab-16.json")
    fi
    for _ in $(seq "$REPEAT16"); do data="$data,$RUN/answers-open-$MAGPIE16.jsonl"; done
    schedule=cosine averaged 16 "$data" "$STEPS16" "$STEPS16" "$AVG16" 17 --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" \
        "${vocab[@]}"
fi

# (5o) stage 17 (v17, STAGES=17): all of the steered pool's answers named REPEAT17 times beside the
# same GSM8K-train, IFEval and three Magpie pools' answers once; two runs from stage 16's mean, one
# at stage 16's peak lr 3e-4 (seed 18), one at 1e-4 (seed 19; the lower peak skips the fall in
# held-out tok/fwd that every restart at 3e-4 began with), each the mean of its last AVG17 exports;
# v17 is the mean of those two means (a soup: better than either on GSM8K and MT-Bench). The runs
# are independent: on a 2-core machine run them at once (one per core, `taskset`).
if [ "$STAGES" -ge 17 ]; then
    steered_answers "$MAGPIE17"
    chat_mix "$MAGPIE12" 1
    data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl,$RUN/answers-magpie3-$MAGPIE15.jsonl"
    for _ in $(seq "$REPEAT17"); do data="$data,$RUN/answers-open-$MAGPIE17.jsonl"; done
    souped 17 "$STEPS17" "$AVG17" 3e-4 18 "$data" 1e-4 19 "$data"
fi

# (5p) stage 18 (v18, STAGES=18): the steered archive's other 1,500 requests (less the first steered
# pool and its near-duplicates) as a second steered pool; all of its answers and the first steered
# pool's named REPEAT18A times (run a, seed 20) or REPEAT18B times (run b, seed 21) beside stage
# 17's other answers once; both runs from stage 17's soup at lr 1e-4, each the mean of its last
# AVG18 exports; v18 is the mean of those two means. Run them at once, one per core.
if [ "$STAGES" -ge 18 ]; then
    [ -s "$RUN/prompts-magpie-open-2.jsonl" ] || python -m train.prompts --sources magpie \
        --magpie_cache "$RUN/magpie-open.jsonl" --magpie_first 3000 --exclude_pool "$RUN/prompts-magpie-open.jsonl" \
        --aime_file ../shared/data/aime2026.jsonl --out "$RUN/prompts-magpie-open-2.jsonl"
    steered_answers "$MAGPIE18" 2
    chat_mix "$MAGPIE12" 1
    data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl,$RUN/answers-magpie3-$MAGPIE15.jsonl"
    data_a=$data data_b=$data
    steered="$RUN/answers-open-$MAGPIE17.jsonl,$RUN/answers-open2-$MAGPIE18.jsonl"
    for _ in $(seq "$REPEAT18A"); do data_a="$data_a,$steered"; done
    for _ in $(seq "$REPEAT18B"); do data_b="$data_b,$steered"; done
    souped 18 "$STEPS18" "$AVG18" 1e-4 20 "$data_a" 1e-4 21 "$data_b"
fi

# (5q) stage 19 (v19, STAGES=19): the first MAGPIE19 answers of a fourth Magpie pool (the first
# 12,000 requests of the archive less pools 1-3 and their near-duplicates) once beside stage 18's
# run-b data (both steered pools REPEAT18B times); one run from stage 18's soup at lr 1e-4 (seed
# 22), the mean of its last AVG19 exports.
# (Its mean with stage 18's soup measured 2.473 / 1.482: more GSM8K, less MT-Bench; not taken.)
if [ "$STAGES" -ge 19 ]; then
    magpie_pool 4 12000 "$RUN/prompts-magpie.jsonl,$RUN/prompts-magpie-2.jsonl,$RUN/prompts-magpie-3.jsonl" "$MAGPIE19"
    chat_mix "$MAGPIE12" 1
    data="$data,$RUN/answers-magpie2-$MAGPIE14.jsonl,$RUN/answers-magpie3-$MAGPIE15.jsonl,$RUN/answers-magpie4-$MAGPIE19.jsonl"
    for _ in $(seq "$REPEAT18B"); do data="$data,$RUN/answers-open-$MAGPIE17.jsonl,$RUN/answers-open2-$MAGPIE18.jsonl"; done
    lr=1e-4 schedule=cosine averaged 19 "$data" "$STEPS19" "$STEPS19" "$AVG19" 22 \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
fi

# (5r) stage 20 (v20, STAGES=20): a role-play-steered Magpie pool (requests opened with "Pretend
# you are", "Act as a", "Play the role of", ...: MT-Bench's first 20 questions are writing and
# role-play; its own archive), the answers to its first ROLE20 requests named REPEAT20 times beside
# stage 19's data; one run from stage 19's draft at lr 1e-4 (seed 23), the mean of its last AVG20
# exports; v20 is that mean averaged with stage 19's draft.
if [ "$STAGES" -ge 20 ]; then
    python -m train.magpie --dtype bfloat16 --num_queries 1500 --openers "$ROLE_OPENERS" \
        --out "$RUN/magpie-role.jsonl" --archive datasets/magpie-role-smollm2-135m.jsonl.gz
    [ -s "$RUN/prompts-magpie-role.jsonl" ] || python -m train.prompts --sources magpie \
        --magpie_cache "$RUN/magpie-role.jsonl" --magpie_first 1500 --aime_file ../shared/data/aime2026.jsonl \
        --out "$RUN/prompts-magpie-role.jsonl"
    python -m train.regen --prompts "$RUN/prompts-magpie-role.jsonl" --out "$RUN/regen-magpie-role.jsonl" \
        --model smollm2-135m --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive datasets/answers-smollm2-135m-magpie-role --limit "$ROLE20" --snapshot "$RUN/answers-role-$ROLE20.jsonl"
    data19=$data
    for _ in $(seq "$REPEAT20"); do data="$data,$RUN/answers-role-$ROLE20.jsonl"; done
    start=$final
    lr=1e-4 schedule=cosine averaged 20 "$data" "$STEPS20" "$STEPS20" "$AVG20" 23 \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl"
    [ -d "$RUN/distill-$NAME-20-soup" ] || python -m train.average --drafts "$start,$final" \
        --out "$RUN/distill-$NAME-20-soup"
    final="$RUN/distill-$NAME-20-soup"
fi

# (5s) stage 21 (v21, STAGES=21): the GPU stage. Stage 19's data plus all 1,500 role-play answers
# named REPEAT20 times (28,966 sequences), from v20: STEPS21 steps of BATCH21 sequences (138k
# sequences, 4.8 epochs) at peak lr LR21 decayed to 0 (cosine, 2 % warmup, seed 31), exported every
# 107 steps; v21 is the mean of the last AVG21 exports. About 7 minutes of an H200
# (scripts/gpu_distill.sh, README "Distilling on a GPU"), about 50 hours of this 2-core CPU.
if [ "$STAGES" -ge 21 ]; then
    python -m train.regen --prompts "$RUN/prompts-magpie-role.jsonl" --out "$RUN/regen-magpie-role.jsonl" \
        --model smollm2-135m --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive datasets/answers-smollm2-135m-magpie-role --limit 1500 --snapshot "$RUN/answers-role-1500.jsonl"
    data="$data19"
    for _ in $(seq "$REPEAT20"); do data="$data,$RUN/answers-role-1500.jsonl"; done
    python -m train.distill --target smollm2-135m --target_dtype bfloat16 --data "$data" --init_from "$final" \
        --run_dir "$RUN/distill-$NAME-21" --total_steps "$STEPS21" --global_batch "$BATCH21" --micro_batch 32 \
        --max_len 512 --num_anchors 128 --lr "$LR21" --lr_schedule cosine --warmup_frac 0.02 --clip 1.0 \
        --compute_dtype bfloat16 --save_every 107 --keep_exports "$AVG21" --log_every 10 --seed 31
    final="$RUN/distill-$NAME-21/average-last$AVG21"
    [ -d "$final" ] || python -m train.average --drafts "$RUN/distill-$NAME-21/export/step_*" --last "$AVG21" \
        --out "$final"
fi

# (5t) stage 22 (v22, STAGES=22): v21 trained on this CPU (one core) on the writing and role-play
# answers alone (the first three pools of each; scripts/demo_data.sh builds them), STEPS22 steps of
# 16 at peak lr 1e-4 (cosine to 0, seed 40); v22 is the mean of its last AVG22 exports averaged with v21.
if [ "$STAGES" -ge 22 ]; then
    RUN="$RUN" scripts/demo_data.sh
    data="$RUN/answers-open-1500.jsonl,$RUN/answers-open2-1498.jsonl,$RUN/answers-open3-444.jsonl"
    data="$data,$RUN/answers-role-1500.jsonl,$RUN/answers-role2-1500.jsonl,$RUN/answers-role3-375.jsonl"
    start=$final
    lr=1e-4 schedule=cosine averaged 22 "$data" "$STEPS22" "$STEPS22" "$AVG22" 40 \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" --eval_every 50
    [ -d "$RUN/distill-$NAME-22-soup" ] || python -m train.average --drafts "$start,$final" \
        --out "$RUN/distill-$NAME-22-soup"
    final="$RUN/distill-$NAME-22-soup"
fi

# (5u) stage 23 (v23, STAGES=23): two runs from v22 (made at once, one per core) on the writing and
# role-play answers alone, now with the fourth role-play pool (8,110 sequences): run a at peak lr 1e-4
# for STEPS23A steps (seed 41), run b at 3e-4 for STEPS23B steps (seed 42), both cosine to 0; v23 is the
# mean of three drafts (a weight soup): each run's mean of its last AVG23 exports, and v22.
if [ "$STAGES" -ge 23 ]; then
    data="$data,$RUN/answers-role4-1429.jsonl"   # stage 22's six snapshots plus the fourth role-play pool
    start=$final
    lr=1e-4 schedule=cosine averaged 23a "$data" "$STEPS23A" "$STEPS23A" "$AVG23" 41 \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" --eval_every 50
    mean_a=$final
    final=$start
    lr=3e-4 schedule=cosine averaged 23b "$data" "$STEPS23B" "$STEPS23B" "$AVG23" 42 \
        --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" --eval_every 50
    [ -d "$RUN/distill-$NAME-23-soup" ] || python -m train.average --drafts "$mean_a,$final,$start" \
        --out "$RUN/distill-$NAME-23-soup"
    final="$RUN/distill-$NAME-23-soup"
fi

# (5v) stage 26 (STAGES=26; README "Stage 26"): stage 23's draft moved to the 16,384-id vocabulary
# ($RUN/vocab-s22-16384.json, scripts/demo_data.sh; the new ids' Markov rows zero), trained on stage
# 25's data ($RUN/data-s25.txt: stage 23's plus the fourth writing pool twice), peak lr 3e-4, seed 47:
# STOP26 steps of a STEPS26A-step cosine schedule, then on a STEPS26-step one to its end (how the
# twenty-sixth session ran it); the mean of its last AVG26 exports averaged with stage 23's draft at
# the same vocabulary.
if [ "$STAGES" -ge 26 ]; then
    start=$final vocab16=$RUN/vocab-s22-16384.json
    # --stop_at beside distill_on's --stop_after: a rerun after an interruption stops at the same step
    for steps_stop in "$STEPS26A:$STOP26" "$STEPS26:$STEPS26"; do
        lr=3e-4 schedule=cosine distill_on 26 "$(cat "$RUN/data-s25.txt")" "${steps_stop%:*}" "${steps_stop#*:}" \
            bfloat16 47 --stop_at "${steps_stop#*:}" --draft_vocab "$vocab16" --keep_exports "$AVG26" \
            --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" --eval_every 50
    done
    mean26=$RUN/distill-$NAME-26/average-last$AVG26
    [ -d "$mean26" ] || python -m train.average --drafts "$RUN/distill-$NAME-26/export/step_*" --last "$AVG26" \
        --out "$mean26"
    [ -d "$RUN/distill-$NAME-26-soup" ] || python -m train.average --drafts "$mean26,$start" --draft_vocab "$vocab16" \
        --out "$RUN/distill-$NAME-26-soup"
    final="$RUN/distill-$NAME-26-soup"
fi

# (5w) stage 29 (v31, STAGES=29; README "Stage 29"): the long run, scripts/long_run.sh from stage 26's
# soup (stage 22's data plus the fourth writing pool twice, 16,384 ids, constant lr after 30 warmup
# steps of a 3,000-step schedule), run a stopped at step STOP29A and run b at STOP29B; the mean of the
# two runs' means of their last 5 exports (SOUP29=1: that mean averaged with stage 26's soup, as v29).
if [ "$STAGES" -ge 29 ]; then
    RUN="$RUN" NAME="$NAME-29" START="$final" TIME_BUDGET= ACCEPT=0 \
        RUNS="a:1e-4:51:$STOP29A b:2e-4:52:$STOP29B" scripts/long_run.sh
    if [ "$SOUP29" = 1 ]; then final="$RUN/$NAME-29-soup"; else final="$RUN/$NAME-29-means"; fi
fi

# (6) the final torch-layout draft (config.json + model.safetensors, bf16)
rm -rf "$RUN/$NAME.tmp" && cp -r "$final" "$RUN/$NAME.tmp"
rm -rf "$RUN/$NAME" && mv "$RUN/$NAME.tmp" "$RUN/$NAME"
echo "demo draft: $RUN/$NAME (from $final)"

# (7) acceptance on held-out prompts: GSM8K test (60) and MT-Bench first turns (20), T=0, 7 drafts,
# beside the untrained draft. The shipped preset `smollm2-135m-dspark` is $RUN/$NAME copied to
# dspark_jax/drafts/smollm2-135m-dspark/.
python -m benchmarks.acceptance --drafts "$RUN/$NAME,untrained" --gsm8k 60 --mt_bench 20 --max_new_tokens 128 \
    --output_json "$RUN/acceptance-$NAME.json"
