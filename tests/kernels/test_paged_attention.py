"""Attention over the paged pool read chunk by chunk (`kernels.paged_attention`): the same numbers as
one softmax over the whole gathered table, in float64; the chunks past the longest query are never
read; one compiled program serves every length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.cache import PagedPool
from dspark_jax.kernels.mla_paged import mla_paged_chunked, mla_paged_reference
from dspark_jax.kernels import paged_attention
from dspark_jax.models.llama import gqa_attention, gqa_paged_attention
from tests.float64 import assert_close, assert_f32_close, x64

PAGE, PAGES_PER_SEQ = 4, 12          # 48 positions per sequence


def _pool(rng, width: int, batch: int, rows: int = 2) -> PagedPool:
    """A pool whose pages are shuffled across sequences (the table is not the identity)."""
    n = batch * PAGES_PER_SEQ
    table = rng.permutation(n).reshape(batch, PAGES_PER_SEQ).astype(np.int32)
    pages = rng.standard_normal((rows, n, PAGE, width))
    return PagedPool(jnp.asarray(pages), jnp.asarray(table))


@pytest.mark.parametrize("chunk", [4, 8, 20, 48, 64])
def test_gqa_chunks_match_one_softmax(chunk, monkeypatch):
    """Queries at ragged positions (one verify block of 3 per row; 2 kv heads for 6 query heads):
    chunks of 1, 2, 5 (not a divisor of the table), 12 and 16 pages against the whole gathered
    table with a causal mask."""
    rng = np.random.default_rng(0)
    b, t, n, k, h = 3, 3, 6, 2, 8
    with x64():
        pool = _pool(rng, 2 * k * h, b)
        q = jnp.asarray(rng.standard_normal((b, t, n, h)))
        positions = jnp.asarray(np.array([[0], [17], [44]]) + np.arange(t), jnp.int32)
        kv = pool.read(1, jnp.float64).reshape(b, -1, k, 2 * h)
        mask = jnp.arange(pool.max_len)[None, None] <= positions[:, :, None]
        want = gqa_attention(q, kv[..., :h], kv[..., h:], mask)
        monkeypatch.setattr(paged_attention, "KEY_CHUNK", chunk)
        got = gqa_paged_attention(q, pool, 1, k, positions)
        assert got.dtype == jnp.float64
        assert_close(got, want, f"chunk {chunk}")


@pytest.mark.parametrize("causal", [True, False])
def test_mla_chunks_match_the_reference(causal):
    """The latent MLA path (the draft's block attention when causal=False) against
    `mla_paged_reference`, with a query row that sees nothing (zeros on both sides)."""
    rng = np.random.default_rng(1)
    b, t, n, c, r = 2, 4, 3, 16, 8
    with x64():
        pool = _pool(rng, c + r + 8, b, rows=3)          # rows wider than the latent: the draft's case
        q_lat = jnp.asarray(rng.standard_normal((b, t, n, c)))
        q_rope = jnp.asarray(rng.standard_normal((b, t, n, r)))
        positions = jnp.asarray(np.array([[9], [30]]) + np.arange(t), jnp.int32)
        for chunk in (8, 16, 44):
            got = mla_paged_chunked(q_lat, q_rope, pool.pages, pool.block_table, positions, 0.3,
                                    causal=causal, row=2, chunk=chunk)
            want = mla_paged_reference(q_lat, q_rope, pool.pages, pool.block_table, positions, 0.3,
                                       causal=causal, row=2)
            assert_close(got, want, f"chunk {chunk}, causal={causal}")
        nothing = jnp.full((b, t), -1, jnp.int32)             # limit 0 when causal: no key visible
        if causal:
            got = mla_paged_chunked(q_lat, q_rope, pool.pages, pool.block_table, nothing, 0.3, causal=True, row=2)
            assert not np.asarray(got).any()


@pytest.mark.parametrize("tile,chunk", [(6, 8), (16, 4), (5, 20)])
def test_query_tiles_match_one_softmax(tile, chunk, monkeypatch):
    """Prefill-shaped calls: 20 queries per row at offsets 0 and 9 (a later chunk of a prompt over
    the rows before it), in tiles of 6 (the last one padded), 16 and 5 rows over key chunks of 2,
    1 and 5 pages, each tile's first chunks unmasked; against one softmax over the gathered table.
    The last rows of the second sequence are padding (not valid): they give zeros."""
    rng = np.random.default_rng(4)
    b, t, n, k, h = 2, 20, 6, 2, 8
    with x64():
        pool = _pool(rng, 2 * k * h, b)
        q = jnp.asarray(rng.standard_normal((b, t, n, h)))
        positions = jnp.asarray(np.array([[0], [9]]) + np.arange(t), jnp.int32)
        valid = jnp.asarray(np.arange(t)[None] < np.array([[t], [13]]))
        kv = pool.read(1, jnp.float64).reshape(b, -1, k, 2 * h)
        mask = jnp.arange(pool.max_len)[None, None] <= positions[:, :, None]
        want = jnp.where(valid[..., None, None], gqa_attention(q, kv[..., :h], kv[..., h:], mask), 0.0)
        monkeypatch.setattr(paged_attention, "KEY_CHUNK", chunk)
        monkeypatch.setattr(paged_attention, "QUERY_TILE", tile)
        got = gqa_paged_attention(q, pool, 1, k, positions, valid)
        assert_close(got, want, f"tiles of {tile}, chunks of {chunk}")
        mla = dict(q_lat=jnp.asarray(rng.standard_normal((b, t, 3, 16))),
                   q_rope=jnp.asarray(rng.standard_normal((b, t, 3, 8))))
        pool3 = _pool(rng, 24, b, rows=1)
        got = mla_paged_chunked(mla["q_lat"], mla["q_rope"], pool3.pages, pool3.block_table, positions, 0.3,
                                causal=True, row=0, chunk=chunk)
        want = mla_paged_reference(mla["q_lat"], mla["q_rope"], pool3.pages, pool3.block_table, positions, 0.3,
                                   causal=True, row=0)
        assert_close(got, want, f"MLA, tiles of {tile}, chunks of {chunk}")


def test_chunks_past_the_longest_query_are_not_read(monkeypatch):
    """NaN in every page past the chunk holding the last visible key: a chunk read there would make
    the output NaN (0 x NaN in the weighted sum), so a finite result equal to the reference's over
    the clean pool shows the loop stopped at the longest query."""
    rng = np.random.default_rng(2)
    b, t, n, k, h = 2, 1, 2, 1, 4
    with x64():
        pool = _pool(rng, 2 * k * h, b)
        positions = jnp.asarray([[5], [13]], jnp.int32)          # 14 keys: chunks of 8 read 0..15
        q = jnp.asarray(rng.standard_normal((b, t, n, h)))
        want = gqa_paged_attention(q, pool, 0, k, positions)
        table = np.asarray(pool.block_table)
        pages = np.array(pool.pages)
        pages[:, table[:, 16 // PAGE:]] = np.nan                 # logical pages 4.. of both sequences
        poisoned = pool._replace(pages=jnp.asarray(pages))
        monkeypatch.setattr(paged_attention, "KEY_CHUNK", 8)
        got = gqa_paged_attention(q, poisoned, 0, k, positions)
        assert np.isfinite(np.asarray(got)).all()
        assert_close(got, want, "pages past the longest query poisoned")
        # three positions further the loop reads a poisoned chunk: the check can fail
        later = gqa_paged_attention(q, poisoned, 0, k, positions + 3)
        assert np.isnan(np.asarray(later)).any()


def test_one_program_for_every_length():
    """The trip count is data: positions from 0 to the last one run one compiled program, and its
    result follows the positions (a jitted call per length against the reference)."""
    rng = np.random.default_rng(3)
    b, n, k, h = 2, 4, 2, 8
    pool = _pool(rng, 2 * k * h, b)
    pool = pool._replace(pages=pool.pages.astype(jnp.float32))
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), jnp.float32)
    fn = jax.jit(lambda q, pool, pos: gqa_paged_attention(q, pool, 1, k, pos))
    for last in (0, 7, 31, 47):
        pos = jnp.asarray([[last // 2], [last]], jnp.int32)
        kv = pool.read(1, jnp.float32).reshape(b, -1, k, 2 * h)
        mask = jnp.arange(pool.max_len)[None, None] <= pos[:, :, None]
        want = gqa_attention(q, kv[..., :h], kv[..., h:], mask)
        assert_f32_close(fn(q, pool, pos), want, f"last position {last}")
    assert fn._cache_size() == 1
