"""The training programs' mesh: (data, fsdp, tensor) over the devices of one or all processes.

`train.distill`, `train.teacher` and `train.regen` build their mesh here from `--tp`, `--dp` and
`--fsdp` (`define_flags`, `mesh_from_flags`):

- `tensor` (`--tp`): the target (the teacher) split exactly as `serve.server --tp` splits it: the
  same loader, the same logical-axis table (`TEACHER_RULES` is `sharding.LOGICAL_RULES` with the
  model width replicated, which is what serving's size-1 fsdp axis gives), MXFP4 experts kept
  packed, the routed MoE's experts over the same axis (EP = TP). The draft's heads, MLP columns
  and vocabulary rows use it too (the rules table).
- `data` (`--dp`) and `fsdp` (`--fsdp`): the batch is split over both; the draft and its AdamW
  state are sharded over `fsdp` along the model width (gathered per layer) and replicated over
  `data`; the teacher is replicated over both.

Unset `--dp` / `--fsdp`: one process uses `--tp` devices (one by default); a multi-process run
puts every remaining device of the global mesh on `fsdp`. A multi-process mesh must hold every
device of every process (each runs the same SPMD program); one process may use fewer than it sees.
"""

from __future__ import annotations

from typing import Sequence

import jax
from absl import app, flags
from jax.sharding import Mesh

from dspark_jax import sharding as sharding_lib
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.config.kimi import KimiConfig

# The teacher in its serving layout: serving's fsdp axis has size 1, so "embed" and "aux" are
# replicated there; here the training mesh's fsdp axis is the draft's, and the teacher would
# otherwise be gathered along its model width at every layer of every step.
TEACHER_RULES = {**sharding_lib.LOGICAL_RULES, "embed": None, "aux": None}


class MeshError(ValueError):
    """An impossible mesh; the message names the flag and the numbers."""


def tensor_split_sizes(cfg) -> dict[str, int]:
    """The target's dimensions that `--tp` must divide (the config key -> its size): attention
    heads (MLA / GQA query and key-value, KDA) and routed experts (EP over the same axis)."""
    if isinstance(cfg, KimiConfig):
        sizes = {"num_attention_heads": cfg.num_attention_heads}
        if cfg.kda_layers:
            sizes["linear_attn_config.num_heads"] = cfg.kda_num_heads
        if cfg.num_experts:
            sizes["num_experts"] = cfg.num_experts
        return sizes
    if isinstance(cfg, LlamaConfig):
        return {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads}
    raise MeshError(f"--tp: no tensor-parallel layout for a {type(cfg).__name__} target")


def check_target(cfg, tp: int, where: str = "the target") -> None:
    """Raise MeshError unless `tp` divides every dimension the tensor axis splits."""
    if tp == 1:
        return
    bad = [f"{key}={size}" for key, size in tensor_split_sizes(cfg).items() if size % tp]
    if bad:
        raise MeshError(f"--tp {tp} does not divide {where}'s {', '.join(bad)}: each device must hold "
                        f"an equal share of the heads and experts (pick a --tp that divides them)")


def training_mesh(tp: int = 1, dp: int | None = None, fsdp: int | None = None, *,
                  devices: Sequence[jax.Device] | None = None, multi_process: bool | None = None) -> Mesh:
    """The (data=dp, fsdp, tensor=tp) mesh; see the module docstring for the defaults. `devices`:
    default `jax.devices()` (every process's); `multi_process`: default `jax.process_count() > 1`."""
    devices = list(jax.devices() if devices is None else devices)
    multi = jax.process_count() > 1 if multi_process is None else multi_process
    n = len(devices)
    for flag, size in (("--tp", tp), ("--dp", dp), ("--fsdp", fsdp)):
        if size is not None and size < 1:
            raise MeshError(f"{flag} {size}: must be >= 1")
    if n % tp:
        raise MeshError(f"--tp {tp} does not divide the {n} devices ({devices[0].platform})")
    if dp is None and fsdp is None:
        dp, fsdp = 1, (n // tp if multi else 1)
    elif multi:                     # the given one fixes the other: every device takes part
        if dp is None or fsdp is None:
            given, flag = (dp, "--dp") if dp is not None else (fsdp, "--fsdp")
            if n % (tp * given):
                raise MeshError(f"{flag} {given} x --tp {tp} does not divide the {n} devices of the "
                                f"{jax.process_count()} processes")
            rest = n // (tp * given)
            dp, fsdp = (given, rest) if flag == "--dp" else (rest, given)
    else:
        dp, fsdp = dp or 1, fsdp or 1
    used = dp * fsdp * tp
    # --fsdp named only where it is not 1 (train.teacher and train.regen have no such flag)
    product = " x ".join([f"--dp {dp}"] + ([f"--fsdp {fsdp}"] if fsdp != 1 else []) + [f"--tp {tp}"])
    if multi and used != n:
        raise MeshError(f"{product} = {used}, but a multi-process mesh holds all {n} devices of the run")
    if used > n:
        raise MeshError(f"{product} = {used} devices, but {n} {devices[0].platform} device(s) are visible")
    return sharding_lib.make_mesh(tensor=tp, fsdp=fsdp, data=dp, devices=devices[:used])


def describe(mesh: Mesh) -> str:
    shape = " x ".join(f"{k} {v}" for k, v in mesh.shape.items())
    return f"mesh {shape} over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"


# ---------------------------------------------------------------------------------------------
# the programs' flags

FLAGS = flags.FLAGS


def define_flags(fsdp: bool = True) -> None:
    """--dp (and --fsdp); --tp comes from `pair_flags.define_tp` (one text for every program)."""
    flags.DEFINE_integer("dp", None, "Data-parallel replicas (the mesh's data axis; default: see --fsdp).",
                         lower_bound=1)
    if fsdp:
        flags.DEFINE_integer("fsdp", None, "Devices the draft and its optimizer state are sharded over (the "
                             "mesh's fsdp axis). Unset with --dp: one process uses --tp devices, a multi-process "
                             "run puts all the other devices here.", lower_bound=1)


def mesh_from_flags(target_cfg, *, devices: Sequence[jax.Device] | None = None,
                    multi_process: bool | None = None) -> Mesh:
    """The mesh `--tp`, `--dp`, `--fsdp` describe, checked against the target; a bad combination
    is a usage error naming the flags."""
    fsdp = FLAGS["fsdp"].value if "fsdp" in FLAGS else None
    try:
        check_target(target_cfg, FLAGS.tp)
        return training_mesh(FLAGS.tp, FLAGS.dp, fsdp, devices=devices, multi_process=multi_process)
    except MeshError as e:
        raise app.UsageError(str(e)) from None
