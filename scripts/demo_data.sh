#!/usr/bin/env bash
# The answer snapshots the demo draft's stages 21 and 22 train on, and those of the next GPU run
# ("stage 22's data", gpu_stage22.sh), without training: the prompt pools and Magpie requests
# rebuilt as scripts/demo_draft.sh builds them, the answers restored from the committed archives
# (datasets/), the few the archives lack generated (bf16, 8 at a time; 18 on 2026-12-04, about 2
# minutes). Use it to feed scripts/gpu_distill.sh and gpu_answers.sh (README "Distilling on a
# GPU"); it prints stage 21's and stage 22's --data lists last. Resumable; outputs under $RUN (default runs/demo).
# TAR=FILE also writes the tar scripts/gpu_stage22.sh carries (8.4 MiB): stage 22's snapshots, the
# writing pools, its vocabulary and the decontamination files (benchmarks and AIME; never committed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
RUN=${RUN:-runs/demo}
AIME=../shared/data/aime2026.jsonl
OPENERS="Write,Compose,Draft,Craft,Describe,Imagine,Pretend,Act as,Create,Tell me a story,Edit,Rewrite"
ROLE_OPENERS="Pretend you are,Act as a,Play the role of,Take on the role of,Imagine you are,You are a,Write an email,Write a blog post,Write a short story"
mkdir -p "$RUN"

answers() {   # prompts file, its regen cache, archive, limit, snapshot, more flags
    python -m train.regen --prompts "$RUN/$1" --out "$RUN/$2" --model smollm2-135m --dtype bfloat16 \
        --max_new_tokens 256 --batch_size 8 --temperature 0 --archive "$3" --limit "$4" --snapshot "$RUN/$5" "${@:6}"
}
pool() {   # Magpie cache, first N requests, out, more train.prompts flags
    [ -s "$RUN/$3" ] || python -m train.prompts --sources magpie --magpie_cache "$RUN/$1" --magpie_first "$2" \
        --out "$RUN/$3" "${@:4}"
}

[ -s "$RUN/prompts.jsonl" ] || python -m train.prompts --out "$RUN/prompts.jsonl"
answers prompts.jsonl regen.jsonl datasets/answers-smollm2-135m 8009 answers-gsm-ifeval-8009.jsonl \
    --first_sources gsm8k_train,ifeval
python -m train.magpie --dtype bfloat16 --num_queries 12000 --out "$RUN/magpie.jsonl" \
    --archive datasets/magpie-smollm2-135m.jsonl.gz
pool magpie.jsonl 3000 prompts-magpie.jsonl
tail -n 8 "$RUN/prompts-magpie.jsonl" > "$RUN/heldout-magpie-8.jsonl"
answers prompts-magpie.jsonl regen-magpie.jsonl datasets/answers-smollm2-135m-magpie 2960 answers-magpie-2960.jsonl
pool magpie.jsonl 6000 prompts-magpie-2.jsonl --exclude_pool "$RUN/prompts-magpie.jsonl" --aime_file "$AIME"
answers prompts-magpie-2.jsonl regen-magpie-2.jsonl datasets/answers-smollm2-135m-magpie-2 2998 answers-magpie2-2998.jsonl
pool magpie.jsonl 9000 prompts-magpie-3.jsonl --exclude_pool "$RUN/prompts-magpie.jsonl,$RUN/prompts-magpie-2.jsonl" \
    --aime_file "$AIME"
answers prompts-magpie-3.jsonl regen-magpie-3.jsonl datasets/answers-smollm2-135m-magpie-3 2994 answers-magpie3-2994.jsonl
pool magpie.jsonl 12000 prompts-magpie-4.jsonl \
    --exclude_pool "$RUN/prompts-magpie.jsonl,$RUN/prompts-magpie-2.jsonl,$RUN/prompts-magpie-3.jsonl" --aime_file "$AIME"
