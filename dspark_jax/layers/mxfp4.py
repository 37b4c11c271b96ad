"""MXFP4 weights as compressed-tensors packs them (docs/architecture.md §1.4).

A weight `W[..., out, in]` is stored as two uint8 tensors:
- `packed[..., out, in/2]`: two E2M1 codes per byte, the LOW nibble is the even column;
- `scales[..., out, in/G]`: one E8M0 exponent per group of G (=32) input columns,
  value `2 ** (s - 127)`.
Decoding is exact in bf16 and f32 (an E2M1 value times a power of two needs <= 2 mantissa bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# nibble code -> value; bit 3 is the sign, so code 8 is negative zero
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E2M1_MAX = 6.0
# root-mean-square of the 16 codes: random-byte MXFP4 weights have std ~ this * 2**(s-127)
E2M1_CODE_RMS = float(np.sqrt(np.mean(E2M1_VALUES.astype(np.float64) ** 2)))


def e8m0_to_f32(scales_u8: jax.Array) -> jax.Array:
    """2 ** (s - 127) built from the exponent bits, so s = 0 (2**-127, an f32 subnormal) and
    s = 255 (2**128 -> inf, the formula taken literally) come out without float arithmetic."""
    s = scales_u8.astype(jnp.int32)
    bits = jnp.where(s == 0, jnp.int32(0x00400000), s << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """E2M1 nibble codes (int32, 0..15) -> float32, built from the bits: sign s, exponent e, mantissa m
    give 2**(e-1) * (1 + m/2) for e > 0 and m/2 for e = 0, i.e. float32 exponent field 126 + e and top
    mantissa bit m (0.5 for e = 0, m = 1). Elementwise integer ops that fuse with the scaling (no
    table gather); the same values as `E2M1_VALUES`, negative zero included."""
    e, m = (codes >> 1) & 3, codes & 1
    bits = jnp.where(e == 0, m * (126 << 23), ((126 + e) << 23) | (m << 22)) | ((codes & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def mxfp4_planes(packed_u8: jax.Array, scales_u8: jax.Array, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """`[..., out, in/2]` codes + `[..., out, in/G]` E8M0 scales -> the even and the odd input columns
    of the weight (`W[..., 0::2]`, `W[..., 1::2]`), each `[..., out, in/2]` in `dtype`.

    The two planes are left apart: a product by W is the sum of the two half-depth products with
    the even and odd columns of the other operand, while interleaving them into one
    `[..., out, in]` array does not fuse on XLA:CPU and costs several times the decode itself
    (`mxfp4_dequantize` does it, for the tests)."""
    *lead, half = packed_u8.shape
    groups = scales_u8.shape[-1]
    if scales_u8.shape[:-1] != tuple(lead) or half % groups:
        raise ValueError(f"MXFP4 packed {packed_u8.shape} and scales {scales_u8.shape} disagree")
    byte = packed_u8.astype(jnp.int32)
    scale = jnp.repeat(e8m0_to_f32(scales_u8), half // groups, axis=-1)      # a group is G/2 bytes
    return tuple((e2m1_to_f32(code) * scale).astype(dtype) for code in (byte & 0x0F, byte >> 4))


@functools.partial(jax.jit, static_argnames="dtype")
def mxfp4_dequantize(packed_u8: jax.Array, scales_u8: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """`[..., out, in/2]` codes + `[..., out, in/G]` E8M0 scales -> `[..., out, in]` in `dtype`."""
    even, odd = mxfp4_planes(packed_u8, scales_u8, dtype)
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])


@functools.partial(jax.jit, static_argnames="group_size")
def mxfp4_quantize(w: jax.Array, group_size: int = 32) -> tuple[jax.Array, jax.Array]:
    """Float `[..., out, in]` -> (packed uint8 `[..., out, in/2]`, E8M0 uint8 `[..., out, in/G]`).

    Per group the exponent is the smallest e with max|w| <= 6 * 2**e (clamped to the E8M0 range),
    and each value rounds to the nearest E2M1 code (ties toward the smaller magnitude). Any tensor
    that `mxfp4_dequantize` can produce round-trips exactly (signed zeros included), because E2M1
    magnitudes stay E2M1 under doubling up to 6. For tests and tiny checkpoints, not a calibrated
    quantiser; NaN/inf are not representable.
    """
    w = jnp.asarray(w, jnp.float32)
    *lead, n_in = w.shape
    if n_in % group_size or group_size % 2:
        raise ValueError(f"input width {n_in} is not a multiple of the group size {group_size}")
    g = w.reshape(*lead, n_in // group_size, group_size)
    amax = jnp.max(jnp.abs(g), axis=-1)
    mant, expo = jnp.frexp(amax)                       # amax = mant * 2**expo, mant in [0.5, 1)
    # amax <= 6 * 2**e  <=>  mant * 2**expo <= 0.75 * 2**(e + 3)
    e = jnp.where(mant <= 0.75, expo - 3, expo - 2)
    e = jnp.where(amax == 0, 0, e)
    e = jnp.clip(e, -127, 127)
    x = jnp.ldexp(jnp.abs(g), -e[..., None])          # exact: a power-of-two rescale
    magnitudes = jnp.asarray(E2M1_VALUES[:8])
    code = jnp.argmin(jnp.abs(x[..., None] - magnitudes), axis=-1).astype(jnp.uint8)
    code = code | jnp.where(jnp.signbit(g), jnp.uint8(8), jnp.uint8(0))
    code = code.reshape(*lead, n_in)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(jnp.uint8), (e + 127).astype(jnp.uint8)
