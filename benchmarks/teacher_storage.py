"""Does storing the offline teacher's hidden states as float8 cost the draft acceptance? The same
short distillation run on shards of each storage dtype, then held-out tok/fwd side by side.

    python -m benchmarks.teacher_storage --data runs/fp8exp/answers-gsm-320.jsonl \
        --draft_vocab runs/fp8exp/vocab.json --out runs/fp8exp --total_steps 40

For each `--storages` dtype (`train.teacher --aux_dtype`; the first is the baseline):
1. `train.teacher` writes the teacher's shards of `--data` (one writer, teacher in `--teacher_dtype`);
2. `train.distill` trains a draft on them: the same start (`--draft_config` fresh from `--seed`, or
   `--init_from`), data order, anchors, schedule and steps for every dtype, so the runs differ only
   in the stored hidden states;
then `benchmarks.acceptance` serves every run's final export on the same held-out prompts (GSM8K
test and MT-Bench first turns, temperature 0, float32 target) and this program prints each run's tok/fwd
and, against the baseline, the mean per-prompt tok/fwd difference with a paired bootstrap 95 %
interval over the prompts (both benchmarks pooled), beside the per-benchmark aggregate difference
`benchmarks.acceptance` gives. It also reports the shard bytes per token on disk.

Each step is its own program, started as a subprocess with its output shown; every one resumes or
is skipped when its output exists, so rerunning the command after an interruption continues.
`--dry_run` prints the commands. The interval is over prompts for these two trained drafts: it
does not include the run-to-run variation of training itself (a second seed would show that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "Target model: directory or preset name.")
_DATA = flags.DEFINE_string("data", None, "Regen cache JSONL: the training answers.")
_DRAFT_CONFIG = flags.DEFINE_string("draft_config", "dspark_jax/configs/smollm2-135m-dspark.json",
                                    "Draft config.json (its target_layer_ids are the captured layers).")
_INIT_FROM = flags.DEFINE_string("init_from", None, "Start every run from this torch-layout draft instead of a "
                                 "fresh one.")
_VOCAB = flags.DEFINE_string("draft_vocab", None, "vocab.json of `train.vocab` (a reduced draft vocabulary).")
_OUT = flags.DEFINE_string("out", None, "Directory for the shards, the runs and the results.")
_STORAGES = flags.DEFINE_list("storages", ["bfloat16", "float8_e4m3fn"],
                              "train.teacher --aux_dtype values to compare; the first is the baseline.")
_TEACHER_DTYPE = flags.DEFINE_enum("teacher_dtype", "bfloat16", ["float32", "bfloat16"],
                                   "Teacher compute dtype (train.teacher --dtype; what the trainer receives).")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "Sequence length (teacher and trainer).", lower_bound=8)
_SHARD = flags.DEFINE_integer("shard_size", 64, "Sequences per shard.", lower_bound=1)
_TEACHER_BATCH = flags.DEFINE_integer("teacher_batch", 4, "Sequences per teacher forward.", lower_bound=1)
_STEPS = flags.DEFINE_integer("total_steps", 40, "Optimizer steps of each run.", lower_bound=1)
_GLOBAL = flags.DEFINE_integer("global_batch", 16, "Sequences per optimizer step.", lower_bound=1)
_MICRO = flags.DEFINE_integer("micro_batch", 4, "Sequences per forward/backward.", lower_bound=1)
_ANCHORS = flags.DEFINE_integer("num_anchors", 128, "Anchors per sequence.", lower_bound=1)
_LR = flags.DEFINE_float("lr", 6e-4, "Peak learning rate.")
_SCHEDULE = flags.DEFINE_string("lr_schedule", "constant", "train.distill --lr_schedule.")
_WARMUP = flags.DEFINE_float("warmup_frac", 0.1, "Warmup fraction of the steps.")
_SEED = flags.DEFINE_integer("seed", 0, "Init, data order and anchor seed (the same for every run).")
_COMPUTE = flags.DEFINE_enum("compute_dtype", "bfloat16", ["auto", "bfloat16", "float32"], "Training compute dtype.")
_GSM8K = flags.DEFINE_integer("gsm8k", 60, "Held-out GSM8K test prompts.", lower_bound=0)
_MT = flags.DEFINE_integer("mt_bench", 20, "Held-out MT-Bench first turns.", lower_bound=0)
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per held-out prompt.", lower_bound=1)
_BOOT = flags.DEFINE_integer("bootstrap_samples", 2000, "Bootstrap resamples.", lower_bound=100)
_DRY = flags.DEFINE_bool("dry_run", False, "Print the commands instead of running them.")
flags.mark_flags_as_required(["data", "out"])


def _run(cmd: list[str], what: str) -> float:
    """Run one step's program with its output on ours; its wall seconds."""
    print(f"[teacher_storage] {what}:\n  " + " ".join(cmd), flush=True)
    if _DRY.value:
        return 0.0
    t0 = time.time()
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seconds = time.time() - t0
    print(f"[teacher_storage] {what}: {seconds:.0f} s", flush=True)
    return seconds


