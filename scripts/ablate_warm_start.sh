#!/usr/bin/env bash
# Warm start vs random init at equal CPU time (issue 17 item 3): two distillation runs that differ
# ONLY in --warm_start (same seed, so the attention and Markov W1 inits are identical; same data
# order, anchors, schedule and steps). A step costs the same with either init (same draft), so equal
# steps = equal CPU time; compare the runs' step_seconds in metrics.jsonl to confirm. Both runs write
# the held-out served tok/fwd curve (GSM8K test 60..67, T=0, 7 drafts) to $RUN/<init>/eval.jsonl
# and learning_curve.png, then the acceptance benchmark measures both final drafts side by side.
# Resumable: rerun the same command after an interruption. Runs one after the other (2 CPU cores).
#     nohup scripts/ablate_warm_start.sh > runs/ablate-init/log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN=${RUN:-runs/ablate-init}
DATA=${DATA:-runs/demo/answers-882.jsonl}    # a frozen answers snapshot (scripts/demo_draft.sh stage 2)
STEPS=${STEPS:-160}                          # optimizer steps of 16 sequences, both runs
EVAL_EVERY=${EVAL_EVERY:-20}
SCHEDULE=${SCHEDULE:-cosine}                 # or constant (warmup then constant lr)
CONFIG=dspark_jax/configs/smollm2-135m-dspark.json
[ -s "$DATA" ] || { echo "no answers at $DATA: run scripts/demo_draft.sh first (or set DATA=)"; exit 1; }
mkdir -p "$RUN"

for init in random warm; do
    extra=()
    [ "$init" = warm ] && extra=(--warm_start)
    python -m train.distill --target smollm2-135m --target_dtype float32 --data "$DATA" \
        --draft_config "$CONFIG" --run_dir "$RUN/$init" --total_steps "$STEPS" --global_batch 16 --micro_batch 4 \
        --max_len 512 --num_anchors 128 --lr 6e-4 --warmup_frac 0.04 --min_lr_frac 0.1 --lr_schedule "$SCHEDULE" \
        --clip 1.0 --compute_dtype float32 --seed 0 --save_every 10 --log_every 1 \
        --eval_every "$EVAL_EVERY" --eval_num_prompts 8 --eval_max_new_tokens 128 ${extra[@]+"${extra[@]}"}
done

last_export() { ls -d "$1"/export/step_* | sort | tail -1; }
python -m benchmarks.acceptance --drafts "$(last_export "$RUN/random"),$(last_export "$RUN/warm")" \
    --gsm8k 60 --mt_bench 20 --max_new_tokens 128 --output_json "$RUN/acceptance.json"
python - "$RUN" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
for init in ("random", "warm"):
    rows = [json.loads(x) for x in (run / init / "eval.jsonl").read_text().splitlines() if x.strip()]
    secs = [json.loads(x)["step_seconds"] for x in (run / init / "metrics.jsonl").read_text().splitlines() if x.strip()]
    print(f"{init:6s} train {sum(secs) / 3600:.2f} h ({sum(secs) / len(secs):.1f} s/step); held-out tok/fwd by "
          "sequences seen: " + ", ".join(f"{r['sequences_seen']}:{r['tok_per_fwd']:.2f}" for r in rows))
EOF
