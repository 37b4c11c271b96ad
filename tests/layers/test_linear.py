"""The dense projections: `Linear` (torch layout [out, in], optional bias), `linear_io` (a serving
copy in [in, out]) and the embedding's tied head, against numpy in float64."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.layers.linear import Embed, Linear, linear_io
from tests.float64 import x64


def test_projections_match_numpy_in_float64():
    with x64():
        lin = Linear(4, 3, axes=(None, None), dtype=jnp.float64, rngs=nnx.Rngs(0), bias=True)
        lin.bias.set_value(jnp.asarray([1.0, -2.0, 0.5]))
        emb = Embed(7, 4, dtype=jnp.float64, rngs=nnx.Rngs(1))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)))
        w, e = np.asarray(lin.weight.get_value()), np.asarray(emb.weight.get_value())
        assert w.shape == (3, 4)                                         # torch layout
        np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(x) @ w.T + [1.0, -2.0, 0.5], rtol=1e-13)
        np.testing.assert_allclose(np.asarray(linear_io(x, jnp.asarray(w.T))), np.asarray(x) @ w.T, rtol=1e-13)
        np.testing.assert_array_equal(np.asarray(emb(jnp.asarray([3, 0]))), e[[3, 0]])
        np.testing.assert_allclose(np.asarray(emb.attend(x)), np.asarray(x) @ e.T, rtol=1e-13)
