"""The mesh and the ONE table that maps logical axis names to mesh axes.

Mesh axes: `data` (replicas / batch), `fsdp` (training: weights sharded, gathered per layer),
`tensor` (heads, MLP columns, vocab; experts too: EP uses the same devices as TP, as ATOM does
with TP=EP=8). A logical axis whose size the mesh axis does not divide is replicated instead,
so tiny test models run unchanged on 1 or 8 devices.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax import params as params_lib

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
        "batch": ("data", "fsdp"),
        "seq": None,
        "vocab": "tensor",
        "embed": "fsdp",          # model width of weights: FSDP-sharded when training, size-1 axis otherwise
        "heads": "tensor",        # head-major flattened dims: MLA/KDA q,k,v,o, gates
        "kv_heads": "tensor",
        "head_dim": None,
        "q_lora": None,
        "kv_lora": None,          # the 512(+64) latent: replicated, every head reads it
        "mlp": "tensor",          # dense / shared-expert intermediate
        "experts": "tensor",      # routed experts (EP)
        "expert_mlp": None,
        "expert_in": None,
        "latent": "tensor",       # latent-MoE width: the down/up projections split it (the experts,
                                  # already on "tensor" by expert, keep it whole)
        "conv": None,
        "markov": None,
        "aux": "fsdp",            # concatenated aux features (context_proj input)
        "norm": None,
        "scalar": None,
}


def make_mesh(tensor: int | None = None, fsdp: int = 1, data: int | None = None,
             devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all). Unspecified sizes absorb the rest."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if tensor is None:
        tensor = n // (fsdp * (data or 1))
    if data is None:
        data = n // (fsdp * tensor)
    if data * fsdp * tensor != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} != {n} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def _mesh_axis_size(mesh: Mesh, axis: str | tuple[str, ...] | None) -> int:
    if axis is None:
        return 1
    names = (axis,) if isinstance(axis, str) else axis
    return math.prod(mesh.shape[a] for a in names)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES) -> P:
    """PartitionSpec for a tensor; a mesh axis is used at most once and only where it divides."""
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        if target is not None:
            names = (target,) if isinstance(target, str) else tuple(target)
            names = tuple(a for a in names if a not in used and mesh.shape[a] > 1)
            if names and size % _mesh_axis_size(mesh, names) == 0:
                used.update(names)
                out.append(names[0] if len(names) == 1 else names)
                continue
        out.append(None)
    return P(*out)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _named(v: nnx.Variable, mesh: Mesh, rules) -> NamedSharding:
    if isinstance(v, nnx.Param):
        spec = logical_to_spec(params_lib.logical_axes(v), v.get_value().shape, mesh, rules)
    else:
        spec = P()
    return NamedSharding(mesh, spec)


def param_shardings(module_or_state, mesh: Mesh, rules=LOGICAL_RULES) -> nnx.State:
    """The module's state with every value replaced by its NamedSharding (same tree structure)."""
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state)
    return jax.tree.map(lambda v: v.replace(_named(v, mesh, rules)), state, is_leaf=_is_var)


def shard_module(module: nnx.Module, mesh: Mesh, rules=LOGICAL_RULES) -> nnx.Module:
    """Place every variable of an existing module according to the rules table (in place)."""
    state = nnx.state(module)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(module, jax.device_put(state, shardings))
    return module


def create_sharded(ctor, mesh: Mesh, rules=LOGICAL_RULES):
    """Build `ctor()` directly into its sharding: nothing is materialised unsharded first."""
    graphdef, abs_state = nnx.split(params_lib.abstract(ctor))
    shardings = param_shardings(abs_state, mesh, rules)
    state = jax.jit(lambda: nnx.state(ctor()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def place_params(model, mesh: Mesh, load, rules=LOGICAL_RULES) -> nnx.Module:
    """The one way weights reach devices (HF targets, Orbax targets, drafts): `model` is abstract
    (or a constructor); `load(targets)` gets, per parameter name, a `jax.ShapeDtypeStruct` carrying
    the parameter's NamedSharding from the rules table, and returns the arrays already placed
    there (each loader reads its format its own way: tensor by tensor, or one Orbax restore).
    Returns the module with every parameter filled; a missing one names itself."""
    if not isinstance(model, nnx.Module):
        model = params_lib.abstract(model)
    graphdef, state = nnx.split(model)
    targets = {}
    for name, p in params_lib.flat_params(state).items():
        value = p.get_value()
        spec = logical_to_spec(params_lib.logical_axes(p), value.shape, mesh, rules)
        targets[name] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
    loaded = load(targets)
    flat = []
    for key_path, var in nnx.to_flat_state(state):
        key = ".".join(str(k) for k in key_path)
        if key in loaded:
            var = var.replace(loaded[key])
        elif isinstance(var.get_value(), jax.ShapeDtypeStruct):
            raise ValueError(f"{key}: no value loaded for this abstract {type(var).__name__} (only "
                             "parameters are loaded from checkpoints)")
        flat.append((key_path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
