"""Distillation plan: does one training step of a draft with its Kimi teacher fit the training mesh,
and what does it cost? Abstract models, AOT compile, no weights (as dspark_jax/plan/serving.py for serving).

The program compiled is the trainer's own step (`Trainer.lower_step`: teacher, DSpark loss over
the anchors, gradient accumulation, clipping, AdamW) on the training mesh of `train_mesh`, with
the teacher placed by `TEACHER_RULES` and the draft with its fp32 master weights and AdamW moments
by the rules table:
- `online`: the teacher's forward over each micro-batch's sequences inside the step;
- `offline`: the draft alone, reading the teacher's aux and final hidden states from the batch
  (the teacher's embedding table and lm_head are still arguments).

Reported per device: XLA's buffer assignment (`compiled.memory_analysis()`) and FLOPs
(`compiled.cost_analysis()`), a step-time floor at a device's stated peak dense bf16 rate, and
the offline shard bytes per token (aux + final hidden states in the teacher's dtype, in bf16 and in
float8 with per-row scales, token ids, mask).
XLA's cost analysis counts a loop body once whatever its trip count (a 10-step `fori_loop` of a
matmul reports one matmul's FLOPs): the routed MoE's loop over a device's experts, the KDA chunk
scan and the accumulation scan are under-counted, so the FLOPs and the step time are lower bounds.
The numbers are XLA:CPU's: the CPU backend keeps f32 copies of bf16 weights as temporaries, so the
temporaries are an upper bound for a GPU's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.plan.serving import GIB, ProgramReport, compile_program
from dspark_jax.train import loss as loss_lib
from dspark_jax.train import teacher_shards as teacher_shards_lib
from dspark_jax.train import train_mesh
from dspark_jax.train import trainer as trainer_lib

# Vendors' stated peak dense bf16 matrix rates, FLOP/s per device (no sparsity).
PEAK_BF16_FLOPS = {"MI355X": 2.5e15, "H200": 0.989e15}


@dataclasses.dataclass(frozen=True)
class TrainShape:
    tp: int = 8
    dp: int = 1
    fsdp: int = 1
    seq_len: int = 4096          # tokens of one sequence (one micro-batch row)
    micro_batch: int = 1
    accum_steps: int = 1
    num_anchors: int = 512
    block_size: int = 7
    online: bool = True
    target_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    shape: TrainShape
    mesh: dict
    draft_params: int
    program: ProgramReport       # the step's compile times and XLA's per-device buffer assignment
    flops: float                 # per device, XLA's cost analysis of the partitioned step
    shard_bytes_per_token: dict[str, int]   # offline teacher shards, by storage dtype
    capacity_gib: float = 288.0

    @property
    def peak_bytes(self) -> int:
        return self.program.peak_bytes(0)

    def step_seconds(self, device: str) -> float:
        return self.flops / PEAK_BF16_FLOPS[device]


def shard_bytes_per_token(cfg: KimiConfig, draft_cfg: DraftConfig, dtype: str = "bfloat16") -> int:
    """An offline teacher shard's bytes per token: aux [n_aux * H] + final [H] hidden states in
    `dtype` (float8_e4m3fn: with a float32 scale per row), the int32 token id and the uint8 loss
    mask (dspark_jax/train/teacher.py, the format's own count)."""
    return teacher_shards_lib.bytes_per_token(cfg.hidden_size, len(draft_cfg.target_layer_ids), dtype)


def shard_storage(cfg: KimiConfig, draft_cfg: DraftConfig, target_dtype: str) -> dict[str, int]:
    """Bytes per token of the shards `train.teacher` can write for this pair: in the teacher's
    dtype, in bf16 and in float8 (`--aux_dtype`)."""
    dtypes = dict.fromkeys((target_dtype, "bfloat16", teacher_shards_lib.FP8))
    return {d: shard_bytes_per_token(cfg, draft_cfg, d) for d in dtypes}


def _sharded_module(ctor, mesh, rules):
    model = params_lib.abstract(ctor)
    graphdef, state = nnx.split(model)
    shardings = sharding_lib.param_shardings(state, mesh, rules)
    state = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                                     sharding=s.get_value())),
                         state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def build_train_plan(cfg: KimiConfig, draft_cfg: DraftConfig, shape: TrainShape, *,
                     progress: Callable[[str], None] | None = None) -> TrainPlan:
    """Compile one distillation step for `shape` on fake CPU devices (enough of them must exist:
    `plan.configure_cpu_devices`) and collect the report."""

    train_mesh.check_target(cfg, shape.tp)
    mesh = train_mesh.training_mesh(shape.tp, shape.dp, shape.fsdp, multi_process=False)
    target = _sharded_module(lambda: KimiLinearModel(cfg, dtype=jnp.dtype(shape.target_dtype), rngs=nnx.Rngs(0)),
                             mesh, train_mesh.TEACHER_RULES)
    draft = params_lib.abstract(lambda: K3DSparkModel(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(draft, nnx.Param)))
    tcfg = trainer_lib.TrainConfig(
        run_dir="unused", total_steps=1, global_batch=shape.micro_batch * shape.accum_steps,
        micro_batch=shape.micro_batch, max_len=shape.seq_len, compute_dtype=shape.compute_dtype, export=False,
        loss=loss_lib.LossConfig(block_size=shape.block_size, num_anchors=shape.num_anchors))
    tr = trainer_lib.Trainer(tcfg, draft_cfg, target, online=shape.online, mesh=mesh, init_draft=draft,
                             log=lambda _: None)
    m, b, s = shape.accum_steps, shape.micro_batch, shape.seq_len
    batch = {"input_ids": jax.ShapeDtypeStruct((m, b, s), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((m, b, s), jnp.bool_),
             "valid": jax.ShapeDtypeStruct((m, b, s), jnp.bool_)}
    if not shape.online:
        dt = jnp.dtype(shape.target_dtype)
        batch["aux"] = jax.ShapeDtypeStruct((m, b, s, len(draft_cfg.target_layer_ids) * cfg.hidden_size), dt)
        batch["final"] = jax.ShapeDtypeStruct((m, b, s, cfg.hidden_size), dt)
    if progress:
        progress(f"{train_mesh.describe(mesh)}: the {'online' if shape.online else 'offline'} step")
    with jax.set_mesh(mesh):
        program, compiled = compile_program("step", "one distillation step", lambda: tr.lower_step(batch), progress)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return TrainPlan(shape, dict(mesh.shape), int(n_params), program, float(cost.get("flops", 0.0)),
                     shard_storage(cfg, draft_cfg, shape.target_dtype))


def format_train_plan(plan: TrainPlan) -> list[str]:
    s, p = plan.shape, plan.program
    gib = lambda n: f"{n / GIB:8.2f}"
    lines = [f"distillation step, {'online' if s.online else 'offline'} teacher: mesh "
             + " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
             + f"; {s.accum_steps} x {s.micro_batch} sequences of {s.seq_len} tokens, {s.num_anchors} anchors, "
             f"block {s.block_size}; draft {plan.draft_params:,} parameters (fp32 master + AdamW), "
             f"teacher {s.target_dtype}, compute {s.compute_dtype}",
             f"XLA:CPU AOT: lowered in {p.lower_s:.1f} s, compiled in {p.compile_s:.1f} s",
             "per device (GiB): arguments" + gib(p.argument_bytes) + "  temporaries" + gib(p.temp_bytes)
             + "  outputs" + gib(p.output_bytes) + "  aliased" + gib(p.alias_bytes),
             f"FLOPs per step per device (XLA cost analysis, loop bodies counted once: a lower bound): "
             f"{plan.flops:.3e}"]
    for device, peak in PEAK_BF16_FLOPS.items():
        lines.append(f"step-time floor at {device}'s stated peak dense bf16 ({peak / 1e15:.3g} PFLOP/s): "
                     f"{plan.step_seconds(device):.3f} s")
    lines.append("offline shard storage per token: " + ", ".join(
        f"{n:,} bytes in {d}" + (" (+ float32 row scales)" if d == teacher_shards_lib.FP8 else "")
        for d, n in plan.shard_bytes_per_token.items()))
    lines.append(f"per-device peak: {plan.peak_bytes / GIB:.1f} GiB of {plan.capacity_gib:.0f} GiB")
    return lines
