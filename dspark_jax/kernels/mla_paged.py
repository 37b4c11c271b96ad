"""MLA latent attention read straight from the paged pool (absorbed form; docs/architecture.md §5.3/§5.4).

Queries are latent (`q_lat = q_nope @ W_UK`, [B,T,N,C]) plus rope parts [B,T,N,R]; keys and
values are the pool's `[c_kv (C) | k_pe (R)]` rows of one pool row index, addressed through the
block table. Every head reads the same rows (MQA in latent space), so the kernel stacks the
T x N query rows of a sequence into one tile and reads each key tile once for all of them.
The output is the latent context [B,T,N,C]; the caller applies W_UV.

Visibility (`key_limits`): key position j is visible to query row (b, t) iff j < limit[b, t]:
- causal (verify: T+1 rows at positions lens..lens+T): limit = position + 1;
- block (draft block: T rows at anchor..anchor+T-1, written into the pool before the call, every
  row sees the context and the whole block): limit = last block position + 1 for every row.

Kernel: grid (batch, query-row tile, kv split). Each program walks its share of key tiles up to
the tile's largest limit, one `block_k`-row slice of one page at a time (the physical page comes
from the block table; fp8 storage is dequantised on load), with an online softmax; splits are
merged afterwards (flash-decoding), so a long context keeps the GPU busy at batch 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dspark_jax.cache import FP8, FP8_SCALE, PagedPool
from dspark_jax.kernels import common
from dspark_jax.kernels.common import NEG, cdiv, check_pow2, compiler_params, mm, mm_nt, pad_to, round_up
from dspark_jax.kernels.mla_reference import masked_softmax, mla_scores_absorbed
from dspark_jax.kernels.paged_attention import paged_attention
from dspark_jax.numerics import acc_dtype, einsum_acc, on_cpu

# `auto` dispatch (kernels.dispatch) runs this kernel only from this many keys per sequence (the
# block table's pages x page size: the engine passes whole tables, so the server's max_model_len):
# below it XLA's fusion of the reference is faster. Measured on one H200 (README "Kernels",
# 2026-11-30, 8 query rows, against the reference gathering the whole table in one piece): the
# kernel took 1.23x the reference at 4k keys (B1, 96 heads, bf16 cache) and 1.81x at 2k (B8, 96
# heads, fp8), and 0.77x at 32k (B1, 12 heads, fp8); nothing was measured in between, so the
# kernel starts at the smallest span where it was measured faster. `python -m
# benchmarks.gpu_kernel_check --crossover` measures the crossover on a GPU and prints the value to
# set; override with $DSPARK_MLA_PAGED_MIN_KEYS or `dispatch.mla_paged_min_keys_override(n)`.
AUTO_MIN_KEYS = 32768


def key_limits(positions_BT: jax.Array, causal: bool, max_len: int) -> jax.Array:
    """Exclusive key-position limit per query row, int32 [B,T] (see the module docstring)."""
    pos = positions_BT.astype(jnp.int32)
    if causal:
        lim = pos + 1
    else:
        lim = jnp.broadcast_to(jnp.max(pos, axis=1, keepdims=True) + 1, pos.shape)
    return jnp.clip(lim, 0, max_len)


def _pool(pages: jax.Array, block_table_BP: jax.Array, row: int | None) -> tuple[PagedPool, int]:
    if row is None:
        if pages.ndim != 3:
            raise ValueError(f"pages {pages.shape}: pass row= for a [rows, pages, page, width] pool")
        return PagedPool(pages[None], block_table_BP), 0
    return PagedPool(pages, block_table_BP), row


def mla_paged_reference(q_lat_BTNC: jax.Array, q_rope_BTNR: jax.Array, pages: jax.Array,
                        block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                        causal: bool, row: int | None = None) -> jax.Array:
    """Gather the logical cache with `PagedPool.read`, then the absorbed-form pieces of mla_reference.

    pages: one pool row [P, page, C+R], or the whole pool [rows, P, page, C+R] with `row`.
    Returns the latent context [B,T,N,C] in q_lat's dtype (fully masked rows give 0)."""
    pool, r = _pool(pages, block_table_BP, row)
    c = q_lat_BTNC.shape[-1]
    kv_BSL = pool.read(r, q_lat_BTNC.dtype, c + q_rope_BTNR.shape[-1])
    lim_BT = key_limits(positions_BT, causal, kv_BSL.shape[1])
    mask_BTS = jnp.arange(kv_BSL.shape[1])[None, None, :] < lim_BT[..., None]
    scores_BNTS = mla_scores_absorbed(q_lat_BTNC, q_rope_BTNR.astype(kv_BSL.dtype), kv_BSL, scale)
    p_BNTS = masked_softmax(scores_BNTS, mask_BTS[:, None])
    o_BTNC = einsum_acc("bnts,bsc->btnc", p_BNTS.astype(kv_BSL.dtype), kv_BSL[..., :c])
    return o_BTNC.astype(q_lat_BTNC.dtype)


