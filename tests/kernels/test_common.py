"""The kernels' shared helpers (tiling arithmetic, padding) and the flash core's dense reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.kernels import mla_flash
from dspark_jax.kernels.common import cdiv, check_pow2, next_pow2, pad_to, round_up
from tests.float64 import x64


def test_tiling_arithmetic():
    assert [next_pow2(n) for n in (1, 2, 3, 17, 64)] == [1, 2, 4, 32, 64]
    assert [round_up(n, 16) for n in (0, 1, 16, 17)] == [0, 16, 16, 32]
    assert [cdiv(n, 8) for n in (1, 8, 9)] == [1, 1, 2]
    check_pow2(block=64, dim=128)
    with pytest.raises(ValueError, match="block"):
        check_pow2(block=48)


def test_pad_to_extends_one_axis_with_the_value():
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    y = pad_to(x, 1, 5, value=-1.0)
    assert y.shape == (2, 5)
    np.testing.assert_array_equal(np.asarray(y), [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]])
    assert pad_to(x, 0, 2) is x                  # already that size: no copy


def test_dense_reference_is_masked_softmax_attention_in_float64():
    rng = np.random.default_rng(0)
    b, q, k, n, h, r, v = 1, 3, 5, 2, 4, 2, 3
    qn, qr = rng.normal(size=(b, q, n, h)), rng.normal(size=(b, q, n, r))
    kn, kr, vv = rng.normal(size=(b, k, n, h)), rng.normal(size=(b, k, r)), rng.normal(size=(b, k, n, v))
    mask = np.tril(np.ones((q, k), bool), k - q)[None]
    with x64():
        got = np.asarray(mla_flash.dense_reference(*(jnp.asarray(a) for a in (qn, qr, kn, kr, vv)),
                                                   jnp.asarray(mask), 0.5))
    s = (np.einsum("bqnh,bknh->bnqk", qn, kn) + np.einsum("bqnr,bkr->bnqk", qr, kr)) * 0.5
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bnqk,bknv->bqnv", p, vv), rtol=1e-12, atol=1e-12)
