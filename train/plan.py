"""Will one distillation step with the Kimi teacher fit the training mesh, and what does it cost?
Abstract build + AOT compile of the trainer's own step, no weights (dspark_jax/plan/training.py).

    python -m train.plan --config kimi-k3 --tp 8 --seq_len 4096 --num_anchors 512 --teacher online
    python -m train.plan --config kimi-k3 --tp 8 --seq_len 4096 --num_anchors 512 --teacher offline

Prints XLA's per-device buffer assignment, the FLOPs per step per device, a step-time floor at
MI355X's and H200's stated peak dense bf16 rates and the offline shard bytes per token (bf16 and
float8 shards, `train.teacher --aux_dtype`); the last
line is `per-device peak: X GiB of C GiB`, and the exit status is 0 if it fits `--hbm_gib *
--usable_fraction`, 1 if not. Runs on fake CPU devices (set up here, before JAX starts).
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app, flags, logging

from dspark_jax.plan import serving as plan_lib
from dspark_jax.train import train_mesh

_CONFIG = flags.DEFINE_string("config", "kimi-k3", "Target: a packaged config name, a config.json or a model dir.")
_DRAFT = flags.DEFINE_string("draft_config", "auto", "Draft config (name, file or dir); 'auto': the packaged "
                             "<config>-dspark.")
_TP = flags.DEFINE_integer("tp", 8, "The training mesh's tensor axis (the teacher split as in serving).", lower_bound=1)
_DP = flags.DEFINE_integer("dp", 1, "The data axis.", lower_bound=1)
_FSDP = flags.DEFINE_integer("fsdp", 1, "The fsdp axis (the draft and its AdamW state).", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence (train.distill's --max_len).", lower_bound=8)
_MICRO = flags.DEFINE_integer("micro_batch", 1, "Sequences per forward/backward.", lower_bound=1)
_ACCUM = flags.DEFINE_integer("accum_steps", 1, "Micro-batches per step.", lower_bound=1)
_ANCHORS = flags.DEFINE_integer("num_anchors", 512, "Anchors per sequence.", lower_bound=1)
_BLOCK = flags.DEFINE_integer("block_size", 7, "Block width.", lower_bound=1)
_TEACHER = flags.DEFINE_enum("teacher", "online", ["online", "offline"], "Teacher inside the step, or read "
                             "from shards.")
_HBM = flags.DEFINE_float("hbm_gib", 288.0, "Memory per device in GiB (MI355X: 288).")
_USABLE = flags.DEFINE_float("usable_fraction", 0.93, "Fraction of device memory the plan may use.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    plan_lib.configure_cpu_devices(_TP.value * _DP.value * _FSDP.value)
    logging.set_verbosity(logging.INFO)
    from dspark_jax.train import train_plan
    cfg, draft_cfg = plan_lib.load_plan_configs(_CONFIG.value, _DRAFT.value)
    if draft_cfg is None:
        raise app.UsageError(f"--draft_config: no draft config for {_CONFIG.value!r}")
    shape = train_plan.TrainShape(tp=_TP.value, dp=_DP.value, fsdp=_FSDP.value, seq_len=_SEQ.value,
                                  micro_batch=_MICRO.value, accum_steps=_ACCUM.value, num_anchors=_ANCHORS.value,
                                  block_size=_BLOCK.value, online=_TEACHER.value == "online")
    try:
        plan = train_plan.build_train_plan(cfg, draft_cfg, shape, progress=logging.info)
    except train_mesh.MeshError as e:
        raise app.UsageError(str(e)) from None
    plan = dataclasses.replace(plan, capacity_gib=_HBM.value)
    print("\n".join(train_plan.format_train_plan(plan)), flush=True)
    sys.exit(0 if plan.peak_bytes <= _HBM.value * _USABLE.value * train_plan.GIB else 1)


if __name__ == "__main__":
    app.run(main)
