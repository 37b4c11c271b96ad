"""Float8 e4m3fn storage with one float32 scale per row, for the offline teacher's hidden states.

A row is H values of one token at one captured layer (or the final state). Its scale is s =
max|x| / 448 (e4m3fn's largest finite value), so the row's largest value is stored as 448 and no
value saturates; q = x / s rounded to nearest e4m3fn. All arithmetic is float32 whatever the input
dtype (a bf16 value is exactly a float32 one), written as products with reciprocals: s = max|x| *
fl(1/448), q = x * fl(1/s). XLA turns divisions by a constant or a broadcast row value into those
products anyway, so spelling them out makes the host (numpy) and the device (`quantize_rows_jax`,
inside the teacher's jitted step) compute the same bits.

Error: e4m3fn has 3 mantissa bits, so for |x / s| >= 2^-6 (its smallest normal) rounding to
nearest is off by at most half an ulp, 2^-4 of the value; below that the spacing is 2^-9, off by
at most 2^-10. Per value, |q * s - x| <= max(2^-4 |x|, 2^-10 s), plus float32 rounding of the
reciprocals and products (a few 2^-24 relative).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0          # e4m3fn's largest finite value: 1.75 * 2^8
_INV_FP8_MAX = np.float32(1.0 / FP8_MAX)


def quantize_rows(x_NGH: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, G, H] e4m3fn, s [N, G] float32): each row along the last axis scaled by its own s.
    An all-zero row gets s = 1 (q is 0 whatever s is)."""
    x = np.asarray(x_NGH, np.float32)
    amax_NG = np.max(np.abs(x), axis=-1)
    scale_NG = np.where(amax_NG > 0, amax_NG * _INV_FP8_MAX, np.float32(1.0)).astype(np.float32)
    inv_NG = (np.float32(1.0) / scale_NG).astype(np.float32)
    # x * fl(1/s) of the row maximum can round a hair above 448; e4m3fn has no inf (448 + half an
    # ulp and up would be NaN), so clip to the finite range
    q = np.clip(x * inv_NG[..., None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_NG


def quantize_rows_jax(x_NGH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize_rows` on the device, the same bits: only the float8 values and the scales leave it."""
    x = x_NGH.astype(jnp.float32)
    amax_NG = jnp.max(jnp.abs(x), axis=-1)
    scale_NG = jnp.where(amax_NG > 0, amax_NG * _INV_FP8_MAX, jnp.float32(1.0))
    inv_NG = jnp.float32(1.0) / scale_NG
    q = jnp.clip(x * inv_NG[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale_NG


def dequantize_rows(q_NGH: np.ndarray, scale_NG: np.ndarray, dtype) -> np.ndarray:
    """q * s in float32, then cast to `dtype` (what the trainer expects)."""
    x = q_NGH.astype(np.float32) * scale_NG.astype(np.float32)[..., None]
    return x.astype(np.dtype(jnp.dtype(dtype)))