def mla_paged_chunked(q_lat_BTNC: jax.Array, q_rope_BTNR: jax.Array, pages: jax.Array,
                      block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                      causal: bool, row: int | None = None, chunk: int | None = None) -> jax.Array:
    """`mla_paged_reference` read key chunk by key chunk up to the largest limit
    (`kernels.paged_attention`, `chunk` keys a trip; None: its default): what runs where the kernel
    does not, at a cost that follows the positions rather than the block table's width."""
    pool, r = _pool(pages, block_table_BP, row)
    c, dtype = q_lat_BTNC.shape[-1], q_lat_BTNC.dtype
    queries = (q_lat_BTNC.transpose(0, 2, 1, 3), q_rope_BTNR.astype(dtype).transpose(0, 2, 1, 3))   # [B,N,T,*]
    if on_cpu():     # einsum_acc would upcast them for every key chunk: once here
        queries = tuple(q.astype(acc_dtype(q)) for q in queries)

    def scores(qs, kv_BCL):
        q_lat_BNTC, q_rope_BNTR = qs
        s = (einsum_acc("bntc,bsc->bnts", q_lat_BNTC, kv_BCL[..., :c])
             + einsum_acc("bntr,bsr->bnts", q_rope_BNTR, kv_BCL[..., c:]))
        return s * scale                                               # [B,N,T,C'] as mla_scores_absorbed

    def values(p_BNTS, kv_BSL):
        return einsum_acc("bnts,bsc->bntc", p_BNTS, kv_BSL[..., :c])

    lim_BT = key_limits(positions_BT, causal, pool.max_len)
    o_BNTC = paged_attention(pool, r, dtype, c + q_rope_BTNR.shape[-1], lim_BT, queries, scores, values,
                             chunk=chunk)
    return o_BNTC.transpose(0, 2, 1, 3).astype(dtype)


