"""Bias-free linear layers and embeddings, weights in torch layout `[out, in]`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.numerics import linear
from dspark_jax.params import param


class Linear(nnx.Module):
    """y = x @ W.T (+ b). `axes` names the (out, in) logical axes of W."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None],
                 dtype, rngs: nnx.Rngs, bias: bool = False, scale: float = 0.02):
        self.weight = param((out_features, in_features), dtype, axes, rngs, scale=scale)
        self.bias = param((out_features,), dtype, (axes[0],), rngs, init="zeros") if bias else None

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        y = linear(x, self.weight.get_value())
        if self.bias is not None:
            y = y + self.bias.get_value()
        return y


def linear_io(x: jnp.ndarray, w_io: jnp.ndarray) -> jnp.ndarray:
    """y = x @ W for a weight already in [in, out] layout (a serving copy, e.g.
    `LlamaModel.serving_weights`): the layout XLA:CPU's small-M GEMMs run fastest."""
    return jnp.einsum("...i,io->...o", x.astype(w_io.dtype), w_io)


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = param((vocab_size, dim), dtype, ("vocab", "embed"), rngs, scale=1.0)

    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        return jnp.take(self.weight.get_value(), ids, axis=0)

    def attend(self, x: jnp.ndarray) -> jnp.ndarray:
        """Tied lm_head: logits = x @ E.T."""
        return linear(x, self.weight.get_value())