answers prompts-magpie-4.jsonl regen-magpie-4.jsonl datasets/answers-smollm2-135m-magpie-4 1509 answers-magpie4-1509.jsonl
python -m train.magpie --dtype bfloat16 --num_queries 3444 --openers "$OPENERS" --out "$RUN/magpie-open.jsonl" \
    --archive datasets/magpie-open-smollm2-135m.jsonl.gz
pool magpie-open.jsonl 1500 prompts-magpie-open.jsonl
answers prompts-magpie-open.jsonl regen-magpie-open.jsonl datasets/answers-smollm2-135m-magpie-open 1500 answers-open-1500.jsonl
pool magpie-open.jsonl 3000 prompts-magpie-open-2.jsonl --exclude_pool "$RUN/prompts-magpie-open.jsonl" --aime_file "$AIME"
answers prompts-magpie-open-2.jsonl regen-magpie-open-2.jsonl datasets/answers-smollm2-135m-magpie-open-2 1498 \
    answers-open2-1498.jsonl
python -m train.magpie --dtype bfloat16 --num_queries 4804 --openers "$ROLE_OPENERS" --out "$RUN/magpie-role.jsonl" \
    --archive datasets/magpie-role-smollm2-135m.jsonl.gz
pool magpie-role.jsonl 1500 prompts-magpie-role.jsonl --aime_file "$AIME"
answers prompts-magpie-role.jsonl regen-magpie-role.jsonl datasets/answers-smollm2-135m-magpie-role 1500 answers-role-1500.jsonl

# stage 22's additions: pool 4 whole, the second and third role-play pools and a third writing pool
# (twentieth and twenty-first sessions), and a 16,384-id vocabulary chosen over all of its answers
answers prompts-magpie-4.jsonl regen-magpie-4.jsonl datasets/answers-smollm2-135m-magpie-4 2997 answers-magpie4-2997.jsonl
pool magpie-role.jsonl 3000 prompts-magpie-role-2.jsonl --exclude_pool "$RUN/prompts-magpie-role.jsonl" --aime_file "$AIME"
answers prompts-magpie-role-2.jsonl regen-magpie-role-2.jsonl datasets/answers-smollm2-135m-magpie-role-2 1500 \
    answers-role2-1500.jsonl
pool magpie-role.jsonl 3375 prompts-magpie-role-3.jsonl \
    --exclude_pool "$RUN/prompts-magpie-role.jsonl,$RUN/prompts-magpie-role-2.jsonl" --aime_file "$AIME"
answers prompts-magpie-role-3.jsonl regen-magpie-role-3.jsonl datasets/answers-smollm2-135m-magpie-role-3 375 \
    answers-role3-375.jsonl
pool magpie-open.jsonl 3444 prompts-magpie-open-3.jsonl \
    --exclude_pool "$RUN/prompts-magpie-open.jsonl,$RUN/prompts-magpie-open-2.jsonl" --aime_file "$AIME"
answers prompts-magpie-open-3.jsonl regen-magpie-open-3.jsonl datasets/answers-smollm2-135m-magpie-open-3 444 \
    answers-open3-444.jsonl
# the fourth role-play pool (twenty-second session): the role-play requests past role-3's 3,375
pool magpie-role.jsonl 4804 prompts-magpie-role-4.jsonl \
    --exclude_pool "$RUN/prompts-magpie-role.jsonl,$RUN/prompts-magpie-role-2.jsonl,$RUN/prompts-magpie-role-3.jsonl" \
    --aime_file "$AIME"
answers prompts-magpie-role-4.jsonl regen-magpie-role-4.jsonl datasets/answers-smollm2-135m-magpie-role-4 1429 \
    answers-role4-1429.jsonl
# the fourth writing pool (twenty-fourth and twenty-fifth sessions): the writing requests among the
# open cache's first 5,507 that the first three writing pools leave out
pool magpie-open.jsonl 5507 prompts-magpie-open-4.jsonl \
    --exclude_pool "$RUN/prompts-magpie-open.jsonl,$RUN/prompts-magpie-open-2.jsonl,$RUN/prompts-magpie-open-3.jsonl" \
    --aime_file "$AIME"
