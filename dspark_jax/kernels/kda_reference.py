"""The pure-JAX KDA references the KDA kernels reproduce (docs/architecture.md §1.5.3): `kda_recurrent` (a scan
over tokens: decode / verify, with per-token state snapshots) and `kda_chunked` (the WY-form
chunkwise parallel algorithm: prefill). `layers.kda` computes with them on CPU; the kernels in
this package match them on GPU. Everything said to be fp32 is float64 for float64 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.numerics import acc_dtype


def unit_lower_inverse(lower_CC: jnp.ndarray) -> jnp.ndarray:
    """(I + L)^-1 for strictly lower triangular L [..., C, C], by forward substitution.

    X = (I + L)^-1 - I solves X = -L - L X, and row i of that only reads rows < i of X, so rows are
    final in order: C small sequential steps, the order transformers' reference uses. Compiles small
    and is the fastest option measured on CPU (XLA's triangular_solve was ~1000x slower there).
    """
    c = lower_CC.shape[-1]

    def row(i, x):
        x_i = jax.lax.dynamic_slice_in_dim(x, i, 1, axis=-2)
        return jax.lax.dynamic_update_slice_in_dim(x, x_i + x_i @ x, i, axis=-2)

    return jax.lax.fori_loop(1, c, row, -lower_CC) + jnp.eye(c, dtype=lower_CC.dtype)


def kda_recurrent(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
                  return_snapshots: bool = False):
    """Token-by-token delta rule. q must already be l2-normalised and scaled, k l2-normalised.

    Returns (o [B,T,H,V] f32, final state [B,H,K,V] f32, snapshots [B,T,H,K,V] or None).
    """
    acc = acc_dtype(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)
    xs = tuple(jnp.moveaxis(x.astype(acc), 1, 0)
               for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))

    def step(s_BHKV, x):
        q_BHK, k_BHK, v_BHV, g_BHK, beta_BH = x
        s_BHKV = s_BHKV * jnp.exp(g_BHK)[..., None]
        u_BHV = beta_BH[..., None] * (v_BHV - jnp.einsum("bhk,bhkv->bhv", k_BHK, s_BHKV))
        s_BHKV = s_BHKV + k_BHK[..., None] * u_BHV[..., None, :]
        o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK, s_BHKV)
        return s_BHKV, (o_BHV, s_BHKV if return_snapshots else None)

    final, (o_TBHV, snaps_TBHKV) = jax.lax.scan(step, initial_state_BHKV.astype(acc), xs)
    snaps = jnp.moveaxis(snaps_TBHKV, 0, 1) if return_snapshots else None
    return jnp.moveaxis(o_TBHV, 0, 1), final, snaps


def _segment_sums(g_CK: jnp.ndarray) -> jnp.ndarray:
    """seg[i, j] = sum_{j < m <= i} g_m  [..., C, C, K] (0 on and above the diagonal).

    Summed directly rather than as cumsum_i - cumsum_j: with strong decays the cumulative sums reach
    hundreds and their difference would lose ~|cumsum| * 1e-7 absolutely, which is large relative
    error for a small exponent.
    """
    c = g_CK.shape[-2]
    later = jnp.tril(jnp.ones((c, c), bool), -1)                      # m > j
    return jnp.cumsum(jnp.where(later[:, :, None], g_CK[..., :, None, :], 0.0), axis=-3)


def _suffix_sums(g_CK: jnp.ndarray) -> jnp.ndarray:
    """sum_{m > j} g_m along the chunk axis (exclusive), summed directly for the same reason."""
    rev = jnp.cumsum(g_CK[..., ::-1, :], axis=-2)[..., ::-1, :]
    return jnp.concatenate([rev[..., 1:, :], jnp.zeros_like(rev[..., :1, :])], axis=-2)


def decayed_scores(x_XCK: jnp.ndarray, k_BCK: jnp.ndarray, g_BCK: jnp.ndarray,
                   sub_chunk: int = 16) -> jnp.ndarray:
    """A[i, j] = sum_d x[i,d] k[j,d] exp(sum_{j<m<=i} g[m,d]) for i >= j, 0 above the diagonal.

    k, g (per-token log-decays <= 0): [..., C, K]; x may carry extra leading axes (several left
    operands share the decays). Every such exponent is <= 0, so nothing overflows. Pairs inside one
    sub-chunk use the explicit [sub, sub, K] decay; a pair of sub-chunks a > b factors through the
    boundary after b: exp(decay from that boundary to i) * exp(decay from j to the end of b), both
    factors <= 1, so it is a plain matmul.
    """
    c, dk = k_BCK.shape[-2:]
    sub = min(sub_chunk, c)
    s = c // sub
    x, k, g = (z.reshape(*z.shape[:-2], s, sub, dk) for z in (x_XCK, k_BCK, g_BCK))
    causal = jnp.tril(jnp.ones((sub, sub), bool))
    decay = jnp.exp(jnp.where(causal[:, :, None], _segment_sums(g), -jnp.inf))
    diag = jnp.einsum("...sijk,...sjk->...sij", x[..., :, None, :] * decay, k)
    # decay from the start of sub-chunk a to token i, and over whole sub-chunks strictly between b, a
    prefix = jnp.cumsum(g, axis=-2)                                   # [..., s, sub, K]
    a, b_, m = jnp.arange(s)[:, None, None], jnp.arange(s)[None, :, None], jnp.arange(s)[None, None, :]
    between = jnp.einsum("abm,...mk->...abk", ((b_ < m) & (m < a)).astype(g.dtype), prefix[..., -1, :])
    below = jnp.tril(jnp.ones((s, s), bool), -1)                      # a > b
    left = x[..., :, None, :, :] * jnp.exp(jnp.where(
        below[:, :, None, None], between[..., :, :, None, :] + prefix[..., :, None, :, :], -jnp.inf))
    right = k * jnp.exp(_suffix_sums(g))
    off = jnp.einsum("...abik,...bjk->...aibj", left, right)
    full = off + jnp.einsum("...sij,st->...sitj", diag, jnp.eye(s, dtype=diag.dtype))
    return full.reshape(*full.shape[:-4], c, c)


def kda_chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
                chunk_size: int = 64, return_snapshots: bool = False):
    """Chunkwise-parallel delta rule (WY form), equal to `kda_recurrent` up to fp32 rounding.

    Within a chunk of C tokens (gc = cumulative g, D[i,j] = exp(gc_i - gc_j) for i >= j):
      L = strict_lower(sum_d beta_i k_i D_ij k_j),  Tm = (I + L)^-1
      U = Tm (beta v),  W = Tm (beta k exp(gc)),  Vn = U - W S          (per-token "new values")
      o = (q exp(gc)) S + causal(sum_d q_i D_ij k_j) Vn
      S <- exp(gc_last) S + (k exp(gc_last - gc))^T Vn
    Every exponent is <= 0, so nothing overflows however strong the decay, and every gc_i - gc_j is
    summed directly over the tokens between (see `_segment_sums`). T is padded to a multiple of C
    with g = beta = 0 tokens, which leave the state untouched. C (a power of two) shrinks to the
    next power of two >= T for short inputs.
    Same signature and returns as `kda_recurrent`.
    """
    b, t = k_BTHK.shape[:2]
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size {chunk_size} must be a power of two")
    c = min(chunk_size, 1 << (t - 1).bit_length())
    pad = (-t) % c
    n = (t + pad) // c
    acc = acc_dtype(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)

    def to_chunks(x):  # [B,T,H,...] -> [N,B,H,C,...]
        x = jnp.pad(x.astype(acc), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    xs = tuple(to_chunks(x) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    causal_CC = jnp.tril(jnp.ones((c, c), bool))
    strict_CC = jnp.tril(jnp.ones((c, c), bool), -1)

    def step(s_BHKV, x):
        q, k, v, g, beta_BHC = x                                   # [B,H,C,K] / [B,H,C]
        gc = jnp.cumsum(g, axis=-2)
        kb = k * beta_BHC[..., None]
        kk_BHCC, qk_BHCC = decayed_scores(jnp.stack([kb, q]), k, g)
        t_inv = unit_lower_inverse(kk_BHCC * strict_CC)
        u = t_inv @ (v * beta_BHC[..., None])
        w = t_inv @ (kb * jnp.exp(gc))
        v_new = u - w @ s_BHKV
        o = jnp.einsum("bhik,bhkv->bhiv", q * jnp.exp(gc), s_BHKV) + qk_BHCC @ v_new
        s_new = (s_BHKV * jnp.exp(gc[..., -1, :])[..., None]
                 + jnp.einsum("bhjk,bhjv->bhkv", k * jnp.exp(_suffix_sums(g)), v_new))
        snaps = None
        if return_snapshots:  # the same update truncated after every token i of the chunk
            decay = jnp.exp(jnp.where(causal_CC[:, :, None], _segment_sums(g), -jnp.inf))
            snaps = (jnp.exp(gc)[..., None] * s_BHKV[:, :, None]
                     + jnp.einsum("bhijk,bhjk,bhjv->bhikv", decay, k, v_new))
        return s_new, (o, snaps)

    final, (o_NBHCV, snaps_NBHCKV) = jax.lax.scan(step, initial_state_BHKV.astype(acc), xs)

    def from_chunks(x):  # [N,B,H,C,...] -> [B,T,H,...]
        x = jnp.moveaxis(jnp.moveaxis(x, 3, 2), 0, 1)
        return x.reshape(b, n * c, *x.shape[3:])[:, :t]

    snaps = from_chunks(snaps_NBHCKV) if return_snapshots else None
    return from_chunks(o_NBHCV), final, snaps


# ---------------------------------------------------------------------------------------------
# The layer
