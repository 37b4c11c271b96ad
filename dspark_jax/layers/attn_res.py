"""Block Attention Residuals mixer (Kimi-K3, docs/architecture.md §1.5.2).

Each layer reads a softmax mixture of the banked block sums and the running partial sum
(`prefix`) instead of a plain residual stream. Which sums are banked when is the decoder
layer's business; this module only mixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.numerics import acc_dtype


def _rms_normalize_scaled(v: jax.Array, eps: float) -> jax.Array:
    """`v * rsqrt(mean(v^2) + eps)` over the last axis in fp32 without overflow.

    Block sums can approach the bf16 (= f32) range, where `v*v` overflows. Each row is first
    rescaled by the power of two 2**-e that brings its max-abs into [0.5, 1):
    `v*rsqrt(mean(v^2)+eps) == (v*2^-e) * rsqrt(mean((v*2^-e)^2) + eps*2^-2e)`. A power-of-two
    rescale is exact, so wherever the naive form does not overflow both give the same bits.
    """
    _, e = jnp.frexp(jnp.max(jnp.abs(v), axis=-1, keepdims=True))    # all-zero row: e = 0
    vs = jnp.ldexp(v, -e)
    # eps * 2**-2e: underflows to 0 for huge rows (eps irrelevant there) and overflows to inf for
    # rows below ~1e-19, whose normalised value (~v/sqrt(eps) < 1e-17) then reads as 0.
    eps_s = jnp.ldexp(jnp.asarray(eps, v.dtype), -2 * e)
    return vs * jax.lax.rsqrt(jnp.mean(vs * vs, axis=-1, keepdims=True) + eps_s)


def attn_res(prefix_BTH: jax.Array, blocks_BTnH: jax.Array, proj_w_1H: jax.Array, norm_w_H: jax.Array,
             eps: float = 1e-5) -> jax.Array:
    """Softmax-mix the candidates `[*blocks, prefix]` (prefix LAST) per token.

    prefix_BTH: `[..., H]` running partial sum; blocks_BTnH: `[..., n, H]` banked sums (n may be 0:
    the prefix is returned unchanged); proj_w_1H: `[1, H]` score projection; norm_w_H: `[H]` weight
    of the RMSNorm applied to each candidate before scoring. All arithmetic in fp32 (float64 for
    float64 inputs); the mixture of the RAW candidates is cast to the prefix dtype.
    """
    if blocks_BTnH.shape[-2] == 0:
        return prefix_BTH
    if blocks_BTnH.shape[:-2] != prefix_BTH.shape[:-1] or blocks_BTnH.shape[-1] != prefix_BTH.shape[-1]:
        raise ValueError(f"attn_res: blocks {blocks_BTnH.shape} do not match prefix {prefix_BTH.shape}")
    acc = acc_dtype(prefix_BTH, blocks_BTnH)
    v_BTcH = jnp.concatenate([blocks_BTnH.astype(acc), prefix_BTH.astype(acc)[..., None, :]], axis=-2)
    w_H = norm_w_H.astype(acc) * proj_w_1H[0].astype(acc)
    # elementwise products + sums (not einsum): fp32 exactly, whatever the backend's matmul precision
    score_BTc = jnp.sum(_rms_normalize_scaled(v_BTcH, eps) * w_H, axis=-1)
    p_BTc = jax.nn.softmax(score_BTc, axis=-1)
    return jnp.sum(p_BTc[..., None] * v_BTcH, axis=-2).astype(prefix_BTH.dtype)
