"""What the teacher costs per training sequence: online (the target's prefill inside every training
step) vs offline shards (captured states written once, read back each epoch), in float32 and
bfloat16.

    scripts/fetch_data.sh                 # restores the demo's answers under runs/demo-draft/data
    python -m benchmarks.teacher_cost --num_samples 32

For each teacher dtype, on the first --num_samples answers of --data, in the trainer's batches
(length-grouped global batches, micro-batches padded to a multiple of 128):
- the teacher forward alone, seconds per sequence (compilation excluded);
- its agreement with the float32 teacher on the answer tokens: top-1 of the next-token
  distribution, and the mean total-variation distance between the two distributions;
- offline shards written in that dtype: seconds per sequence to write, bytes on disk scaled to
  1,000 answers of --data's mean length, seconds per sequence to read back;
- with --train_steps N: whole training steps (draft forward/backward + teacher), seconds per
  sequence, for the online teacher in each dtype and the offline one (shards in bfloat16).
Beside them, the size a top-k teacher (k = --top_k probabilities with their ids, in place of the
final hidden state) would take, by arithmetic: the captured states stay, the draft reads them.
CPU figures are only meaningful as ratios within one run.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from absl import app, flags

_DATA = flags.DEFINE_string("data", "runs/demo-draft/data/answers-gsm-ifeval-8009.jsonl",
                            "regen cache JSONL (answers); the default is the GSM8K/IFEval snapshot "
                            "scripts/fetch_data.sh writes")
_TARGET = flags.DEFINE_string("target", "smollm2-135m", "target directory or preset")
_DRAFT = flags.DEFINE_string("draft", "smollm2-135m-dspark", "draft directory or preset (its captured layers)")
_N = flags.DEFINE_integer("num_samples", 32, "answers timed (a multiple of --global_batch)", lower_bound=1)
_GLOBAL = flags.DEFINE_integer("global_batch", 16, "sequences per optimizer step (the trainer's grouping)")
_MICRO = flags.DEFINE_integer("micro_batch", 4, "sequences per teacher forward")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "training sequence length")
_ANCHORS = flags.DEFINE_integer("num_anchors", 128, "anchors per sequence (--train_steps)")
_STEPS = flags.DEFINE_integer("train_steps", 0, "also time this many training steps per teacher", lower_bound=0)
_TOP_K = flags.DEFINE_integer("top_k", 64, "k of the top-k teacher size estimate")
_JSON = flags.DEFINE_string("output_json", None, "write the results here")

DTYPES = ("float32", "bfloat16")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.api import load_target
    from dspark_jax.bench.steps_timing import CompileClock
    from dspark_jax.checkpoint.draft_io import load_draft
    from dspark_jax.data import answer_cache
    from dspark_jax.presets import resolve_model_path
    from dspark_jax.train import regen, teacher, teacher_shards
    from dspark_jax.train import trainer as trainer_lib
    from dspark_jax.train import batches as batches_lib
    from dspark_jax.train.loss import LossConfig

    rows = answer_cache.read_cache(_DATA.value)
    samples = list(regen.samples_from_cache(rows, max_len=_MAX_LEN.value))
    mean_len = float(np.mean([len(s.input_ids) for s in samples]))
    n = -(-_N.value // _GLOBAL.value) * _GLOBAL.value
    if len(samples) < n:
        raise app.UsageError(f"--data {_DATA.value}: {len(samples)} training samples, need {n}")
    draft = load_draft(resolve_model_path(_DRAFT.value), dtype=jnp.float32)
    aux_ids = tuple(draft.cfg.target_layer_ids)
    cfg = trainer_lib.TrainConfig(run_dir=tempfile.mkdtemp(prefix="teacher_cost_"), total_steps=max(_STEPS.value, 1),
                                  global_batch=_GLOBAL.value, micro_batch=_MICRO.value, max_len=_MAX_LEN.value,
                                  lr=1e-4, compute_dtype="float32",
                                  loss=LossConfig(block_size=7, num_anchors=_ANCHORS.value))
    source = batches_lib.SampleSource(samples[:n], seed=0, group=_GLOBAL.value)
    batches = [batches_lib.collate(source.take(_GLOBAL.value), cfg, offline=False) for _ in range(n // _GLOBAL.value)]
    clock = CompileClock()
    print(f"{n} answers of {_DATA.value} (mean length of all {len(samples)}: {mean_len:.0f} tokens), "
          f"micro-batches of {_MICRO.value}, padded lengths {sorted({b['input_ids'].shape[-1] for b in batches})}; "
          f"captured layers {list(aux_ids)}", flush=True)

    targets = {d: load_target(resolve_model_path(_TARGET.value), dtype=jnp.dtype(d)) for d in DTYPES}
    head_f32 = jnp.asarray(teacher.frozen_tables(targets["float32"])[1], jnp.float32)

    @jax.jit
    def compare(final_ref, final, mask):
        # next-token distributions of both teachers through the float32 lm_head, on answer tokens
        p = jax.nn.softmax(final_ref.astype(jnp.float32) @ head_f32.T, -1)
        q = jax.nn.softmax(final.astype(jnp.float32) @ head_f32.T, -1)
        same = (p.argmax(-1) == q.argmax(-1)) & mask
        tv = 0.5 * jnp.abs(p - q).sum(-1) * mask
        return same.sum(), tv.sum(), mask.sum()

    results = {"num_samples": n, "mean_length": mean_len, "teachers": {}}
    finals_ref = []
    for dtype in DTYPES:
        target = targets[dtype]
        fn = jax.jit(lambda ids, valid, target=target: teacher.teacher_outputs(target, ids, valid, aux_ids))
        for b in batches[:1]:           # compile every shape the timed pass will see
            for ids, valid in zip(b["input_ids"], b["valid"]):
                jax.block_until_ready(fn(ids, valid))
        seen = {b["input_ids"].shape for b in batches}
        clock.reset()
        t0 = time.perf_counter()
        finals = []
        for b in batches:
            for ids, valid in zip(b["input_ids"], b["valid"]):
                finals.append(jax.block_until_ready(fn(ids, valid)).final_hidden_BSH)
        seconds = time.perf_counter() - t0 - clock.seconds
        row = {"forward_s_per_seq": seconds / n, "compile_s_excluded": clock.seconds, "shapes": len(seen)}
        if dtype == "float32":
            finals_ref = finals
        masks = [m for b in batches for m in b["loss_mask"]]
        agree = [compare(r, f, m) for r, f, m in zip(finals_ref, finals, masks)]
        tokens = sum(int(a[2]) for a in agree)
        row["top1_agreement_vs_f32"] = sum(int(a[0]) for a in agree) / tokens
        row["mean_tv_vs_f32"] = sum(float(a[1]) for a in agree) / tokens
        with tempfile.TemporaryDirectory(prefix="teacher_shards_") as tmp:
            meta = teacher_shards.ShardMeta(num_writers=1, shard_size=_GLOBAL.value, aux_layer_ids=aux_ids,
                                     hidden_size=target.cfg.hidden_size,
                                     aux_width=len(aux_ids) * target.cfg.hidden_size, dtype=dtype,
                                     target=_TARGET.value, max_len=_MAX_LEN.value)
            timed = samples[:n]
            clock.reset()
            t0 = time.perf_counter()
            teacher_shards.write_teacher_shards(target, timed, tmp, writer=0, meta=meta, batch_size=_MICRO.value)
            row["shard_write_s_per_seq"] = (time.perf_counter() - t0 - clock.seconds) / n
            size = sum(p.stat().st_size for p in Path(tmp).iterdir())
            tokens_written = sum(len(s.input_ids) for s in timed)
            row["shard_bytes_per_token"] = size / tokens_written
            row["shard_gb_per_1000_answers"] = size / tokens_written * mean_len * 1000 / 1e9
            t0 = time.perf_counter()
            stream = teacher_shards.ShardStream(tmp, poll_seconds=0.1, timeout_seconds=1.0)
            for _ in range(n):
                next(stream)
            row["shard_read_s_per_seq"] = (time.perf_counter() - t0) / n
            if _STEPS.value and dtype == "bfloat16":
                results["offline_train_s_per_seq"] = _train_seconds(
                    cfg, draft, target, ShardBatches(tmp, n, cfg), online=False, clock=clock)
        if _STEPS.value:
            row["online_train_s_per_seq"] = _train_seconds(cfg, draft, target, batches, online=True, clock=clock)
        results["teachers"][dtype] = row
        print(f"{dtype:>9} teacher: forward {row['forward_s_per_seq']:.3f} s/seq, top-1 agreement with f32 "
              f"{row['top1_agreement_vs_f32']:.4f}, mean TV {row['mean_tv_vs_f32']:.4f}; shards: write "
              f"{row['shard_write_s_per_seq']:.3f} s/seq, read {row['shard_read_s_per_seq']:.4f} s/seq, "
              f"{row['shard_bytes_per_token']:.0f} B/token = {row['shard_gb_per_1000_answers']:.2f} GB per 1,000 "
              f"answers" + (f"; training step, online: {row['online_train_s_per_seq']:.3f} s/seq"
                           if _STEPS.value else ""), flush=True)
    h = targets["float32"].cfg.hidden_size
    aux_bytes = len(aux_ids) * h * 2
    topk_bytes = aux_bytes + _TOP_K.value * 4     # bf16 probability + uint16 id (vocab < 65536)
    results["top_k_estimate"] = {"k": _TOP_K.value, "bytes_per_token": topk_bytes,
                                 "gb_per_1000_answers": topk_bytes * mean_len * 1000 / 1e9,
                                 "vs_bf16_shards_bytes_per_token": aux_bytes + h * 2}
    print(f"top-{_TOP_K.value} teacher (arithmetic): {topk_bytes} B/token (captured states {aux_bytes} + "
          f"{_TOP_K.value} x (bf16 prob + uint16 id)) = {results['top_k_estimate']['gb_per_1000_answers']:.2f} GB "
          f"per 1,000 answers, vs {aux_bytes + h * 2} B/token for bf16 shards with the final hidden state")
    if _STEPS.value:
        print(f"training step, offline teacher (bf16 shards): {results['offline_train_s_per_seq']:.3f} s/seq")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=1) + "\n")


class ShardBatches:
    """The global batches of a shard directory, collated as the trainer does (offline)."""

    def __init__(self, directory, n: int, cfg):
        from dspark_jax.train import teacher_shards
        from dspark_jax.train import batches as batches_lib
        src = batches_lib.ShardSource(teacher_shards.ShardStream(directory, poll_seconds=0.1, timeout_seconds=1.0))
        self.batches = [batches_lib.collate(src.take(cfg.global_batch), cfg, offline=True)
                        for _ in range(n // cfg.global_batch)]

    def __iter__(self):
        return iter(self.batches)


def _train_seconds(cfg, draft, target, batches, *, online: bool, clock) -> float:
    """Seconds per sequence of whole training steps (the first step compiles and is not timed)."""
    import jax

    from dspark_jax.train import trainer as trainer_lib
    tr = trainer_lib.Trainer(cfg, draft.cfg, target, online=online, init_draft=draft, log=lambda _: None)
    batches = list(batches)
    tr.step(batches[0])
    seconds, seqs = 0.0, 0
    for i in range(_STEPS.value):
        b = batches[i % len(batches)]
        clock.reset()
        t0 = time.perf_counter()
        tr.step(b)
        jax.block_until_ready(tr.state.params)
        seconds += time.perf_counter() - t0 - clock.seconds
        seqs += cfg.global_batch
    return seconds / seqs


if __name__ == "__main__":
    app.run(main)
