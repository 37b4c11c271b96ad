"""The pure-JAX MLA attention references the MLA kernels reproduce (docs/architecture.md §1.5.1, §3.3): dense
masked softmax attention over latent rows `[c_kv | k_pe]`, in the expanded form (keys and values
lifted per head) and the absorbed form (W_UK folded into the queries, W_UV applied last). Scores
and softmax accumulate in fp32 (float64 for float64 inputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.numerics import acc_dtype, einsum_acc

_MASKED = -1e30  # finite, so a fully masked row gives exp(0) (then zeroed), never inf - inf


def masked_softmax(scores: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """fp32 (float64 for float64 scores) softmax over the last axis restricted to `mask`; fully
    masked rows give all zeros."""
    s = jnp.where(mask, scores.astype(acc_dtype(scores)), _MASKED)
    s_max = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.where(mask, jnp.exp(s - s_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(denom > 0, denom, 1.0)


def mla_attend_expanded(q_nope_BTNH: jnp.ndarray, q_rope_BTNR: jnp.ndarray, kv_BSL: jnp.ndarray,
                        mask_BTS: jnp.ndarray, w_uk_NHC: jnp.ndarray, w_uv_NVC: jnp.ndarray,
                        scale: float) -> jnp.ndarray:
    """Attention with per-head keys/values expanded from the latent rows -> o [B,T,N,V]."""
    C = w_uk_NHC.shape[-1]
    c_kv_BSC, k_pe_BSR = kv_BSL[..., :C], kv_BSL[..., C:]
    k_nope_BSNH = jnp.einsum("bsc,nhc->bsnh", c_kv_BSC, w_uk_NHC)
    v_BSNV = jnp.einsum("bsc,nvc->bsnv", c_kv_BSC, w_uv_NVC)
    scores_BNTS = (einsum_acc("btnh,bsnh->bnts", q_nope_BTNH, k_nope_BSNH)
                   + einsum_acc("btnr,bsr->bnts", q_rope_BTNR, k_pe_BSR))
    p_BNTS = masked_softmax(scores_BNTS * scale, mask_BTS[:, None])
    o_BTNV = einsum_acc("bnts,bsnv->btnv", p_BNTS.astype(v_BSNV.dtype), v_BSNV)
    return o_BTNV.astype(q_nope_BTNH.dtype)


def mla_scores_absorbed(q_lat_BTNC: jnp.ndarray, q_rope_BTNR: jnp.ndarray, kv_BSL: jnp.ndarray,
                        scale: float) -> jnp.ndarray:
    """fp32 scaled scores [B,N,T,S] of latent-space queries against latent rows
    (q_lat·c_kv + q_rope·k_pe): the reference a decode kernel reproduces."""
    C = q_lat_BTNC.shape[-1]
    s = (einsum_acc("btnc,bsc->bnts", q_lat_BTNC, kv_BSL[..., :C])
         + einsum_acc("btnr,bsr->bnts", q_rope_BTNR, kv_BSL[..., C:]))
    return s * scale


def mla_attend_absorbed(q_nope_BTNH: jnp.ndarray, q_rope_BTNR: jnp.ndarray, kv_BSL: jnp.ndarray,
                        mask_BTS: jnp.ndarray, w_uk_NHC: jnp.ndarray, w_uv_NVC: jnp.ndarray,
                        scale: float) -> jnp.ndarray:
    """The same attention with W_UK folded into q and W_UV applied last -> o [B,T,N,V]."""
    C = w_uk_NHC.shape[-1]
    q_lat_BTNC = einsum_acc("btnh,nhc->btnc", q_nope_BTNH, w_uk_NHC).astype(kv_BSL.dtype)
    p_BNTS = masked_softmax(mla_scores_absorbed(q_lat_BTNC, q_rope_BTNR, kv_BSL, scale), mask_BTS[:, None])
    o_lat_BTNC = einsum_acc("bnts,bsc->btnc", p_BNTS.astype(kv_BSL.dtype), kv_BSL[..., :C])
    o_BTNV = einsum_acc("btnc,nvc->btnv", o_lat_BTNC.astype(w_uv_NVC.dtype), w_uv_NVC)
    return o_BTNV.astype(q_nope_BTNH.dtype)
