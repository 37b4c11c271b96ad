"""Multi-anchor block-sparse attention for draft training (docs/architecture.md §4.2-§4.3).

The core works on expanded MLA heads. Queries: A anchors x T block rows, anchor-major
([B, A*T, N, .]). Keys: the S context rows, then the A*T block rows in the same order as the
queries ([B, S + A*T, ...]). Block row i of anchor a (position anchors[a] + i) sees
- context keys at positions < anchors[a] (strictly: the anchor's own target state is not seen),
- the T rows of its own block (bidirectional),
and nothing else; rows of a dropped anchor (keep False) see nothing and output 0.
`block_sparse_kernel` is differentiable through a `jax.custom_vjp`: the forward kernel saves the
log-sum-exp and the FlashAttention-2 backward kernels give dq, dk, dv without ever forming the
[A*T, S + A*T] score matrix. `block_sparse_reference` is the dense masked softmax.

Training calls the latent form (`dispatch.block_sparse_attention`), which takes what the draft's
block pass has: queries per block, the sequence's latent context rows, the blocks' own latent rows
and kv_b_proj's halves. Its reference, `multi_anchor_reference`, is the draft's absorbed MLA with
one batch row per block; `multi_anchor_kernel` lifts each sequence's rows to per-head keys and
values once (not once per block) and runs the core kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.kernels import mla_flash
from dspark_jax.kernels.common import pad_to
from dspark_jax.kernels.mla_reference import masked_softmax, mla_attend_absorbed
from dspark_jax.numerics import einsum_acc


def block_sparse_mask(anchors_BA: jax.Array, keep_BA: jax.Array, num_context: int, block_size: int) -> jax.Array:
    """bool [B, A*T, S + A*T] visibility of the dense reference."""
    b, a = anchors_BA.shape
    t = block_size
    ctx_BAS = (jnp.arange(num_context)[None, None, :] < anchors_BA[..., None]) & keep_BA[..., None]
    own_AA = jnp.eye(a, dtype=bool)
    blk_BAA = own_AA[None] & keep_BA[..., None]
    ctx_BQS = jnp.repeat(ctx_BAS, t, axis=1)
    blk_BQQ = jnp.repeat(jnp.repeat(blk_BAA, t, axis=1), t, axis=2)
    return jnp.concatenate([ctx_BQS, blk_BQQ], axis=-1)


def block_sparse_reference(q_nope_BQNH: jax.Array, q_rope_BQNR: jax.Array, k_nope_BKNH: jax.Array,
                           k_pe_BKR: jax.Array, v_BKNV: jax.Array, anchors_BA: jax.Array, keep_BA: jax.Array,
                           scale: float) -> jax.Array:
    """Dense masked softmax over all S + A*T keys -> [B, A*T, N, V]; T = Q // A."""
    a = anchors_BA.shape[1]
    q = q_nope_BQNH.shape[1]
    mask = block_sparse_mask(anchors_BA, keep_BA, k_nope_BKNH.shape[1] - q, q // a)
    return mla_flash.dense_reference(q_nope_BQNH, q_rope_BQNR, k_nope_BKNH, k_pe_BKR, v_BKNV, mask, scale)


def _row_inputs(anchors_BA, keep_BA, block_size: int, q_pad: int, num_context: int):
    """Per query row: context limit (the anchor position, 0 if dropped) and block segment (the
    anchor index, -1 if dropped); padded rows see nothing."""
    a = anchors_BA.shape[1]
    lim_BA = jnp.where(keep_BA, jnp.clip(anchors_BA.astype(jnp.int32), 0, num_context), 0)
    seg_BA = jnp.where(keep_BA, jnp.arange(a, dtype=jnp.int32)[None], -1)
    lim_BQ = pad_to(jnp.repeat(lim_BA, block_size, axis=1), 1, q_pad)
    seg_BQ = pad_to(jnp.repeat(seg_BA, block_size, axis=1), 1, q_pad, value=-1)
    return lim_BQ, seg_BQ


def block_sparse_kernel(q_nope_BQNH: jax.Array, q_rope_BQNR: jax.Array, k_nope_BKNH: jax.Array,
                        k_pe_BKR: jax.Array, v_BKNV: jax.Array, anchors_BA: jax.Array, keep_BA: jax.Array,
                        scale: float, *, block_q: int = 64, block_k: int = 32, num_warps: int | None = 8,
                        num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas version of `block_sparse_reference` (same arguments and result), differentiable in
    q_nope, q_rope, k_nope, k_pe and v. Head dims must be powers of 2."""
    b, q, n, h = q_nope_BQNH.shape
    a = anchors_BA.shape[1]
    if q % a:
        raise ValueError(f"{q} query rows are not {a} anchors x a block")
    r, vd = q_rope_BQNR.shape[-1], v_BKNV.shape[-1]
    mla_flash.check_dims(h, r, vd, block_q, block_k)
    num_context = k_nope_BKNH.shape[1] - q
    lay = mla_flash.Layout(q, num_context, q // a, block_q, block_k)
    lim_BQ, seg_BQ = _row_inputs(anchors_BA, keep_BA, q // a, lay.q_pad, num_context)
    cfg = _Config(lay, float(scale), num_warps, num_stages, interpret)
    dtype = q_nope_BQNH.dtype   # one compute dtype; astype's own VJP returns each grad in its input's dtype
    return _attend(lim_BQ, seg_BQ, q_nope_BQNH, q_rope_BQNR.astype(dtype), k_nope_BKNH.astype(dtype),
                   k_pe_BKR.astype(dtype), v_BKNV.astype(dtype), cfg)


class _Config(NamedTuple):
    lay: mla_flash.Layout
    scale: float
    num_warps: int | None
    num_stages: int | None
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(lim_BQ, seg_BQ, qn, qr, kn, kr, v, cfg: _Config):
    return _forward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, cfg=cfg)[0]


def _attend_fwd(lim_BQ, seg_BQ, qn, qr, kn, kr, v, cfg: _Config):
    o, lse = _forward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, cfg=cfg)
    return o, (lim_BQ, seg_BQ, qn, qr, kn, kr, v, o, lse)


def _attend_bwd(cfg: _Config, res, do):
    return (None, None, *_backward(*res, do, cfg=cfg))   # no cotangents for the integer row inputs


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pad_all(qn, qr, kn, kr, v, lay: mla_flash.Layout):
    pq = lambda x: pad_to(x, 1, lay.q_pad)
    pk = lambda x: mla_flash.pad_keys(x, lay, lay.n_ctx)
    return pq(qn), pq(qr), pk(kn), pk(kr), pk(v)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, *, cfg: _Config):
    lay = cfg.lay
    o, lse = mla_flash.flash_forward(lim_BQ, seg_BQ, *_pad_all(qn, qr, kn, kr, v, lay), lay=lay,
                                     scale=cfg.scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                     interpret=cfg.interpret)
    return o[:, :lay.q_len], lse


@functools.partial(jax.jit, static_argnames=("cfg",))
def _backward(lim_BQ, seg_BQ, qn, qr, kn, kr, v, o, lse, do, *, cfg: _Config):
    lay = cfg.lay
    pq = lambda x: pad_to(x, 1, lay.q_pad)
    dqn, dqr, dkn, dkr, dv = mla_flash.flash_backward(
        lim_BQ, seg_BQ, *_pad_all(qn, qr, kn, kr, v, lay), pq(o), lse, pq(do.astype(o.dtype)), lay=lay,
        scale=cfg.scale, num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=cfg.interpret)
    unpad_k = lambda x: mla_flash.unpad_keys(x, lay, lay.n_ctx, lay.q_len)
    return (dqn[:, :lay.q_len], dqr[:, :lay.q_len].astype(qr.dtype), unpad_k(dkn),
            unpad_k(dkr).astype(kr.dtype), unpad_k(dv))


# ---------------------------------------------------------------------------------------------
# the latent form draft training calls (X = B*A blocks, L = C + R latent row width)


def multi_anchor_reference(q_nope_BATNH: jax.Array, q_rope_BATNR: jax.Array, kv_ctx_BSL: jax.Array,
                           kv_blk_BATL: jax.Array, w_uk_NHC: jax.Array, w_uv_NVC: jax.Array,
                           ctx_len_BA: jax.Array, scale: float) -> jax.Array:
    """The draft's own block attention (absorbed MLA, `mla_reference.mla_attend_absorbed`) with every
    block a batch row: block a's T rows see context rows [0, ctx_len[a]) of their sequence and
    their own T rows (bidirectional), nothing of other blocks -> o [B, A, T, N, V].
    A dropped block gets ctx_len 0 and still sees itself (its rows are unsupervised)."""
    b, a, t, n, h = q_nope_BATNH.shape
    s, w = kv_ctx_BSL.shape[1:]
    kv_ctx_XSL = jnp.broadcast_to(kv_ctx_BSL[:, None], (b, a, s, w)).reshape(b * a, s, w)
    kv_XKL = jnp.concatenate([kv_ctx_XSL.astype(kv_blk_BATL.dtype), kv_blk_BATL.reshape(b * a, t, w)], axis=1)
    ctx_BAS = jnp.arange(s)[None, None, :] < ctx_len_BA[..., None]
    ctx_XTS = jnp.broadcast_to(ctx_BAS[:, :, None, :], (b, a, t, s)).reshape(b * a, t, s)
    mask_XTK = jnp.concatenate([ctx_XTS, jnp.ones((b * a, t, t), bool)], axis=2)
    o_XTNV = mla_attend_absorbed(q_nope_BATNH.reshape(b * a, t, n, h), q_rope_BATNR.reshape(b * a, t, n, -1),
                                 kv_XKL.astype(q_nope_BATNH.dtype), mask_XTK, w_uk_NHC, w_uv_NVC, scale)
    return o_XTNV.reshape(b, a, t, n, -1)


def multi_anchor_shared(q_nope_BATNH: jax.Array, q_rope_BATNR: jax.Array, kv_ctx_BSL: jax.Array,
                        kv_blk_BATL: jax.Array, w_uk_NHC: jax.Array, w_uv_NVC: jax.Array,
                        ctx_len_BA: jax.Array, scale: float) -> jax.Array:
    """`multi_anchor_reference` without a copy of the context per block: all A*T block rows of a
    sequence score its S context rows in one product (and read them back in one), each block's
    own rows separately, one softmax over both. The same attention (float64 tests); what the
    training step runs where there is no kernel (XLA:CPU spent ~17 % of a step on the
    reference's per-block copies of the context and their gradients)."""
    b, a, t, n, _ = q_nope_BATNH.shape
    s = kv_ctx_BSL.shape[1]
    c = w_uk_NHC.shape[-1]
    dtype = q_nope_BATNH.dtype
    kv_ctx_BSL = kv_ctx_BSL.astype(kv_blk_BATL.dtype).astype(dtype)
    kv_blk_BATL = kv_blk_BATL.astype(dtype)
    q_lat_BATNC = einsum_acc("batnh,nhc->batnc", q_nope_BATNH, w_uk_NHC).astype(dtype)
    scores_ctx_BATNS = (einsum_acc("batnc,bsc->batns", q_lat_BATNC, kv_ctx_BSL[..., :c])
                        + einsum_acc("batnr,bsr->batns", q_rope_BATNR, kv_ctx_BSL[..., c:]))
    kv_blk_XUL = kv_blk_BATL.reshape(b * a, t, -1)          # X = B*A blocks, U = a block's own rows
    scores_blk_BATNU = (einsum_acc("xtnc,xuc->xtnu", q_lat_BATNC.reshape(b * a, t, n, c), kv_blk_XUL[..., :c])
                        + einsum_acc("xtnr,xur->xtnu", q_rope_BATNR.reshape(b * a, t, n, -1), kv_blk_XUL[..., c:])
                        ).reshape(b, a, t, n, t)
    scores = jnp.concatenate([scores_ctx_BATNS, scores_blk_BATNU], axis=-1) * scale
    ctx_BAS = jnp.arange(s)[None, None, :] < ctx_len_BA[..., None]
    mask_BA11K = jnp.concatenate([ctx_BAS, jnp.ones((b, a, t), bool)], axis=-1)[:, :, None, None]
    p = masked_softmax(scores, mask_BA11K).astype(dtype)
    o_lat_BATNC = (einsum_acc("batns,bsc->batnc", p[..., :s], kv_ctx_BSL[..., :c])
                   + einsum_acc("xtnu,xuc->xtnc", p[..., s:].reshape(b * a, t, n, t),
                                kv_blk_XUL[..., :c]).reshape(b, a, t, n, c))
    o_BATNV = einsum_acc("batnc,nvc->batnv", o_lat_BATNC.astype(w_uv_NVC.dtype), w_uv_NVC)
    return o_BATNV.astype(dtype)


def multi_anchor_kernel(q_nope_BATNH: jax.Array, q_rope_BATNR: jax.Array, kv_ctx_BSL: jax.Array,
                        kv_blk_BATL: jax.Array, w_uk_NHC: jax.Array, w_uv_NVC: jax.Array,
                        ctx_len_BA: jax.Array, scale: float, **kernel_kw) -> jax.Array:
    """`multi_anchor_reference` through `block_sparse_kernel` (expanded MLA, as
    `mla_reference.mla_attend_expanded` lifts rows): the S context rows and the A*T block rows of a
    sequence become per-head keys / values once, and the kernel's mask does the rest.
    `kernel_kw`: block_sparse_kernel's tile / launch / interpret arguments."""
    b, a, t, n, h = q_nope_BATNH.shape
    c = w_uk_NHC.shape[-1]
    dtype = q_nope_BATNH.dtype
    kv_BKL = jnp.concatenate([kv_ctx_BSL.astype(kv_blk_BATL.dtype), kv_blk_BATL.reshape(b, a * t, -1)],
                             axis=1).astype(dtype)
    c_kv_BKC, k_pe_BKR = kv_BKL[..., :c], kv_BKL[..., c:]
    k_nope_BKNH = jnp.einsum("bkc,nhc->bknh", c_kv_BKC, w_uk_NHC)
    v_BKNV = jnp.einsum("bkc,nvc->bknv", c_kv_BKC, w_uv_NVC)
    # keep all True: a dropped block (ctx_len 0) still sees its own rows, as in the reference
    o_BQNV = block_sparse_kernel(q_nope_BATNH.reshape(b, a * t, n, h), q_rope_BATNR.reshape(b, a * t, n, -1),
                                 k_nope_BKNH, k_pe_BKR, v_BKNV, ctx_len_BA, jnp.ones((b, a), bool), scale,
                                 **kernel_kw)
    return o_BQNV.reshape(b, a, t, n, -1)
