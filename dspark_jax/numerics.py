"""Products accumulated in float32, in a form every backend runs.

A bf16 GEMM accumulates in float32 (`preferred_element_type`). XLA:CPU on Xeons with AMX /
AVX-512 BF16 has no bf16 x bf16 -> f32 dot in its thunk runtime ("Unsupported element type for
DotThunk::Execute"), while CPUs without them upcast silently: the same program runs on one CPU
and crashes on the next. On CPU the operands are therefore upcast first; bf16 (and fp8) products
are exact in float32 and the sum is float32 either way, so the value is the same computation.
Float64 operands (parity tests under x64) stay float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def acc_dtype(*operands) -> jnp.dtype:
    """float32, or float64 when an operand is float64."""
    return jnp.dtype(jnp.float64) if any(x.dtype == jnp.float64 for x in operands) else jnp.dtype(jnp.float32)


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def einsum_acc(spec: str, *operands: jax.Array) -> jax.Array:
    """`jnp.einsum` with a float32 (float64 under x64 inputs) accumulator and result."""
    acc = acc_dtype(*operands)
    if on_cpu():
        return jnp.einsum(spec, *(x.astype(acc) for x in operands))
    return jnp.einsum(spec, *operands, preferred_element_type=acc)
