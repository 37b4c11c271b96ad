#!/usr/bin/env bash
# The issue-17 ablations at equal CPU time: three distillation runs from scratch that differ only in
# the draft's vocabulary and its initialisation (same seed, data order, anchors, lr schedule):
#   random-full     random init, the full 49,152-id vocabulary
#   random-reduced  random init, the reduced vocabulary ($VOCAB, the shipped draft's 8,192 ids)
#   warm-reduced    --warm_start (target's last layers, identity context projection, zero Markov
#                   output side and confidence head), reduced vocabulary
# Full vs reduced = the first two; random vs warm = the last two. Each run stops when its training
# steps have used $BUDGET process CPU seconds (train.distill --cpu_budget; metrics.jsonl records
# every step's), so the cheaper reduced-vocabulary steps get more of them. The held-out served
# tok/fwd (GSM8K test 60..67, T=0, 7 drafts) is measured every $EVAL_EVERY steps; at the end
# benchmarks.acceptance measures the three final drafts side by side, and a table prints each run's
# steps, CPU time and curve ($RUN/ablations.png: held-out tok/fwd vs training CPU minutes).
# Resumable: rerun the same command after an interruption.
#     nohup scripts/ablate.sh > runs/ablate/log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN=${RUN:-runs/ablate}
DATA=${DATA:-runs/demo/answers-gsm-1737.jsonl}   # a frozen answers snapshot (scripts/demo_draft.sh stage 5)
VOCAB=${VOCAB:-runs/demo/vocab-gsm-1123-8192.json}   # scripts/demo_draft.sh stage 4
BUDGET=${BUDGET:-1800}                           # training CPU seconds per run
EVAL_EVERY=${EVAL_EVERY:-10}
RUNS=${RUNS:-random-full random-reduced warm-reduced}
CONFIG=dspark_jax/configs/smollm2-135m-dspark.json
for f in "$DATA" "$VOCAB"; do
    [ -s "$f" ] || { echo "missing $f: run scripts/demo_draft.sh first (or set DATA= / VOCAB=)"; exit 1; }
done
mkdir -p "$RUN"

for name in $RUNS; do
    extra=()
    case $name in
        random-full) ;;
        random-reduced) extra=(--draft_vocab "$VOCAB") ;;
        warm-reduced) extra=(--draft_vocab "$VOCAB" --warm_start) ;;
        *) echo "unknown run $name"; exit 1 ;;
    esac
    # total_steps only bounds the run (the budget stops it first) and sets the 4-step warmup
    python -m train.distill --target smollm2-135m --target_dtype bfloat16 --data "$DATA" \
        --draft_config "$CONFIG" --run_dir "$RUN/$name" --total_steps 200 --global_batch 16 --micro_batch 4 \
        --max_len 512 --num_anchors 128 --lr 6e-4 --warmup_frac 0.02 --lr_schedule constant --clip 1.0 \
        --compute_dtype float32 --seed 0 --save_every 10 --log_every 1 --cpu_budget "$BUDGET" \
        --eval_every "$EVAL_EVERY" --eval_num_prompts 8 --eval_max_new_tokens 128 "${extra[@]}"
done

last_export() { ls -d "$1"/export/step_* | sort | tail -1; }
drafts=""
for name in $RUNS; do drafts="$drafts${drafts:+,}$(last_export "$RUN/$name")"; done
# measured once per set of final drafts (again after a larger BUDGET moved any of them on)
if [ ! -s "$RUN/acceptance.json" ] || [ -n "$(find ${drafts//,/ } -maxdepth 0 -newer "$RUN/acceptance.json")" ]; then
    python -m benchmarks.acceptance --drafts "$drafts" \
        --gsm8k 60 --mt_bench 20 --max_new_tokens 128 --output_json "$RUN/acceptance.json"
fi
python - "$RUN" $RUNS <<'PY'
import json, sys
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
run = Path(sys.argv[1])
def rows(p):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
for name in sys.argv[2:]:
    m, ev = rows(run / name / "metrics.jsonl"), rows(run / name / "eval.jsonl")
    print(f"{name:15s} {len(m)} steps, {m[-1]['cpu_seconds']:.0f} CPU-s ({m[-1]['cpu_seconds'] / len(m):.1f} per step, "
          f"{sum(r['step_seconds'] for r in m) / 60:.1f} min wall); held-out tok/fwd by CPU-s: "
          + ", ".join(f"{r['cpu_seconds'] or 0:.0f}:{r['tok_per_fwd']:.3f}" for r in ev))
    ax.plot([(r["cpu_seconds"] or 0) / 60 for r in ev], [r["tok_per_fwd"] for r in ev], "o-", label=name)
ax.set_xlabel("training CPU minutes (process CPU time, both cores)")
ax.set_ylabel("held-out served tok/fwd (8 GSM8K-test prompts, T=7)")
ax.set_title("ablations at equal CPU time (scripts/ablate.sh)")
ax.grid(alpha=0.3)
ax.legend(loc="lower right")
fig.tight_layout()
fig.savefig(run / "ablations.png")
print(f"curves: {run / 'ablations.png'}")
PY
