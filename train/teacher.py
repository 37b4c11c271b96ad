"""Write offline teacher shards (format: dspark_jax/train/teacher.py) as one of W writers.

    python -m train.teacher --target smollm2-135m --data runs/demo/regen.jsonl \
        --draft_config dspark_jax/configs/smollm2-135m-dspark.json --out runs/demo/teacher \
        --num_writers 4 --writer 0 [--shard_size 64 --batch_size 4 --max_len 1024 --aux_dtype auto]

Start W of these (one per --writer) and `python -m train.distill --teacher_dir ...` at the same
time: the trainer consumes shards as they are published. Rerunning a writer continues after its
last published shard. --tp N splits the target over N devices as serving does (a Kimi-K3 target on
one node: --tp 8), --dp M splits each batch over M such groups (dspark_jax/train/train_mesh.py).
The hidden states are stored as float8 with one float32 scale per token and layer (half a bf16
shard; held-out tok/fwd of a draft trained on them: docs/training.md), or with --aux_dtype auto in
--dtype; every writer of a directory must use the same setting.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp
from absl import app, flags, logging

from dspark_jax.api import load_target
from dspark_jax.config import load_config
from dspark_jax.config.draft import DraftConfig
from dspark_jax.data import answer_cache
from dspark_jax.presets import resolve_model_path
from dspark_jax.serving import pair_flags
from dspark_jax.train import regen, teacher_shards, train_mesh

FLAGS = flags.FLAGS
pair_flags.define_model("smollm2-135m", name="target", help="Target model: directory or preset name.")
pair_flags.define_tp()
train_mesh.define_flags(fsdp=False)
pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Teacher compute dtype (what the trainer receives).")
flags.DEFINE_enum("aux_dtype", teacher_shards.FP8, ["auto", *teacher_shards.AUX_DTYPES],
                  "Storage of the hidden states in the shards: float8_e4m3fn stores each token's row of each "
                  "captured layer (and of the final state) as float8 with one float32 scale (max|x| / 448), half "
                  "a bf16 shard; 'auto' stores them in --dtype. The trainer reads them back in --dtype.")
flags.DEFINE_string("data", None, "Regen cache JSONL.")
flags.DEFINE_string("draft_config", None, "Draft config.json (its target_layer_ids are captured).")
flags.DEFINE_string("out", None, "Shard directory.")
flags.DEFINE_integer("num_writers", 1, "Number of writer processes.", lower_bound=1)
flags.DEFINE_integer("writer", 0, "This writer's index.", lower_bound=0)
flags.DEFINE_integer("shard_size", 64, "Sequences per shard.", lower_bound=1)
flags.DEFINE_integer("batch_size", 4, "Sequences per teacher forward.", lower_bound=1)
flags.DEFINE_integer("max_len", 1024, "Sequence length (the trainer's --max_len).", lower_bound=2)
flags.mark_flags_as_required(["data", "draft_config", "out"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)     # Orbax and JAX log every save at INFO
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[teacher {time.time() - t0:8.1f}s] {msg}", flush=True)

    draft_cfg = DraftConfig.from_json(FLAGS.draft_config)
    cfg = load_config(resolve_model_path(FLAGS.target))
    meta = teacher_shards.ShardMeta(num_writers=FLAGS.num_writers, shard_size=FLAGS.shard_size,
                             aux_layer_ids=tuple(draft_cfg.target_layer_ids), hidden_size=cfg.hidden_size,
                             aux_width=len(draft_cfg.target_layer_ids) * cfg.hidden_size, dtype=FLAGS.dtype,
                             target=str(FLAGS.target), max_len=FLAGS.max_len,
                             aux_dtype=None if FLAGS.aux_dtype == "auto" else FLAGS.aux_dtype)
    if (Path(FLAGS.out) / teacher_shards.META_FILE).exists():     # a resumed or further writer: same settings
        have = teacher_shards.read_meta(FLAGS.out)
        if have != meta:
            hint = "" if have.aux_dtype == meta.aux_dtype else \
                f"; its storage is --aux_dtype {'auto' if have.aux_dtype == have.dtype else have.aux_dtype}"
            raise app.UsageError(f"{Path(FLAGS.out) / teacher_shards.META_FILE}: written with other settings (the "
                                 f"directory's vs these flags': {have.differences(meta)}){hint}")
    log(f"hidden states stored as {meta.aux_dtype}: "
        f"{teacher_shards.bytes_per_token(meta.hidden_size, len(meta.aux_layer_ids), meta.aux_dtype):,} bytes per token")
    mesh = train_mesh.mesh_from_flags(cfg, multi_process=False)
    log(train_mesh.describe(mesh))
    target = load_target(FLAGS.target, dtype=jnp.dtype(FLAGS.dtype), mesh=mesh, rules=train_mesh.TEACHER_RULES)
    samples = list(regen.samples_from_cache(answer_cache.read_cache(FLAGS.data), max_len=FLAGS.max_len))
    out = teacher_shards.write_teacher_shards(target, samples, FLAGS.out, writer=FLAGS.writer, meta=meta,
                                       batch_size=FLAGS.batch_size, log=log, mesh=mesh)
    log(f"done: {out.num_shards} shards, {out.num_samples} sequences")


if __name__ == "__main__":
    app.run(main)
