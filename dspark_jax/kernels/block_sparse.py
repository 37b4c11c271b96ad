"""Multi-anchor block-sparse attention for draft training (spec D.2-D.3), expanded MLA heads.

Queries: A anchors x T block rows, anchor-major ([B, A*T, N, .]). Keys: the S context rows, then
the A*T block rows in the same order as the queries ([B, S + A*T, ...]). Block row i of anchor a
(position anchors[a] + i) sees
- context keys at positions < anchors[a] (strictly: the anchor's own target state is not seen),
- the T rows of its own block (bidirectional),
and nothing else; rows of a dropped anchor (keep False) see nothing and output 0.

`block_sparse_attention` is differentiable through a `jax.custom_vjp`: the forward kernel saves
the log-sum-exp and the FlashAttention-2 backward kernels give dq, dk, dv without ever forming the
[A*T, S + A*T] score matrix.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.kernels import mla_flash
from dspark_jax.kernels.common import pad_to


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
