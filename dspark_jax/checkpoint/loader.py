"""Streaming HF-safetensors -> NNX loader shared by every model family.

The module is built abstractly (`nnx.eval_shape`): its Params give, per weight, the torch name
(the NNX path), shape, dtype and logical axes. Everything is checked against the safetensors
headers first (no tensor data read), so a bad checkpoint fails before any device work and the
error lists every offending tensor with its file. Then tensors are read one at a time and placed
straight into their sharding, so host memory peaks at about one tensor and no device ever holds
an unsharded copy of a sharded weight.

Stacked params: a param whose path contains `experts.` followed by a non-integer component
(`...block_sparse_moe.experts.w1.weight`, shape [E, ...]) is filled from the per-expert tensors
`...experts.{e}.w1.weight` (or from one tensor of the stacked name when the checkpoint has it),
each device's slice of the expert axis built from only the experts it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint.safetensors_io import CheckpointError, ShardedCheckpoint
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.models.kimi import KimiLinearModel, hf_rename
from dspark_jax.models.llama import LlamaModel

DtypePolicy = Literal["strict", "cast"]
Progress = Callable[[int, int, str], None]

# `experts.` followed by something that is not an expert index: a stacked [E, ...] param
_STACKED = re.compile(r"(?:^|\.)experts\.(?!\d+(?:\.|$))")
_MAX_LISTED = 12


@dataclass(frozen=True)
class ParamPlan:
    path: str                      # NNX path of the param
    names: tuple[str, ...]         # checkpoint tensors: one, or one per expert (stacked)
    stacked: bool                  # True: names[e] fills row e of the param
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]   # logical axes (the sharding rules place it)


def expert_tensor_name(stacked_name: str, expert: int) -> str:
    """`a.experts.w1.weight`, 3 -> `a.experts.3.w1.weight`."""
    m = _STACKED.search(stacked_name)
    if m is None:
        raise ValueError(f"{stacked_name!r} is not a stacked experts name")
    return f"{stacked_name[:m.end()]}{expert}.{stacked_name[m.end():]}"


def _renamer(rename: Callable[[str], str] | Mapping[str, str] | None) -> Callable[[str], str]:
    if rename is None:
        return lambda p: p
    if isinstance(rename, Mapping):
        return lambda p: rename.get(p, p)
    return rename


def _file(ckpt: ShardedCheckpoint, name: str) -> Path:
    return ckpt.dir / ckpt.where[name]


def _dtype_problem(ckpt: ShardedCheckpoint, name: str, want: np.dtype, policy: DtypePolicy) -> str | None:
    info = ckpt.info(name)
    got = info.np_dtype
    if got == want:
        return None
    floats, want_float = jnp.issubdtype(got, jnp.floating), jnp.issubdtype(want, jnp.floating)
    if policy == "cast" and floats and want_float:
        return None
    hint = " (dtype_policy='cast' converts floats)" if policy == "strict" and floats and want_float else ""
    return f"{_file(ckpt, name)}: tensor {name!r} is {info.dtype}, the model expects {want.name}{hint}"


def _check(ckpt: ShardedCheckpoint, name: str, shape: tuple[int, ...], dtype: np.dtype,
           policy: DtypePolicy, path: str) -> list[str]:
    if name not in ckpt:
        return [f"{ckpt.dir}: missing tensor {name!r} (parameter {path!r}, shape {list(shape)} {dtype.name})"]
    got = ckpt.info(name).shape
    if got != shape:
        return [f"{_file(ckpt, name)}: tensor {name!r} has shape {list(got)}, the model expects {list(shape)}"]
    problem = _dtype_problem(ckpt, name, dtype, policy)
    return [problem] if problem else []


def plan_params(flat: Mapping[str, nnx.Param], ckpt: ShardedCheckpoint, to_name: Callable[[str], str],
          policy: DtypePolicy) -> tuple[list[ParamPlan], list[str]]:
    plans, errors = [], []
    for path, p in flat.items():
        value = p.get_value()
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        axes = params_lib.logical_axes(p)
        name = to_name(path)
        if _STACKED.search(name) and name not in ckpt:
            names = tuple(expert_tensor_name(name, e) for e in range(shape[0]))
            for n in names:
                errors += _check(ckpt, n, shape[1:], dtype, policy, path)
            plans.append(ParamPlan(path, names, True, shape, dtype, axes))
        else:
            errors += _check(ckpt, name, shape, dtype, policy, path)
            plans.append(ParamPlan(path, (name,), False, shape, dtype, axes))
    return plans, errors


def read_tensor(ckpt: ShardedCheckpoint, name: str, dtype: np.dtype) -> np.ndarray:
    arr = ckpt.read(name)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def stacked_array(ckpt: ShardedCheckpoint, plan: ParamPlan, sharding: NamedSharding) -> jax.Array:
    """Build each device's slice from only the experts it holds; replicas of a slice are copied
    device to device instead of re-read."""
    placed: dict[tuple, jax.Array] = {}
    singles = []
    for device, index in sharding.addressable_devices_indices_map(plan.shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, plan.shape))
        if key not in placed:
            lo, hi, _ = key[0]
            host = np.empty((hi - lo,) + plan.shape[1:], plan.dtype)
            for row, e in enumerate(range(lo, hi)):
                host[row] = read_tensor(ckpt, plan.names[e], plan.dtype)
            placed[key] = jax.device_put(host[(slice(None),) + tuple(index[1:])], device)
            singles.append(placed[key])
        else:
            singles.append(jax.device_put(placed[key], device))
    return jax.make_array_from_single_device_arrays(plan.shape, sharding, singles)


def load_state(model: nnx.Module | Callable[[], nnx.Module], checkpoint_dir: str | Path, *,
               mesh: Mesh | None = None,
               rename: Callable[[str], str] | Mapping[str, str] | None = None,
               prefix: str = "",
               dtype_policy: DtypePolicy = "strict",
               ignore: Iterable[str] = (),
               progress: Progress | None = None,
               rules=None) -> nnx.Module:
    """Return `model` populated from the HF safetensors checkpoint in `checkpoint_dir`.

    `model` is an abstract module (`nnx.eval_shape(ctor)`; a concrete one works too, only its
    shapes, dtypes and axes are read) or a zero-argument constructor. The tensor for a param is
    `prefix + rename(path)`. Checkpoint tensors that no param consumes are an error unless one of
    the `ignore` regexes matches them (`re.search`). `dtype_policy="cast"` converts float tensors
    to the param dtype; "strict" requires equal dtypes. `mesh` defaults to one device; `rules`
    (default `sharding.LOGICAL_RULES`) maps the params' logical axes onto it.
    Raises `CheckpointError` naming every offending tensor and its file.
    """
    if dtype_policy not in ("strict", "cast"):
        raise ValueError(f"dtype_policy must be 'strict' or 'cast', got {dtype_policy!r}")
    if not isinstance(model, nnx.Module):
        model = params_lib.abstract(model)
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(devices=jax.local_devices()[:1])
    ckpt = ShardedCheckpoint(checkpoint_dir)
    rename_fn = _renamer(rename)

    flat = params_lib.flat_params(model)
    plans, errors = plan_params(flat, ckpt, lambda p: prefix + rename_fn(p), dtype_policy)
    consumed = {n for plan in plans for n in plan.names}
    ignore_re = [re.compile(r) for r in ignore]
    for name in ckpt.keys():
        if name not in consumed and not any(r.search(name) for r in ignore_re):
            errors.append(f"{_file(ckpt, name)}: unexpected tensor {name!r} (no parameter of the model "
                          "reads it; pass an `ignore` pattern to skip it)")
    if errors:
        more = f"\n  ... and {len(errors) - _MAX_LISTED} more" if len(errors) > _MAX_LISTED else ""
        raise CheckpointError(f"checkpoint {ckpt.dir} does not fit the model "
                              f"({len(errors)} problem(s)):\n  " + "\n  ".join(errors[:_MAX_LISTED]) + more)

    def load(targets) -> dict[str, jax.Array]:
        loaded = {}
        for i, plan in enumerate(plans):
            sharding = targets[plan.path].sharding
            if plan.stacked:
                loaded[plan.path] = stacked_array(ckpt, plan, sharding)
            else:
                loaded[plan.path] = jax.device_put(read_tensor(ckpt, plan.names[0], plan.dtype), sharding)
            if progress is not None:
                progress(i + 1, len(plans), plan.path)
        return loaded

    return sharding_lib.place_params(model, mesh, load, rules or sharding_lib.LOGICAL_RULES)


# ---------------------------------------------------------------------------------------------
# each family's target (its model and rename map live in dspark_jax/models/)


def load_kimi(model_dir, *, dtype=None, mesh=None, dtype_policy: str | None = None,
              progress=None, rules=None) -> KimiLinearModel:
    """Load a kimi_linear-family target from an HF directory (K3 wrapper or plain layout),
    tensor by tensor, straight into the mesh's sharding. `dtype` overrides the param dtype of
    the bf16 weights (float32 for tests); F32/U8 tensors keep their dtype."""
    cfg = KimiConfig.from_json(model_dir)
    keys = set(ShardedCheckpoint(model_dir).keys())
    policy = dtype_policy or ("cast" if dtype is not None else "strict")
    return load_state(
        lambda: KimiLinearModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)), model_dir, mesh=mesh,
        rename=hf_rename(keys, cfg.tensor_prefix), prefix=cfg.tensor_prefix, dtype_policy=policy,
        # the K3 wrapper also holds the vision tower and projector; MTP layers are not used
        ignore=(r"^vision_tower\.", r"^mm_projector\.", r"^multi_modal_projector\."),
        progress=progress, rules=rules)


def _dtype_from_config(name: str):
    return jnp.dtype(name.removeprefix("torch."))


def load_llama(model_dir: str | Path, *, dtype=None, mesh: Mesh | None = None,
               progress: Progress | None = None, rules=None) -> LlamaModel:
    """Load an HF-layout llama-family directory (config.json + safetensors, as transformers'
    `save_pretrained` writes it for Llama, Qwen2, Qwen3 and Mistral). Params take the config's
    `torch_dtype` unless `dtype` overrides it (then float tensors are converted)."""
    cfg = LlamaConfig.from_json(Path(model_dir) / "config.json")
    param_dtype = _dtype_from_config(cfg.dtype) if dtype is None else jnp.dtype(dtype)
    abstract = params_lib.abstract(lambda: LlamaModel(cfg, dtype=param_dtype, rngs=nnx.Rngs(0)))
    # some exporters store a copy of the tied table as lm_head.weight; the model reads embed_tokens
    ignore = [rf"^{re.escape(cfg.tensor_prefix)}lm_head\.weight$"] if cfg.tie_word_embeddings else []
    return load_state(abstract, model_dir, mesh=mesh, prefix=cfg.tensor_prefix,
                      dtype_policy="strict" if dtype is None else "cast", ignore=ignore,
                      progress=progress, rules=rules)
