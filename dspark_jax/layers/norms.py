"""RMSNorm (docs/architecture.md §1.5.1): statistics in fp32 (float64 for float64 inputs: parity tests under x64),
normalised value cast back before the weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.numerics import acc_dtype
from dspark_jax.params import param


def rms_normalize(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x / rms(x) in fp32, or float64 for a float64 x (no weight)."""
    xf = x.astype(acc_dtype(x))
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """`w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)`, as the HF reference computes it."""
    return weight * rms_normalize(x, eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs, axis: str | None = "norm"):
        self.weight = param((dim,), dtype, (axis,), rngs, init="ones")
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return rms_norm(x, self.weight.get_value(), self.eps)
