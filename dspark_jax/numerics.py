"""Products accumulated in float32, in a form every backend runs.

A bf16 GEMM accumulates in float32 (`preferred_element_type`). XLA:CPU on Xeons with AMX /
AVX-512 BF16 has no bf16 x bf16 -> f32 dot in its thunk runtime ("Unsupported element type for
DotThunk::Execute"), while CPUs without them upcast silently: the same program runs on one CPU
and crashes on the next. On CPU the operands are therefore upcast first; bf16 (and fp8) products
are exact in float32 and the sum is float32 either way, so the value is the same computation.
Float64 operands (parity tests under x64) stay float64.

Projections by a bf16 weight (`linear`, `linear_acc`) are the exception, where the host's
XLA:CPU proves it can: it hands a two-dimensional bf16 x bf16 -> f32 product of at least two rows
to a YNNPACK library fusion that reads the bf16 weight as it is (`native_bf16_gemm` compiles a
probe once and looks). There a verify of 8 rows costs about what one row does, while the upcast
form converts every weight on every call (docs/profile.md). The product is accumulated in float32
and rounded once, as torch's bf16 linear is; elsewhere bf16 projections stay bf16 x bf16 -> bf16.
`DSPARK_NATIVE_BF16_GEMM=0` turns the fast form off (`=1` does not force it on).
"""

from __future__ import annotations

import functools
import os

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


@functools.cache
def native_bf16_gemm() -> bool:
    """True when XLA:CPU compiles `[M, I] bf16 x [O, I] bf16 -> f32` (M >= 2) into a YNNPACK fusion
    on the bf16 operands themselves (no convert), for the projection shapes probed here; False off
    CPU, when it would upcast or hand the dot to its thunk runtime, or when disabled by the environment."""
    if not on_cpu() or os.environ.get("DSPARK_NATIVE_BF16_GEMM", "1") == "0":
        return False
    # a square projection, a narrow output (the confidence/rope sizes) and an lm_head-wide one
    for m, i, o in ((2, 64, 64), (3, 576, 8), (2, 576, 49152)):
        x = jax.ShapeDtypeStruct((m, i), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((o, i), jnp.bfloat16)
        text = jax.jit(_gemm_f32).lower(x, w).compile().as_text()
        if "__ynn_fusion" not in text or "convert(" in text:
            return False
    return True


def _gemm_f32(x_MI: jax.Array, w_OI: jax.Array) -> jax.Array:
    return jnp.einsum("mi,oi->mo", x_MI, w_OI, preferred_element_type=jnp.float32)


def _native_bf16_projection(x_XI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """x @ W.T as one 2-D bf16 GEMM with a float32 result; one row is padded to two (XLA:CPU sends a
    single bf16 row to a GEMV that upcasts the whole weight)."""
    lead = x_XI.shape[:-1]
    x_MI = x_XI.reshape(-1, x_XI.shape[-1])
    m = x_MI.shape[0]
    if m == 1:
        x_MI = jnp.concatenate([x_MI, x_MI], axis=0)
    return _gemm_f32(x_MI, w_OI)[:m].reshape(lead + (w_OI.shape[0],))


def linear(x_XI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """x @ W.T for a weight stored [out, in], in W's dtype (x is cast to it first)."""
    x_XI = x_XI.astype(w_OI.dtype)
    if w_OI.dtype == jnp.bfloat16 and native_bf16_gemm():
        return _native_bf16_projection(x_XI, w_OI).astype(jnp.bfloat16)
    return jnp.einsum("...i,oi->...o", x_XI, w_OI)


def linear_acc(x_XI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """x @ W.T for a weight stored [out, in], accumulated and returned in float32 (float64 under
    x64): `einsum_acc` for a projection; x is cast to W's dtype first."""
    x_XI = x_XI.astype(w_OI.dtype)
    if w_OI.dtype == jnp.bfloat16 and native_bf16_gemm():
        return _native_bf16_projection(x_XI, w_OI)
    return einsum_acc("...i,oi->...o", x_XI, w_OI)


# Positions per chunk of `argmax`'s two-level search (8 rows x 49,152 ids: 0.94 -> 0.11 ms; 8 x 4 x
# 49,152: 3.6 -> 0.16 ms; AMD EPYC, 2 cores, AVX-512 BF16, XLA_FLAGS unset, 2026-12-07).
ARGMAX_CHUNK = 512


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32: the first index of the maximum, the same index for every
    row without NaN (XLA:CPU's vector max may skip a NaN, which jnp.argmax ranks above everything;
    a row of NaN logits has no meaningful token either way). XLA:CPU compiles an argmax into a
    scalar loop over (value, index) pairs, about 0.1 ms per 49,152-id row, a few percent of a
    verify step; on CPU the maximum of each chunk of `ARGMAX_CHUNK` ids (a vector reduction) picks
    the first chunk holding the row's maximum, and the argmax runs inside that chunk only."""
    v = x.shape[-1]
    if not on_cpu() or v <= 2 * ARGMAX_CHUNK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    pad = -v % ARGMAX_CHUNK
    if pad:     # -inf past the end: never before a real maximum (ties go to the first index)
        low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=low)
    chunks = x.reshape(x.shape[:-1] + (x.shape[-1] // ARGMAX_CHUNK, ARGMAX_CHUNK))
    first = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(chunks, first[..., None, None], axis=-2)[..., 0, :]
    return (first * ARGMAX_CHUNK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)
