#!/usr/bin/env bash
# The demo draft: a 2-layer MLA DSpark draft for SmolLM2-135M-Instruct, distilled on this CPU
# machine with the package's own pipeline. Every stage resumes where it stopped, so rerunning this
# script after an interruption continues the run:
#     nohup scripts/demo_draft.sh > runs/demo/pipeline.log 2>&1 &
# Stages: (1) prompt pool, (2) the target's greedy answers (T=0, <= 256 new tokens, 16 at a time),
# (3) off-policy prefill distillation with the online teacher, (4) the torch-layout draft copied
# to $RUN/$NAME. Outputs stay under runs/ (gitignored).
# The shipped v0 (dspark_jax/drafts/smollm2-135m-dspark) is this script's output with the defaults
# below; its answers were cut from a cache that was still growing (rows of the first LIMIT prompts),
# and the first 56 of them came from the earlier batch-of-8 regen (same greedy answers).
# The DFlash-style ablation (no Markov head; the confidence head then reads h_k only), trained the
# same way on the same answers:  ABLATION=1 scripts/demo_draft.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN=${RUN:-runs/demo}
LIMIT=${LIMIT:-591}           # prompts answered by the target (the first N of the ~17k-prompt pool)
STEPS=${STEPS:-80}            # optimizer steps of 16 sequences (80 = 2.2 epochs of 589 usable answers)
CONFIG=dspark_jax/configs/smollm2-135m-dspark.json
NAME=smollm2-135m-dspark
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

# (2) SmolLM2's own answers through generate() with the serving chat template (resumable)
python -m train.regen --prompts "$RUN/prompts.jsonl" --out "$RUN/regen.jsonl" --model smollm2-135m \
    --dtype float32 --max_new_tokens 256 --batch_size 16 --temperature 0 --limit "$LIMIT"

# (3) distillation (resumes from its checkpoints; exports $RUN/distill-$NAME/export/step_N)
python -m train.distill --target smollm2-135m --target_dtype float32 --data "$RUN/regen.jsonl" \
    --draft_config "$CONFIG" --run_dir "$RUN/distill-$NAME" \
    --total_steps "$STEPS" --global_batch 16 --micro_batch 4 --max_len 512 --num_anchors 64 \
    --lr 6e-4 --warmup_frac 0.04 --min_lr_frac 0.1 --clip 1.0 --compute_dtype float32 --seed 0 \
    --save_every 5 --log_every 1

# (4) the final torch-layout draft (config.json + model.safetensors, bf16)
final=$(ls -d "$RUN/distill-$NAME"/export/step_* | sort | tail -1)
rm -rf "$RUN/$NAME.tmp" && cp -r "$final" "$RUN/$NAME.tmp"
rm -rf "$RUN/$NAME" && mv "$RUN/$NAME.tmp" "$RUN/$NAME"
echo "demo draft: $RUN/$NAME (from $final)"

# (5) acceptance on held-out prompts: GSM8K test (60) and MT-Bench first turns (20), T=0, 7 drafts,
# beside the untrained draft. The shipped preset `smollm2-135m-dspark` is $RUN/$NAME copied to
# dspark_jax/drafts/smollm2-135m-dspark/.
python -m benchmarks.acceptance --drafts "$RUN/$NAME,untrained" --gsm8k 60 --mt_bench 20 \
    --output_json "$RUN/acceptance-$NAME.json"
