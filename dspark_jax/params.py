"""One declaration per weight: shape, dtype, logical axes and initializer.

Every weight in every model is created through `declare`, so the same declaration drives
random init, the sharding (logical axes -> mesh axes via `sharding.LOGICAL_RULES`), the
checkpoint converters (the NNX path *is* the torch tensor name) and Orbax restore targets.

Convention: weights keep the torch layout, `[out, in]` for linear layers, so conversion is a
rename and never a transpose (byte-identical round trips for free). Matmuls are einsums
against `[out, in]`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Literal["normal", "ones", "zeros", "uniform_pm1", "e8m0"]


@dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    dtype: jnp.dtype
    axes: tuple[str | None, ...]
    init: Init = "normal"
    scale: float = 0.02

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.axes} differ in rank")


# Set while building abstract modules: weights skip the RNG (see `abstract`).
_ABSTRACT = contextvars.ContextVar("dspark_abstract_init", default=False)


@contextlib.contextmanager
def _abstract_init():
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def abstract(ctor):
    """`nnx.eval_shape(ctor)` without drawing random numbers: shapes, dtypes and axes only.
    Drawing keys from `nnx.Rngs` while tracing costs time quadratic in the number of weights
    (each key update inspects the trace), minutes for the full K3 target."""
    with _abstract_init():
        return nnx.eval_shape(ctor)


def declare(spec: WeightSpec, rngs: nnx.Rngs) -> nnx.Param:
    """Create the parameter described by `spec`; its logical axes ride along as metadata."""
    if _ABSTRACT.get():
        return nnx.Param(jnp.zeros(spec.shape, spec.dtype), axes=tuple(spec.axes))
    if spec.init == "ones":
        value = jnp.ones(spec.shape, spec.dtype)
    elif spec.init == "zeros":
        value = jnp.zeros(spec.shape, spec.dtype)
    elif spec.init == "e8m0":
        # E8M0 exponent bytes (MXFP4 scales): the constant byte whose 2**(s-127) is nearest `scale`
        value = jnp.full(spec.shape, min(max(127 + round(math.log2(spec.scale)), 1), 254), spec.dtype)
    elif spec.init == "uniform_pm1":
        value = jax.random.uniform(rngs.params(), spec.shape, jnp.float32, -1.0, 1.0).astype(spec.dtype)
    elif jnp.issubdtype(spec.dtype, jnp.integer):
        # packed quantised weights (MXFP4 nibbles, E8M0 scales): random bytes in the valid range
        value = jax.random.randint(rngs.params(), spec.shape, 0, 256, jnp.int32).astype(spec.dtype)
    else:
        value = (spec.scale * jax.random.normal(rngs.params(), spec.shape, jnp.float32)).astype(spec.dtype)
    return nnx.Param(value, axes=tuple(spec.axes))


def param(shape: Sequence[int], dtype, axes: Sequence[str | None], rngs: nnx.Rngs,
          init: Init = "normal", scale: float = 0.02) -> nnx.Param:
    return declare(WeightSpec(tuple(int(s) for s in shape), jnp.dtype(dtype), tuple(axes), init, scale), rngs)


def flat_params(module_or_state) -> dict[str, nnx.Param]:
    """`{"layers.3.self_attn.q_a_proj.weight": Param}`: the dotted NNX path is the torch name."""
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state, nnx.Param)
    return {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


def logical_axes(p: nnx.Param) -> tuple[str | None, ...]:
    return tuple(p.get_metadata().get("axes", (None,) * len(p.get_value().shape)))

