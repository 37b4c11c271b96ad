#!/usr/bin/env bash
# Stage 29, the long run: distillation that continues across sessions instead of starting over.
# Two train.distill runs from one start, one per core (taskset), at a constant lr after a short
# warmup, on the broad answer mix (stage 22's data plus the fourth writing pool twice: GSM8K, IFEval
# and chat, what the GPU plan trains on). Each invocation resumes both runs from their checkpoints,
# trains for TIME_BUDGET seconds (train.distill --time_budget: at the first step past it the run
# saves and exports), then writes each run's mean of its last AVG exports ($RUN/$NAME<run>-last$AVG)
# and the mean of those means and START ($RUN/$NAME-soup). With ACCEPT=1 benchmarks.acceptance then
# measures the soup (one core) and the soup of the run means alone (the other core), and compares
# them with BASE_JSON (default $RUN/acceptance-v31.json, the shipped draft's) where it exists. TRAIN=0 skips
# the training (the means, soups and ACCEPT from the exports there are).
# Sequences seen add up from session to session: rerun the same command (`nohup scripts/long_run.sh
# > runs/demo/long_run.log 2>&1 &`); each run's eval.jsonl and learning_curve.png carry the whole
# curve (held-out tok/fwd vs sequences seen).
# START (default: stage 26's soup at the 16,384-id vocabulary; README "Stage 26") is only read when
# a run has no checkpoint yet.
# A run named name:lr:seed:STEP in RUNS stops at that step (train.distill --stop_at) instead of by the
# clock; with TIME_BUDGET= (empty) as well, scripts/demo_draft.sh's stage 29 repeats a run of known length.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate

RUN=${RUN:-runs/demo}
NAME=${NAME:-s29}
START=${START:-$RUN/s26k16-soup}
VOCAB=${VOCAB:-$RUN/vocab-s22-16384.json}           # scripts/demo_data.sh
DATA=${DATA:-}                                      # default below: data-s22.txt + open4 twice
RUNS=${RUNS:-"a:1e-4:51 b:2e-4:52"}                 # name:peak lr:seed[:stop step], one core each in turn
TOTAL=${TOTAL:-3000}                                # the runs' length in steps of 16 (sets the warmup)
TIME_BUDGET=${TIME_BUDGET-7200}                     # training seconds per invocation (empty: no limit)
AVG=${AVG:-5}
ACCEPT=${ACCEPT:-0}
TRAIN=${TRAIN:-1}

if [ -z "$DATA" ]; then
    [ -s "$RUN/data-s22.txt" ] || { echo "missing $RUN/data-s22.txt: run scripts/demo_data.sh (or set DATA=)"; exit 1; }
    DATA="$(cat "$RUN/data-s22.txt"),$RUN/answers-open4-2060.jsonl,$RUN/answers-open4-2060.jsonl"
fi
[ -s "$VOCAB" ] || { echo "missing $VOCAB: run scripts/demo_data.sh first (or set VOCAB=)"; exit 1; }
for name_lr_seed in $RUNS; do
    dir=$RUN/distill-$NAME${name_lr_seed%%:*}
    if [ ! -d "$dir/checkpoints" ] && [ ! -s "$START/model.safetensors" ]; then
        echo "missing $START: the README's Stage 26 builds it (its run, then train.average --draft_vocab)," \
             "or set START= to a draft directory"; exit 1
    fi
done

train() {
    core=0
    pids=()
    for name_lr_seed in $RUNS; do
        IFS=: read -r name lr seed stop <<< "$name_lr_seed"
        dir=$RUN/distill-$NAME$name
        limits=()
        [ -z "$stop" ] || limits+=(--stop_at "$stop")
        [ -z "$TIME_BUDGET" ] || limits+=(--time_budget "$TIME_BUDGET")
        echo "[long_run] run $name: lr $lr seed $seed core $core ${limits[*]} -> $dir ($dir.log)"
        taskset -c $core python -m train.distill --target smollm2-135m --target_dtype bfloat16 \
            --init_from "$START" --draft_vocab "$VOCAB" --data "$DATA" --run_dir "$dir" \
            --total_steps "$TOTAL" --lr "$lr" --seed "$seed" --lr_schedule constant --warmup_frac 0.01 \
            --global_batch 16 --micro_batch 4 --max_len 512 --num_anchors 128 --clip 1.0 \
            --compute_dtype bfloat16 --save_every 10 --log_every 1 --keep_exports "$AVG" \
            --eval_prompts_file "$RUN/heldout-magpie-8.jsonl" --eval_every 50 \
            "${limits[@]}" >> "$dir.log" 2>&1 &
        pids+=($!)
        core=$(( (core + 1) % $(nproc) ))
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    [ $status = 0 ] || { echo "[long_run] a run failed: see its log"; exit 1; }
}
[ "$TRAIN" = 0 ] || train

means=()
for name_lr_seed in $RUNS; do
    dir=$RUN/distill-$NAME${name_lr_seed%%:*}
    mean=$RUN/$NAME${name_lr_seed%%:*}-last$AVG
    rm -rf "$mean"
    python -m train.average --drafts "$dir/export/step_*" --last "$AVG" --out "$mean"
    tail -n 1 "$dir/metrics.jsonl" | python -c 'import json, sys; m = json.load(sys.stdin)
print("[long_run] %s: step %d, loss %.4f" % (sys.argv[1], m["step"], m["loss"]))' "$dir"
    means+=("$mean")
done
rm -rf "$RUN/$NAME-soup" "$RUN/$NAME-means"
python -m train.average --drafts "$(IFS=,; echo "${means[*]}"),$START" --out "$RUN/$NAME-soup"
python -m train.average --drafts "$(IFS=,; echo "${means[*]}")" --out "$RUN/$NAME-means"

if [ "$ACCEPT" = 1 ]; then
    core=0
    pids=()
    for d in soup means; do
        taskset -c $core python -m benchmarks.acceptance --drafts "$RUN/$NAME-$d" --gsm8k 60 --mt_bench 20 \
            --max_new_tokens 128 --output_json "$RUN/acceptance-$NAME-$d.json" > "$RUN/acceptance-$NAME-$d.log" 2>&1 &
        pids+=($!)
        core=$(( (core + 1) % $(nproc) ))
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    tail -n 3 "$RUN/acceptance-$NAME-soup.log" "$RUN/acceptance-$NAME-means.log"
    base=${BASE_JSON:-$RUN/acceptance-v31.json}   # the shipped draft's results: paired intervals against it
    if [ -s "$base" ]; then
        python -m benchmarks.acceptance \
            --compare "$base,$RUN/acceptance-$NAME-soup.json,$RUN/acceptance-$NAME-means.json"
    fi
fi
