"""Softmax attention over the paged pool, in tiles of queries and chunks of keys, each query tile
reading keys only as far as its own rows reach.

A gather of a sequence's whole block table makes every step cost `max_len` keys, and a gather cut
to a span bucket of the longest row makes a program per bucket; here the keys are read in chunks of
`key_chunk()` positions inside a loop whose trip count is computed from the queries' positions, with
an online softmax (running max, denominator and weighted sum in float32, normalised once at the
end), so one program serves every length and costs what the rows hold.

A prefill's queries go in tiles of `query_tile()` rows (a loop over tiles): each tile reads the
key chunks below its own largest limit, so a causal prompt costs the lower triangle and no more
(about half the square, the tiles' diagonal blocks aside), and a tile of padding rows reads
nothing; the chunks every row of a tile sees whole run without the visibility mask. A tile's
scores stay small enough for the CPU's caches: one pass over [T, chunk] scores of a whole long
prompt, chunk after chunk, would run at memory speed (a 2,048-token prefill spent 70 % of its time
in the masking and exponentials of such passes, docs/profile.md).

The callers give the scores and the weighted sum of values for one query tile against one chunk
of rows (GQA's per-head keys and values, MLA's latent rows), so the loops, the visibility mask and
the softmax are written once. Queries see key j iff j < their limit (`limits_BT`, exclusive) and,
with a sliding window, j >= their start (`starts_BT`).
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
# Query rows per tile of a long call (a prefill chunk) on CPU; fewer rows are one tile.
QUERY_TILE = 256
# Elsewhere (GPU): not measured; as many rows as a GPU key trip reads keys.
QUERY_TILE_GPU = 2048


def key_chunk() -> int:
    """Key positions per trip on the default backend."""
    return KEY_CHUNK if jax.default_backend() == "cpu" else KEY_CHUNK_GPU


def query_tile() -> int:
    """Query rows per tile on the default backend."""
    return QUERY_TILE if jax.default_backend() == "cpu" else QUERY_TILE_GPU


_MASKED = float(jnp.finfo(jnp.float32).min)


def paged_attention(pool, row, dtype, width: int, limits_BT: jax.Array, queries: tuple,
                    scores: Callable[[tuple, jax.Array], jax.Array],
                    values: Callable[[jax.Array, jax.Array], jax.Array], *,
                    chunk: int | None = None, q_tile: int | None = None,
                    starts_BT: jax.Array | None = None) -> jax.Array:
    """softmax(scores) @ values over the pool rows of `row` (`cache.PagedPool`) at positions below
    each query's limit (and from `starts_BT` on, when given: a sliding window). `queries`: arrays [B, ..., T, X] (the query axis second to last), cut into
    tiles of `q_tile` rows (None: `query_tile()`). `scores(q, kv_BCW)`: float32 (float64 under x64)
    scores [B, ..., t, C] of one tile's queries `q` (`queries` cut to t rows) against one chunk's
    rows (read in `dtype`, `width` wide), already scaled; `values(p, kv_BCW)`: the weighted sum
    [B, ..., t, V] of its values under weights `p` (the scores' layout, in `dtype`). Returns the
    normalised output [B, ..., T, V] in the scores' dtype; a query that sees no key gives zeros."""
    b, t = limits_BT.shape
    chunk = max((chunk or key_chunk()) // pool.page_size, 1) * pool.page_size
    tile = min(q_tile or query_tile(), t)
    tiles = -(-t // tile)
    if tiles == 1:
        return _attend_tile(pool, row, dtype, width, limits_BT, starts_BT, queries, scores, values, chunk)
    pad = tiles * tile - t
    if pad:     # rows past T: limit 0, they read nothing
        limits_BT = jnp.pad(limits_BT, ((0, 0), (0, pad)))
        if starts_BT is not None:
            starts_BT = jnp.pad(starts_BT, ((0, 0), (0, pad)))
        queries = tuple(jnp.pad(q, [(0, 0)] * (q.ndim - 2) + [(0, pad), (0, 0)]) for q in queries)

    def one(i):
        qs = tuple(jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=q.ndim - 2) for q in queries)
        lim = jax.lax.dynamic_slice_in_dim(limits_BT, i * tile, tile, axis=1)
        first = None if starts_BT is None else jax.lax.dynamic_slice_in_dim(starts_BT, i * tile, tile, axis=1)
        return _attend_tile(pool, row, dtype, width, lim, first, qs, scores, values, chunk)

    out_N = jax.lax.map(one, jnp.arange(tiles))                     # [tiles, B, ..., tile, V]
    out = jnp.moveaxis(out_N, 0, -3)                                # [B, ..., tiles, tile, V]
    out = out.reshape(out.shape[:-3] + (tiles * tile, out.shape[-1]))
    return out[..., :t, :]


def _attend_tile(pool, row, dtype, width, limits_BT, starts_BT, queries, scores, values, chunk):
    """One tile's queries over the key chunks below its largest limit: first the chunks each of its
    rows that sees a key sees whole (no mask), then the rest up to the largest limit, masked. With
    a sliding window (`starts_BT`), every chunk from the earliest row's start on is masked."""
    b, t = limits_BT.shape
    probe = jax.ShapeDtypeStruct((b, chunk, width), dtype)
    s_out = jax.eval_shape(scores, queries, probe)           # [B, ..., T, C], float32 (float64 under x64)
    s_shape, acc = s_out.shape, s_out.dtype
    v_shape = jax.eval_shape(values, jax.ShapeDtypeStruct(s_shape, dtype), probe).shape
    against = (b,) + (1,) * (len(s_shape) - 3) + (t, 1)                 # against [B, ..., T, C]
    lim = limits_BT.reshape(against)
    first = None if starts_BT is None else starts_BT.reshape(against)

    def body(masked: bool):
        def step(carry, kv_BCW, start):
            m_prev, l_prev, acc_prev = carry
            s = scores(queries, kv_BCW)
            if masked:
                keys_C = start + jnp.arange(chunk, dtype=jnp.int32)
                vis = keys_C < lim if first is None else (keys_C < lim) & (keys_C >= first)
                s = jnp.where(vis, s, _MASKED)
            m_new = jnp.maximum(m_prev, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            if masked:
                p = jnp.where(vis, p, 0.0)
            corr = jnp.exp(m_prev - m_new)
            out = acc_prev * corr[..., None] + values(p.astype(dtype), kv_BCW).astype(acc)
            return m_new, l_prev * corr + p.sum(-1), out
        return step

    init = (jnp.full(s_shape[:-1], _MASKED, acc), jnp.zeros(s_shape[:-1], acc), jnp.zeros(v_shape, acc))
    sees = limits_BT > 0
    if starts_BT is not None:       # a window: masked from the earliest seeing row's first key
        lo = jnp.min(jnp.where(sees, jnp.maximum(starts_BT, 0), pool.max_len)) // chunk * chunk
        lo = jnp.where(sees.any(), lo, 0)
        _, l, out = pool.fold_keys(row, dtype, width, jnp.max(limits_BT), chunk, body(True), init, start=lo)
        out = out / jnp.where(l > 0, l, 1.0)[..., None]
        return jnp.where(lim > 0, out, 0.0)
    # keys below every seeing row's limit, in whole chunks (rows that see nothing are zeroed below)
    whole = jnp.min(jnp.where(sees, limits_BT, pool.max_len)) // chunk * chunk
    whole = jnp.where(sees.any(), whole, 0)
    carry = pool.fold_keys(row, dtype, width, whole, chunk, body(False), init)
    _, l, out = pool.fold_keys(row, dtype, width, jnp.max(limits_BT), chunk, body(True), carry, start=whole)
    out = out / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(lim > 0, out, 0.0)
