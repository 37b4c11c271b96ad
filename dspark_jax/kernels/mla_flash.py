"""Flash attention over expanded MLA heads, shared by prefill (`mla_prefill`) and the multi-anchor
draft-training attention (`block_sparse`).

Per head: q = [q_nope (H) | q_rope (R)], k = [k_nope (H) | k_pe (R, shared by all heads)], v (V).
192 = 128 + 64 is not a power of 2, so the two parts stay separate tiles and their dots are added.

Keys come in two groups, each visible by its own rule:
- context keys 0..S-1: key j is visible to query row i iff j < ctx_limit[i];
- block keys (only with `block_size` T > 0), one per query row in the same order: block key j is
  visible to query row i iff j // T == segment[i] (segment = the row's block, -1 = sees none).
Prefill uses context keys only (limit = position + 1); the draft-training attention uses both
(limit = anchor, segment = the anchor's index, or 0 / -1 for dropped anchors).

Kernels (grid batch x head x tile): forward walks the context tiles below the q tile's largest
limit, then the few block tiles that hold its rows' blocks, with an online softmax, and also
returns the log-sum-exp; backward is FlashAttention-2's: one kernel for dq (same walk), one for
dk/dv per key tile (walking the q tiles that can see it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dspark_jax.kernels import common
from dspark_jax.kernels.common import NEG, cdiv, check_pow2, compiler_params, mm, mm_nt, mm_tn, pad_to, round_up
from dspark_jax.kernels.mla_reference import masked_softmax
from dspark_jax.numerics import einsum_acc

_EMPTY_LSE = 1e30   # lse of a row that sees nothing: exp(s - lse) == 0 for any score


def dense_reference(q_nope_BQNH, q_rope_BQNR, k_nope_BKNH, k_pe_BKR, v_BKNV, mask_BQK, scale: float):
    """Dense masked attention with the same numerics as mla_reference.mla_attend_expanded -> [B,Q,N,V]."""
    scores_BNQK = (einsum_acc("bqnh,bknh->bnqk", q_nope_BQNH, k_nope_BKNH)
                   + einsum_acc("bqnr,bkr->bnqk", q_rope_BQNR, k_pe_BKR))
    p_BNQK = masked_softmax(scores_BNQK * scale, mask_BQK[:, None])
    o_BQNV = einsum_acc("bnqk,bknv->bqnv", p_BNQK.astype(v_BKNV.dtype), v_BKNV)
    return o_BQNV.astype(q_nope_BQNH.dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static tiling of one call (hashable: a jit static argument): padded sizes and tile counts."""
    q_len: int
    n_ctx: int
    block_size: int       # T of the block-key group; 0 = context keys only
    block_q: int
    block_k: int

    @property
    def q_pad(self) -> int:
        return round_up(self.q_len, max(self.block_q, self.block_k))

    @property
    def ctx_pad(self) -> int:
        return round_up(max(self.n_ctx, 1), self.block_k)

    @property
    def ctx_tiles(self) -> int:
        return self.ctx_pad // self.block_k

    @property
    def blk_tiles(self) -> int:
        return self.q_pad // self.block_k if self.block_size else 0

    @property
    def k_pad(self) -> int:
        return self.ctx_pad + self.blk_tiles * self.block_k

    def block_tile_range(self, q_row0):
        """Block-key tiles [lo, hi) holding the blocks of query rows q_row0 .. q_row0 + block_q - 1."""
        t = self.block_size
        seg_lo = lax.div(q_row0, jnp.int32(t))
        seg_hi = lax.div(q_row0 + (self.block_q - 1), jnp.int32(t))
        lo = lax.div(seg_lo * t, jnp.int32(self.block_k))
        hi = jnp.minimum(cdiv((seg_hi + 1) * t, self.block_k), self.blk_tiles)
        return lo, hi

    def query_tile_range(self, key_row0):
        """Query tiles [lo, hi) whose rows' blocks hold block keys key_row0 .. key_row0 + block_k - 1."""
        t = self.block_size
        seg_lo = lax.div(key_row0, jnp.int32(t))
        seg_hi = lax.div(key_row0 + (self.block_k - 1), jnp.int32(t))
        lo = lax.div(seg_lo * t, jnp.int32(self.block_q))
        hi = jnp.minimum(cdiv((seg_hi + 1) * t, self.block_q), self.q_pad // self.block_q)
        return lo, hi


def _scores(qn, qr, kn, kr, scale):
    return (mm_nt(qn, kn) + mm_nt(qr, kr)) * scale


def _ctx_visible(lim, kstart, block_k):
    kpos = kstart + jnp.arange(block_k, dtype=jnp.int32)
    return kpos[None, :] < lim[:, None]


def _blk_visible(seg, kstart, block_k, block_size):
    kseg = lax.div(kstart + jnp.arange(block_k, dtype=jnp.int32), jnp.int32(block_size))
    return kseg[None, :] == seg[:, None]


def _visit_keys(step, carry, lim, seg_ref, lay: Layout):
    """Fold `step(kstart, visible, carry)` over the key tiles one q tile can see: the context
    tiles up to its furthest limit, then (with blocks) the block tiles its rows' blocks touch."""
    bq, bk = lay.block_q, lay.block_k

    def ctx_body(j, carry):
        return step(j * bk, _ctx_visible(lim, j * bk, bk), carry)

    carry = lax.fori_loop(0, jnp.minimum(cdiv(jnp.max(lim), bk), lay.ctx_tiles), ctx_body, carry)
    if lay.block_size:
        seg = seg_ref[...]

        def blk_body(j, carry):
            return step(lay.ctx_pad + j * bk, _blk_visible(seg, j * bk, bk, lay.block_size), carry)

        lo, hi = lay.block_tile_range(pl.program_id(2) * bq)
        carry = lax.fori_loop(lo, hi, blk_body, carry)
    return carry


# ---------------------------------------------------------------------------------------------
# forward


def _fwd_kernel(lim_ref, seg_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, o_ref, lse_ref, *,
                lay: Layout, scale: float):
    bq, bk = lay.block_q, lay.block_k
    qn, qr = qn_ref[...], qr_ref[...]
    lim = lim_ref[...]
    dtype = qn.dtype
    v_dim = v_ref.shape[-1]

    def step(kstart, vis, carry):
        acc, m_prev, l_prev = carry
        rows = pl.ds(kstart, bk)
        kn, kr, v = kn_ref[rows, :], kr_ref[rows, :], v_ref[rows, :]
        s = jnp.where(vis, _scores(qn, qr, kn, kr, scale), NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        return alpha[:, None] * acc + mm(p.astype(dtype), v), m_new, l_new

    carry = (jnp.zeros((bq, v_dim), jnp.float32), jnp.full((bq,), NEG, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    acc, m, l = _visit_keys(step, carry, lim, seg_ref, lay)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _EMPTY_LSE)


def _row_specs(lay: Layout):
    """BlockSpecs of per-row / per-query-tile arrays on the (batch, head, q tile) grid."""
    bq = lay.block_q
    row = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    q = lambda d: pl.BlockSpec((None, bq, None, d), lambda b, n, i: (b, i, n, 0))
    return row, q


def _key_specs(lay: Layout, h: int, r: int, v: int):
    """Whole-sequence key arrays of one (batch, head); tiles are sliced inside the kernel."""
    kp = lay.k_pad
    return [pl.BlockSpec((None, kp, None, h), lambda b, n, i: (b, 0, n, 0)),
            pl.BlockSpec((None, kp, r), lambda b, n, i: (b, 0, 0)),
            pl.BlockSpec((None, kp, None, v), lambda b, n, i: (b, 0, n, 0))]


def flash_forward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, *, lay: Layout, scale: float, num_warps, num_stages,
                  interpret: bool):
    """Padded operands in, (o [B,Qp,N,V] in q's dtype, lse [B,N,Qp] f32) out."""
    b, qp, n, h = qn.shape
    r, vd = qr.shape[-1], v.shape[-1]
    row, q = _row_specs(lay)
    kernel = functools.partial(_fwd_kernel, lay=lay, scale=scale)
    return common.pallas_call(
        kernel,
        grid=(b, n, qp // lay.block_q),
        in_specs=[row, row, q(h), q(r), *_key_specs(lay, h, r, vd)],
        out_specs=[q(vd), pl.BlockSpec((None, None, lay.block_q), lambda b, n, i: (b, n, i))],
        out_shape=[jax.ShapeDtypeStruct((b, qp, n, vd), qn.dtype),
                   jax.ShapeDtypeStruct((b, n, qp), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="mla_flash_fwd",
    )(lim_BQ, seg_BQ, qn, qr, kn, kr, v)


# ---------------------------------------------------------------------------------------------
# backward (FlashAttention-2: dq per q tile, dk/dv per key tile; delta = rowsum(o * do))


def _bwd_dq_kernel(lim_ref, seg_ref, qn_ref, qr_ref, do_ref, lse_ref, delta_ref, kn_ref, kr_ref, v_ref,
                   dqn_ref, dqr_ref, *, lay: Layout, scale: float):
    bk = lay.block_k
    qn, qr, do = qn_ref[...], qr_ref[...], do_ref[...]
    lse, delta, lim = lse_ref[...], delta_ref[...], lim_ref[...]
    dtype = qn.dtype

    def step(kstart, vis, carry):
        dqn, dqr = carry
        rows = pl.ds(kstart, bk)
        kn, kr, v = kn_ref[rows, :], kr_ref[rows, :], v_ref[rows, :]
        p = jnp.where(vis, jnp.exp(_scores(qn, qr, kn, kr, scale) - lse[:, None]), 0.0)
        ds = (p * (mm_nt(do, v) - delta[:, None])).astype(dtype)
        return dqn + mm(ds, kn), dqr + mm(ds, kr)

    carry = (jnp.zeros(qn.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32))
    dqn, dqr = _visit_keys(step, carry, lim, seg_ref, lay)
    dqn_ref[...] = (dqn * scale).astype(dqn_ref.dtype)
    dqr_ref[...] = (dqr * scale).astype(dqr_ref.dtype)


def _bwd_dkv_kernel(lim_ref, seg_ref, tile_lim_ref, qn_ref, qr_ref, do_ref, lse_ref, delta_ref,
                    kn_ref, kr_ref, v_ref, dkn_ref, dkr_ref, dv_ref, *, lay: Layout, scale: float):
    bq, bk = lay.block_q, lay.block_k
    kt = pl.program_id(2)
    krows = pl.ds(kt * bk, bk)
    kn, kr, v = kn_ref[krows, :], kr_ref[krows, :], v_ref[krows, :]
    dtype = kn.dtype
    is_ctx = kt < lay.ctx_tiles
    kstart_ctx = kt * bk                                 # context key index of the tile's first row
    kstart_blk = (kt - lay.ctx_tiles) * bk               # block key index of the tile's first row

    def body(qt, carry):
        def compute(carry):
            dkn, dkr, dv = carry
            rows = pl.ds(qt * bq, bq)
            qn, qr, do = qn_ref[rows, :], qr_ref[rows, :], do_ref[rows, :]
            lse, delta = lse_ref[rows], delta_ref[rows]
            vis_ctx = _ctx_visible(lim_ref[rows], kstart_ctx, bk)
            if lay.block_size:
                vis = jnp.where(is_ctx, vis_ctx, _blk_visible(seg_ref[rows], kstart_blk, bk, lay.block_size))
            else:
                vis = vis_ctx
            p = jnp.where(vis, jnp.exp(_scores(qn, qr, kn, kr, scale) - lse[:, None]), 0.0)   # [bq, bk]
            ds = (p * (mm_nt(do, v) - delta[:, None])).astype(dtype)
            return dkn + mm_tn(ds, qn), dkr + mm_tn(ds, qr), dv + mm_tn(p.astype(dtype), do)

        # context tiles: skip q tiles whose rows all stop before this key tile
        needed = jnp.logical_or(jnp.logical_not(is_ctx), tile_lim_ref[qt] > kstart_ctx)
        return lax.cond(needed, compute, lambda c: c, carry)

    n_qt = lay.q_pad // bq
    if lay.block_size:
        blk_lo, blk_hi = lay.query_tile_range(kstart_blk)
        lo = jnp.where(is_ctx, 0, blk_lo)
        hi = jnp.where(is_ctx, n_qt, blk_hi)
    else:
        lo, hi = 0, n_qt
    carry = (jnp.zeros(kn.shape, jnp.float32), jnp.zeros(kr.shape, jnp.float32),
             jnp.zeros(v.shape, jnp.float32))
    dkn, dkr, dv = lax.fori_loop(lo, hi, body, carry)
    dkn_ref[...] = (dkn * scale).astype(dkn_ref.dtype)
    dkr_ref[...] = dkr * scale
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_backward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, o, lse_BNQ, do, *, lay: Layout, scale: float,
                   num_warps, num_stages, interpret: bool):
    """Padded operands in; (dq_nope, dq_rope, dk_nope, dk_pe [B,Kp,R] f32, dv) out."""
    b, qp, n, h = qn.shape
    r, vd = qr.shape[-1], v.shape[-1]
    kp = lay.k_pad
    bq, bk = lay.block_q, lay.block_k
    delta_BNQ = jnp.einsum("bqnv,bqnv->bnq", o.astype(jnp.float32), do.astype(jnp.float32))
    row, q = _row_specs(lay)
    lse_spec = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    params = compiler_params(num_warps, num_stages)

    dqn, dqr = common.pallas_call(
        functools.partial(_bwd_dq_kernel, lay=lay, scale=scale),
        grid=(b, n, qp // bq),
        in_specs=[row, row, q(h), q(r), q(vd), lse_spec, lse_spec, *_key_specs(lay, h, r, vd)],
        out_specs=[q(h), q(r)],
        out_shape=[jax.ShapeDtypeStruct(qn.shape, qn.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype)],
        compiler_params=params, interpret=interpret, name="mla_flash_bwd_dq",
    )(lim_BQ, seg_BQ, qn, qr, do, lse_BNQ, delta_BNQ, kn, kr, v)

    tile_lim_BT = jnp.max(lim_BQ.reshape(b, qp // bq, bq), axis=-1)
    whole_q = lambda d: pl.BlockSpec((None, qp, None, d), lambda b, n, j: (b, 0, n, 0))
    whole_row = pl.BlockSpec((None, qp), lambda b, n, j: (b, 0))
    whole_lse = pl.BlockSpec((None, None, qp), lambda b, n, j: (b, n, 0))
    key_tile = lambda d: pl.BlockSpec((None, kp, None, d), lambda b, n, j: (b, 0, n, 0))
    out_tile = lambda d: pl.BlockSpec((None, bk, None, d), lambda b, n, j: (b, j, n, 0))
    dkn, dkr_BKNR, dv = common.pallas_call(
        functools.partial(_bwd_dkv_kernel, lay=lay, scale=scale),
        grid=(b, n, kp // bk),
        in_specs=[whole_row, whole_row, pl.BlockSpec((None, qp // bq), lambda b, n, j: (b, 0)),
                  whole_q(h), whole_q(r), whole_q(vd), whole_lse, whole_lse,
                  key_tile(h), pl.BlockSpec((None, kp, r), lambda b, n, j: (b, 0, 0)), key_tile(vd)],
        out_specs=[out_tile(h), out_tile(r), out_tile(vd)],
        out_shape=[jax.ShapeDtypeStruct(kn.shape, kn.dtype),
                   jax.ShapeDtypeStruct((b, kp, n, r), jnp.float32),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=interpret, name="mla_flash_bwd_dkv",
    )(lim_BQ, seg_BQ, tile_lim_BT, qn, qr, do, lse_BNQ, delta_BNQ, kn, kr, v)
    return dqn, dqr, dkn, jnp.sum(dkr_BKNR, axis=2), dv


def check_dims(h: int, r: int, v: int, block_q: int, block_k: int) -> None:
    check_pow2(qk_nope_head_dim=h, qk_rope_head_dim=r, v_head_dim=v, block_q=block_q, block_k=block_k)


def pad_keys(x, lay: Layout, n_ctx: int):
    """[B, S (+ Q block rows), ...] -> [B, Kp, ...]: context padded to ctx_pad, block rows to q_pad."""
    ctx = pad_to(x[:, :n_ctx], 1, lay.ctx_pad)
    if not lay.block_size:
        return ctx
    return jnp.concatenate([ctx, pad_to(x[:, n_ctx:], 1, lay.blk_tiles * lay.block_k)], axis=1)


def unpad_keys(x, lay: Layout, n_ctx: int, q_len: int):
    if not lay.block_size:
        return x[:, :n_ctx]
    return jnp.concatenate([x[:, :n_ctx], x[:, lay.ctx_pad:lay.ctx_pad + q_len]], axis=1)