def _shard_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of every shard file, tokens they hold)."""
    from dspark_jax.checkpoint.safetensors_io import SafetensorsFile
    files = sorted(directory.glob("shard-*.safetensors"))
    return sum(p.stat().st_size for p in files), sum(SafetensorsFile(p).tensors["input_ids"].shape[0] for p in files)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if len(_STORAGES.value) < 2:
        raise app.UsageError("--storages: name at least two dtypes (the first is the baseline)")
    from dspark_jax.decode.stats import paired_difference, paired_mean_difference
    from dspark_jax.hostinfo import describe_cpu
    from dspark_jax.train import teacher_shards

    out = Path(_OUT.value)
    py = [sys.executable, "-m"]
    print(f"[teacher_storage] {describe_cpu()}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    timings: dict[str, dict] = {s: {} for s in _STORAGES.value}
    exports = {}
    for s in _STORAGES.value:
        shards = out / f"teacher-{s}"
        if not (shards / teacher_shards.done_name(0)).exists() or _DRY.value:
            timings[s]["teacher_s"] = _run(py + [
                "train.teacher", f"--target={_TARGET.value}", f"--dtype={_TEACHER_DTYPE.value}", f"--aux_dtype={s}",
                f"--data={_DATA.value}", f"--draft_config={_DRAFT_CONFIG.value}", f"--out={shards}",
                f"--max_len={_MAX_LEN.value}", f"--shard_size={_SHARD.value}",
                f"--batch_size={_TEACHER_BATCH.value}"], f"{s} shards")
        run_dir = out / f"distill-{s}"
        exports[s] = run_dir / "export" / f"step_{_STEPS.value:07d}"
        if not exports[s].exists() or _DRY.value:
            start = ([f"--init_from={_INIT_FROM.value}"] if _INIT_FROM.value
                     else [f"--draft_config={_DRAFT_CONFIG.value}"])
            timings[s]["train_s"] = _run(py + [
                "train.distill", f"--target={_TARGET.value}", f"--target_dtype={_TEACHER_DTYPE.value}",
                f"--teacher_dir={shards}", *start, *([f"--draft_vocab={_VOCAB.value}"] if _VOCAB.value else []),
                f"--run_dir={run_dir}", f"--total_steps={_STEPS.value}", f"--global_batch={_GLOBAL.value}",
                f"--micro_batch={_MICRO.value}", f"--max_len={_MAX_LEN.value}", f"--num_anchors={_ANCHORS.value}",
                f"--lr={_LR.value}", f"--lr_schedule={_SCHEDULE.value}", f"--warmup_frac={_WARMUP.value}",
                f"--seed={_SEED.value}", f"--compute_dtype={_COMPUTE.value}", f"--save_every={_STEPS.value}",
                "--keep_exports=1"], f"{s} distillation")
    acceptance = out / "acceptance.json"
    if not acceptance.exists() or _DRY.value:
        _run(py + ["benchmarks.acceptance", f"--model={_TARGET.value}",
                   "--drafts=" + ",".join(str(exports[s]) for s in _STORAGES.value), f"--gsm8k={_GSM8K.value}",
                   f"--mt_bench={_MT.value}", f"--max_new_tokens={_NEW.value}", f"--output_json={acceptance}"],
             "held-out acceptance")
    if _DRY.value:
        return

    rows = json.loads(acceptance.read_text())["results"]
    sets = [k for k in rows[0] if k != "draft"]
    per_prompt = [[x for k in sets for x in r[k]["per_prompt_tok_per_fwd"]] for r in rows]
    base = _STORAGES.value[0]
    summary = {"cpu": describe_cpu(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "timings_s": timings,
               "benchmarks": sets, "runs": {}}
    print(f"\n| shards | bytes/token on disk | bytes/token (format) | " + " | ".join(f"{k} tok/fwd" for k in sets)
          + " | mean per-prompt tok/fwd |")
    print("|---|---:|---:|" + "---:|" * (len(sets) + 1))
    for s, row, values in zip(_STORAGES.value, rows, per_prompt):
        meta = teacher_shards.read_meta(out / f"teacher-{s}")
        size, tokens = _shard_bytes(out / f"teacher-{s}")
        fmt = teacher_shards.bytes_per_token(meta.hidden_size, len(meta.aux_layer_ids), meta.aux_dtype)
        mean = sum(values) / len(values)
        summary["runs"][s] = {"draft": row["draft"], "shard_bytes_per_token": size / tokens,
                              "format_bytes_per_token": fmt, "mean_per_prompt_tok_per_fwd": mean,
                              **{f"{k}_tok_per_fwd": row[k]["tok_per_fwd"] for k in sets}}
        print(f"| {s} | {size / tokens:,.0f} | {fmt:,} | " + " | ".join(f"{row[k]['tok_per_fwd']:.3f}" for k in sets)
              + f" | {mean:.3f} |")
    print(f"\n| {'-'.join(['shards', base])} | mean per-prompt difference, all {len(per_prompt[0])} prompts "
          f"(paired bootstrap 95 %) | " + " | ".join(f"{k} aggregate (paired bootstrap 95 %)" for k in sets) + " |")
    print("|---|---|" + "---|" * len(sets))
    for s, row, values in list(zip(_STORAGES.value, rows, per_prompt))[1:]:
        d, lo, hi = paired_mean_difference(per_prompt[0], values, samples=_BOOT.value)
        aggregate = {k: paired_difference(rows[0][k], row[k], samples=_BOOT.value) for k in sets}
        summary["runs"][s]["vs_baseline"] = {"mean_per_prompt": [d, lo, hi], **aggregate}
        print(f"| {s} | {d:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
              + " | ".join(f"{a:+.3f} [{b:+.3f}, {c:+.3f}]" for a, b, c in aggregate.values()) + " |")
        verdict = "holds 0: no measurable loss" if lo <= 0 <= hi else ("above 0" if lo > 0 else "below 0")
        print(f"{s} - {base}: the interval {verdict}", flush=True)
    (out / "teacher_storage.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"-> {out / 'teacher_storage.json'}")


if __name__ == "__main__":
    app.run(main)