def _kernel(lim_ref, q_lat_ref, q_rope_ref, bt_ref, pages_ref, o_ref, m_ref, l_ref, *,
            scale: float, block_k: int, page_size: int, tiles_per_split: int, num_pages: int,
            compute_dtype):
    c = q_lat_ref.shape[-1]
    r = q_rope_ref.shape[-1]
    tiles_per_page = page_size // block_k
    lim = lim_ref[...]                                   # [bm] int32
    q_c = q_lat_ref[...]                                 # [bm, C]
    q_r = q_rope_ref[...]                                # [bm, R]
    first = pl.program_id(2) * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, cdiv(jnp.max(lim), block_k))

    def load(page, off, start, size):
        x = pages_ref[page, pl.ds(off, block_k), pl.ds(start, size)]
        if x.dtype == FP8:   # static scale (docs/architecture.md §5.4): value = fp8 * scale
            x = x.astype(jnp.float32) * FP8_SCALE
        return x.astype(compute_dtype)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        logical = lax.div(i, jnp.int32(tiles_per_page))
        off = lax.rem(i, jnp.int32(tiles_per_page)) * block_k
        page = jnp.clip(bt_ref[logical], 0, num_pages - 1)   # a bad table entry must not fault
        k_c = load(page, off, 0, c)                      # [bk, C]
        k_r = load(page, off, c, r)                      # [bk, R]
        s = (mm_nt(q_c, k_c) + mm_nt(q_r, k_r)) * scale  # [bm, bk] f32
        kpos = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        vis = kpos[None, :] < lim[:, None]
        s = jnp.where(vis, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + mm(p.astype(compute_dtype), k_c)
        return acc, m_new, l_new

    bm = q_c.shape[0]
    init = (jnp.zeros((bm, c), jnp.float32), jnp.full((bm,), NEG, jnp.float32),
            jnp.zeros((bm,), jnp.float32))
    acc, m, l = lax.fori_loop(first, last, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _default_splits(batch: int, row_blocks: int, total_tiles: int) -> int:
    """Enough kv splits for ~256 programs (about two waves on a 132-SM GPU), at most one per tile."""
    return max(1, min(total_tiles, -(-256 // (batch * row_blocks))))


def mla_paged_kernel(q_lat_BTNC: jax.Array, q_rope_BTNR: jax.Array, pages: jax.Array,
                     block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                     causal: bool, row: int | None = None, block_m: int = 16, block_k: int = 32,
                     kv_splits: int | None = None, num_warps: int | None = 8,
                     num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas version of `mla_paged_reference` (same arguments and result).

    block_m: query rows (t, n pairs) per program; block_k: key rows per step (<= page size, both
    powers of 2); kv_splits: programs per sequence along the keys (None: fill the GPU)."""
    if row is None:
        pages = pages[None]
        row = 0
    b, t, n, c = q_lat_BTNC.shape
    r = q_rope_BTNR.shape[-1]
    page_size, width = pages.shape[2:]
    if width < c + r:   # wider rows (a pool shared with a wider target) are read up to c + r
        raise ValueError(f"pool rows are {width} wide, queries need {c} + {r}")
    block_k = min(block_k, page_size)
    check_pow2(C=c, R=r, page_size=page_size, block_k=block_k, block_m=block_m)
    max_len = block_table_BP.shape[1] * page_size
    m_rows = t * n
    m_pad = round_up(m_rows, block_m)
    total_tiles = max_len // block_k
    splits = kv_splits or _default_splits(b, m_pad // block_m, total_tiles)

    lim_BM, q_lat, q_rope = _rows(q_lat_BTNC, q_rope_BTNR, positions_BT, causal=causal, max_len=max_len,
                                  m_pad=m_pad)
    o_BMC = _paged_call(lim_BM, q_lat, q_rope, block_table_BP.astype(jnp.int32), pages,
                        scale=float(scale), row=row, block_m=block_m, block_k=block_k, splits=splits,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return o_BMC[:, :m_rows].reshape(b, t, n, c).astype(q_lat_BTNC.dtype)


# The row plumbing and the kernel are jitted apart so that one interpret-mode kernel compile
# serves every T that pads to the same row count.
@functools.partial(jax.jit, static_argnames=("causal", "max_len", "m_pad"))
def _rows(q_lat_BTNC, q_rope_BTNR, positions_BT, *, causal, max_len, m_pad):
    """(t, n) query pairs as rows [B, M_pad, .], with each row's key limit (padded rows: 0)."""
    b, t, n, c = q_lat_BTNC.shape
    q_lat = pad_to(q_lat_BTNC.reshape(b, t * n, c), 1, m_pad)
    q_rope = pad_to(q_rope_BTNR.astype(q_lat.dtype).reshape(b, t * n, -1), 1, m_pad)
    lim_BM = pad_to(jnp.repeat(key_limits(positions_BT, causal, max_len), n, axis=1), 1, m_pad)
    return lim_BM, q_lat, q_rope


@functools.partial(jax.jit, static_argnames=("scale", "row", "block_m", "block_k", "splits", "num_warps",
                                             "num_stages", "interpret"))
def _paged_call(lim_BM, q_lat_BMC, q_rope_BMR, block_table_BP, pages, *, scale, row, block_m, block_k,
                splits, num_warps, num_stages, interpret):
    b, m_pad, c = q_lat_BMC.shape
    r = q_rope_BMR.shape[-1]
    _, num_pages, page_size, width = pages.shape
    pages_per_seq = block_table_BP.shape[1]
    tiles_per_split = -(-(pages_per_seq * page_size // block_k) // splits)
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, page_size=page_size,
                               tiles_per_split=tiles_per_split, num_pages=num_pages,
                               compute_dtype=q_lat_BMC.dtype)
    part = lambda *shape: jax.ShapeDtypeStruct((splits, b, m_pad) + shape, jnp.float32)
    o_SBMC, m_SBM, l_SBM = common.pallas_call(
        kernel,
        grid=(b, m_pad // block_m, splits),
        in_specs=[
            pl.BlockSpec((None, block_m), lambda bi, i, s: (bi, i)),
            pl.BlockSpec((None, block_m, c), lambda bi, i, s: (bi, i, 0)),
            pl.BlockSpec((None, block_m, r), lambda bi, i, s: (bi, i, 0)),
            pl.BlockSpec((None, pages_per_seq), lambda bi, i, s: (bi, 0)),
            pl.BlockSpec((None, num_pages, page_size, width), lambda bi, i, s: (row, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_m, c), lambda bi, i, s: (s, bi, i, 0)),
            pl.BlockSpec((None, None, block_m), lambda bi, i, s: (s, bi, i)),
            pl.BlockSpec((None, None, block_m), lambda bi, i, s: (s, bi, i)),
        ],
        out_shape=[part(c), part(), part()],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="mla_paged_attention",
    )(lim_BM, q_lat_BMC, q_rope_BMR, block_table_BP, pages)

    # merge the splits' partial softmaxes (a split that saw no key has m = NEG, l = 0)
    m_BM = jnp.max(m_SBM, axis=0)
    w_SBM = jnp.exp(m_SBM - m_BM)
    l_BM = jnp.sum(w_SBM * l_SBM, axis=0)
    return jnp.sum(w_SBM[..., None] * o_SBMC, axis=0) / jnp.where(l_BM > 0, l_BM, 1.0)[..., None]
