"""Softmax attention over the paged pool, key chunk by key chunk, as far as the longest query reads.

A gather of a sequence's whole block table makes every step cost `max_len` keys, and a gather cut
to a span bucket of the longest row makes a program per bucket; here the keys are read in chunks of
`key_chunk()` positions inside a loop whose trip count is computed from the queries' positions, with
an online softmax (running max, denominator and weighted sum in float32, normalised once at the
end), so one program serves every length and costs what the longest row holds.

The callers give the scores and the weighted sum of values for one chunk of rows (GQA's per-head
keys and values, MLA's latent rows), so the loop, the visibility mask and the softmax are written
once. Queries see key j iff j < their limit (`limits_BT`, exclusive) and, with a sliding window,
j >= their start (`starts_BT`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# Key positions per loop trip, on CPU: on a 2-core AMD EPYC (AVX-512 BF16, XLA_FLAGS unset;
# 2026-12-06), demo pair at --max_model_len 8192, a step took the time of one-piece gathers over a
# power-of-two span at short lengths and 0.41-0.69x of it at 3,000 tokens over 8 rows
# (docs/benchmarks.md). Against 64 and 256 (8 rows, medians of two alternating rounds): 64 was
# slower from 450 tokens on; 256 was 10-16 % faster at 3,000 tokens and up to 8 % slower at 40.
KEY_CHUNK = 128
# Elsewhere (GPU): not measured. A GPU pays a launch per kernel per trip, so trips are kept few:
# a context of up to 2,048 keys is read in one trip; the paged MLA kernel, whose own loop follows
# the lengths, takes over from `kernels.mla_paged.AUTO_MIN_KEYS` keys in `auto` mode.
KEY_CHUNK_GPU = 2048


def key_chunk() -> int:
    """Key positions per trip on the default backend."""
    return KEY_CHUNK if jax.default_backend() == "cpu" else KEY_CHUNK_GPU


_MASKED = float(jnp.finfo(jnp.float32).min)


def paged_attention(pool, row, dtype, width: int, limits_BT: jax.Array,
                    scores: Callable[[jax.Array], jax.Array],
                    values: Callable[[jax.Array, jax.Array], jax.Array], *,
                    chunk: int | None = None, starts_BT: jax.Array | None = None) -> jax.Array:
    """softmax(scores) @ values over the pool rows of `row` (`cache.PagedPool`) at positions below
    each query's limit (and from `starts_BT` on, when given: a sliding window). `scores(kv_BCW)`:
    float32 (float64 under x64) scores [B, ..., T, C] of the queries against one chunk's rows
    (read in `dtype`, `width` wide); `values(p, kv_BCW)`: the weighted sum [B, ..., T, V] of its
    values under weights `p` (the scores' layout, in `dtype`).
    Returns the normalised output [B, ..., T, V] in the scores' dtype; a query that sees no key
    gives zeros."""
    b, t = limits_BT.shape
    chunk = max((chunk or key_chunk()) // pool.page_size, 1) * pool.page_size
    probe = jax.ShapeDtypeStruct((b, chunk, width), dtype)
    s_out = jax.eval_shape(scores, probe)                    # [B, ..., T, C], float32 (float64 under x64)
    s_shape, acc = s_out.shape, s_out.dtype
    v_shape = jax.eval_shape(values, jax.ShapeDtypeStruct(s_shape, dtype), probe).shape
    against = (b,) + (1,) * (len(s_shape) - 3) + (t, 1)                 # against [B, ..., T, C]
    lim = limits_BT.reshape(against)
    first = None if starts_BT is None else starts_BT.reshape(against)

    def body(carry, kv_BCW, start):
        m_prev, l_prev, acc_prev = carry
        keys_C = start + jnp.arange(chunk, dtype=jnp.int32)
        vis = keys_C < lim if first is None else (keys_C < lim) & (keys_C >= first)
        s = jnp.where(vis, scores(kv_BCW), _MASKED)
        m_new = jnp.maximum(m_prev, s.max(-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m_prev - m_new)
        out = acc_prev * corr[..., None] + values(p.astype(dtype), kv_BCW).astype(acc)
        return m_new, l_prev * corr + p.sum(-1), out

    init = (jnp.full(s_shape[:-1], _MASKED, acc), jnp.zeros(s_shape[:-1], acc), jnp.zeros(v_shape, acc))
    _, l, acc = pool.fold_keys(row, dtype, width, jnp.max(limits_BT), chunk, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]
