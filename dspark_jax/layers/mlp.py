"""Gated (GLU) MLPs: SwiGLU (Kimi-Linear, the draft) and SiTU-GLU (Kimi-K3, docs/architecture.md §1.5.5)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.layers.linear import Linear
from dspark_jax.numerics import acc_dtype

Activation = Literal["silu", "situ"]


def situ(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """K3's SiTU GLU in fp32 (float64 for float64 inputs):
    `[beta*tanh(g/beta) * sigmoid(g)] * [linear_beta*tanh(u/linear_beta)]`.
    Both halves are soft-clipped (|gate branch| < beta, |up branch| < linear_beta)."""
    acc = acc_dtype(gate, up)
    g = gate.astype(acc)
    u = up.astype(acc)
    return (beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)) * (linear_beta * jnp.tanh(u / linear_beta))


def glu(gate: jax.Array, up: jax.Array, act: Activation, beta: float = 4.0,
        linear_beta: float = 25.0) -> jax.Array:
    """act(gate, up) in the dtype of `gate`, rounded where the torch references round:
    SiTU once at the end (fp32 inside); SwiGLU after silu and after the product (HF's
    `act_fn(gate) * up` in the activation dtype)."""
    if act == "situ":
        return situ(gate, up, beta, linear_beta).astype(gate.dtype)
    if act == "silu":
        return jax.nn.silu(gate.astype(acc_dtype(gate))).astype(gate.dtype) * up
    raise ValueError(f"unknown GLU activation {act!r} (expected 'silu' or 'situ')")


class GLUMLP(nnx.Module):
    """`down_proj(act(gate_proj(x), up_proj(x)))`: dense layer-0 MLP and shared experts."""

    def __init__(self, hidden: int, intermediate: int, *, act: Activation, situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0, dtype, rngs: nnx.Rngs):
        if act not in ("silu", "situ"):
            raise ValueError(f"unknown GLU activation {act!r} (expected 'silu' or 'situ')")
        self.gate_proj = Linear(hidden, intermediate, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.act = act
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta

    def __call__(self, x: jax.Array) -> jax.Array:
        h = glu(self.gate_proj(x), self.up_proj(x), self.act, self.situ_beta, self.situ_linear_beta)
        return self.down_proj(h)
