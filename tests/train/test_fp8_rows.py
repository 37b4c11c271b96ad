"""Float8 e4m3fn rows with a float32 scale each (dspark_jax/train/fp8_rows.py): the round trip's
error bound follows from e4m3fn's format, and is attained, so the storage really is 3-bit mantissa
float8 scaled per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dspark_jax.train.fp8_rows import FP8_MAX, dequantize_rows, quantize_rows, quantize_rows_jax

# e4m3fn: 3 mantissa bits, smallest normal 2^-6, subnormal spacing 2^-9. Rounding to nearest is off
# by at most half a spacing: 2^-4 of the value where it is normal, 2^-10 below 2^-6 (in units of s).
HALF_ULP_REL = 2.0 ** -4
SUBNORMAL_HALF_SPACING = 2.0 ** -10
MIN_NORMAL = 2.0 ** -6
# float32 rounding around it: the input (a float64 one), x / s and q * s, each <= 2^-24 relative
# of a quantity <= 2 |x| + s: 2^-21 (|x| + s) covers them
F32_SLACK = 2.0 ** -21


def _rows(dtype, seed=0, n=64, g=3, h=512) -> np.ndarray:
    """Rows of mixed sign whose magnitudes span 12 decades within a row (so many values fall in
    e4m3fn's subnormal range after scaling) and whose row scales span 12 decades too."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-6, 6, (n, g, 1)) * 10.0 ** rng.uniform(-12, 0, (n, g, h))
    x = mag * rng.choice([-1.0, 1.0], (n, g, h))
    return x.astype(np.dtype(dtype))


@pytest.mark.parametrize("dtype", ["float32", ml_dtypes.bfloat16, "float64"])
def test_round_trip_error_is_bounded_by_e4m3_rounding_and_attains_it(dtype):
    x = _rows(dtype)
    q, s = quantize_rows(x)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32 and s.shape == x.shape[:2]
    assert np.isfinite(q.astype(np.float32)).all()
    got = dequantize_rows(q, s, np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    s64 = s.astype(np.float64)[..., None]
    err = np.abs(got - x64)
    bound = np.maximum(HALF_ULP_REL * np.abs(x64), SUBNORMAL_HALF_SPACING * s64) + F32_SLACK * (np.abs(x64) + s64)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound):.3g}"
    # the coarser statement: every value within 2^-4 of its row's largest magnitude
    amax = np.max(np.abs(x64), axis=-1, keepdims=True)
    assert np.all(err <= HALF_ULP_REL * amax * (1 + 2.0 ** -20))
    # the bound is tight: normal values reach nearly 2^-4 relative error, subnormal ones nearly
    # 2^-10 s (a finer format, e.g. bf16 with 2^-9, would fail both)
    normal = np.abs(x64) >= MIN_NORMAL * s64
    assert np.max(err[normal] / np.abs(x64[normal])) > 0.9 * HALF_ULP_REL
    sub = ~normal & (np.abs(x64) > 0)
    assert sub.sum() > 1000
    assert np.max((err / s64)[sub]) > 0.9 * SUBNORMAL_HALF_SPACING


def test_each_row_max_is_stored_as_448_and_scales_are_per_row():
    x = _rows(np.float32, seed=1, n=8, g=2, h=64)
    x[3, 1] *= 1e20                         # one huge row leaves every other row's scale alone
    q, s = quantize_rows(x)
    q32 = q.astype(np.float32)
    at_max = np.argmax(np.abs(x), axis=-1)
    picked = np.take_along_axis(q32, at_max[..., None], -1)[..., 0]
    np.testing.assert_array_equal(np.abs(picked), FP8_MAX)
    np.testing.assert_array_equal(np.sign(picked), np.sign(np.take_along_axis(x, at_max[..., None], -1)[..., 0]))
    assert np.all(np.abs(q32) <= FP8_MAX)
    np.testing.assert_allclose(s, np.max(np.abs(x), axis=-1) / FP8_MAX, rtol=2.0 ** -22)
    q_alone, s_alone = quantize_rows(x[3:4, 0:1])
    np.testing.assert_array_equal(s_alone[0, 0], s[3, 0])
    np.testing.assert_array_equal(q_alone.view(np.uint8)[0, 0], q.view(np.uint8)[3, 0])


def test_zero_rows_and_output_dtype():
    x = np.zeros((2, 3, 16), ml_dtypes.bfloat16)
    x[1, 2, 5] = -3.0
    q, s = quantize_rows(x)
    np.testing.assert_array_equal(s[0], 1.0)
    assert s[1, 2] == np.float32(3.0) * np.float32(1 / FP8_MAX)     # max|x| * fl(1/448)
    out = dequantize_rows(q, s, "bfloat16")
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), x.astype(np.float32))   # 0 and -3 round-trip exactly


@pytest.mark.parametrize("dtype", ["float32", ml_dtypes.bfloat16])
def test_device_quantization_gives_the_host_bits(dtype):
    """The teacher quantizes inside its jitted step; the shards must not depend on where."""
    x = _rows(dtype, seed=2, n=128, g=6, h=576)
    q, s = quantize_rows(x)
    q_dev, s_dev = jax.jit(quantize_rows_jax)(jnp.asarray(x))
    assert q_dev.dtype == jnp.float8_e4m3fn and s_dev.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q_dev).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s_dev), s)
