"""`numerics.argmax`: the index `jnp.argmax` gives (rows without NaN), in its two-level form on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import numerics


def _rows(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("v", [49152, 5000, 1000, 1025])     # whole chunks, a padded last chunk, one level
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_argmax_is_jnp_argmax(v, dtype):
    rng = np.random.default_rng(v)
    x = _rows(rng, (3, 4, v), dtype)
    x[0, 0, [7, v - 1]] = 1e4                          # a tie across chunks: the first index
    x[0, 1, [v // 2, v // 2 + 1]] = 1e4                # a tie inside one chunk
    x[0, 2, :] = -np.inf                               # nothing but -inf: index 0
    x[0, 3, v - 1] = 1e4                               # the maximum in the (padded) last chunk
    x[1, 0, [v - 3, 9]] = np.inf                       # infinities: the first one
    x[1, 2, : v // 2] = -np.inf                        # -inf before the maximum (a reduced vocabulary)
    x[1, 1, :] = 2.0                                   # all equal
    got = np.asarray(jax.jit(numerics.argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (3, 4)
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, np.argmax(np.asarray(x, np.float32), axis=-1))
    assert got[0, 0] == 7 and got[0, 1] == v // 2 and got[0, 2] == 0 and got[0, 3] == v - 1 and got[1, 0] == 9


def test_argmax_of_integers_and_a_single_row():
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, (1, 3000)).astype(np.int32)
    assert int(numerics.argmax(jnp.asarray(x))[0]) == int(np.argmax(x[0]))
    assert numerics.argmax(jnp.asarray(x[0])).shape == ()
    assert int(numerics.argmax(jnp.asarray(x[0]))) == int(np.argmax(x[0]))


def test_argmax_searches_chunks_on_cpu():
    """The compiled CPU program reduces the (value, index) pairs over a chunk and the chunk
    maxima, never over a whole row: what makes it fast there."""
    if jax.default_backend() != "cpu":
        pytest.skip("the two-level form is the CPU's")
    v = 49152
    text = jax.jit(numerics.argmax).lower(jax.ShapeDtypeStruct((8, v), jnp.float32)).compile().as_text()
    plain = jax.jit(lambda x: jnp.argmax(x, -1)).lower(jax.ShapeDtypeStruct((8, v), jnp.float32)).compile().as_text()
    assert f"s32[8,{v}]" in plain                      # the plain form pairs every id with its index
    assert f"s32[8,{v}]" not in text and f"[8,{v // numerics.ARGMAX_CHUNK},{numerics.ARGMAX_CHUNK}]" in text