answers prompts-magpie-open-4.jsonl regen-magpie-open-4.jsonl datasets/answers-smollm2-135m-magpie-open-4 2060 \
    answers-open4-2060.jsonl

data="$RUN/answers-gsm-ifeval-8009.jsonl,$RUN/answers-magpie-2960.jsonl,$RUN/answers-magpie2-2998.jsonl"
data="$data,$RUN/answers-magpie3-2994.jsonl,$RUN/answers-magpie4-1509.jsonl"
for _ in 1 2; do data="$data,$RUN/answers-open-1500.jsonl,$RUN/answers-open2-1498.jsonl"; done
for _ in 1 2 3; do data="$data,$RUN/answers-role-1500.jsonl"; done
echo "stage 21's --data:"
echo "$data"

s22="$RUN/answers-gsm-ifeval-8009.jsonl,$RUN/answers-magpie-2960.jsonl,$RUN/answers-magpie2-2998.jsonl"
s22="$s22,$RUN/answers-magpie3-2994.jsonl,$RUN/answers-magpie4-2997.jsonl"
for _ in 1 2; do
    s22="$s22,$RUN/answers-open-1500.jsonl,$RUN/answers-open2-1498.jsonl,$RUN/answers-open3-444.jsonl"
    s22="$s22,$RUN/answers-role-1500.jsonl,$RUN/answers-role2-1500.jsonl,$RUN/answers-role3-375.jsonl"
done
unique=$(tr , '\n' <<< "$s22" | awk '!seen[$0]++' | paste -sd,)
# the vocabulary was chosen before the fourth role-play pool existed: the list above, kept fixed
[ -s "$RUN/vocab-s22-16384.json" ] || python -m train.vocab --data "$unique" --vocab_size 49152 --coverage 0.99 \
    --always 2,0 --min_size 16383 --out "$RUN/vocab-s22-16384.json"
for _ in 1 2; do s22="$s22,$RUN/answers-role4-1429.jsonl"; done
unique="$unique,$RUN/answers-role4-1429.jsonl,$RUN/answers-open4-2060.jsonl"   # gpu_stage22.sh adds open4 twice
echo "$s22" > "$RUN/data-s22.txt"
echo "stage 22's --data (scripts/gpu_stage22.sh adds its new answers; in $RUN/data-s22.txt):"
echo "$s22"

# stage 25 and the 16,384-id run after it (README "Stage 25"): stage 23's writing and role-play
# snapshots, then the fourth writing pool twice
s25="$RUN/answers-open-1500.jsonl,$RUN/answers-open2-1498.jsonl,$RUN/answers-open3-444.jsonl"
s25="$s25,$RUN/answers-role-1500.jsonl,$RUN/answers-role2-1500.jsonl,$RUN/answers-role3-375.jsonl"
s25="$s25,$RUN/answers-role4-1429.jsonl,$RUN/answers-open4-2060.jsonl,$RUN/answers-open4-2060.jsonl"
echo "$s25" > "$RUN/data-s25.txt"

if [ -n "${TAR:-}" ]; then
    # the benchmark files train.prompts decontaminates against, for a machine with no network
    mkdir -p "$RUN/offline-data"
    python -c "import shutil, sys; from dspark_jax.data import registry
for key in ('gsm8k_test', 'humaneval', 'mt_bench'): shutil.copy(registry.fetch(key), sys.argv[1])" "$RUN/offline-data"
    cp "$AIME" "$RUN/offline-data/"
    mkdir -p "$(dirname "$TAR")"
    # stage 22's snapshots, the writing pools gpu_stage22.sh's new one leaves out, the vocabulary
    tr , '\n' <<< "$unique" | sed 'p; s/$/.meta.json/' > "$RUN/tar-files.txt"
    tar -cJf "$TAR" -T "$RUN/tar-files.txt" "$RUN"/prompts-magpie-open{,-2,-3,-4}.jsonl \
        "$RUN/vocab-s22-16384.json" "$RUN/data-s22.txt" "$RUN/offline-data"
    echo "GPU inputs: $TAR ($(du -h "$TAR" | cut -f1))"
fi
