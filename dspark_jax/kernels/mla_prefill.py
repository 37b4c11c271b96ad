"""Causal flash attention for MLA prefill, expanded form (docs/architecture.md §1.5.4: q/k 192 = 128 nope + 64 rope,
v 128 at K3 sizes).

Keys are the logical cache rows 0..S-1 expanded per head (k_nope, v = c_kv @ W_UK / W_UV; k_pe is
shared by all heads); query row (b, t) sits at position positions[b, t] and sees keys j <= it.
This covers a cacheless forward (positions = arange) and a chunk of a longer prefill attending to
the whole cache so far.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax.kernels import mla_flash
from dspark_jax.kernels.common import next_pow2, pad_to


def _limits(positions_BT: jax.Array, num_keys: int) -> jax.Array:
    return jnp.clip(positions_BT.astype(jnp.int32) + 1, 0, num_keys)


def mla_prefill_reference(q_nope_BTNH: jax.Array, q_rope_BTNR: jax.Array, k_nope_BSNH: jax.Array,
                          k_pe_BSR: jax.Array, v_BSNV: jax.Array, positions_BT: jax.Array,
                          scale: float) -> jax.Array:
    """Dense causal attention (key j visible to row t iff j <= positions[b, t]) -> [B,T,N,V]."""
    s = k_nope_BSNH.shape[1]
    mask_BTS = jnp.arange(s)[None, None, :] < _limits(positions_BT, s)[..., None]
    return mla_flash.dense_reference(q_nope_BTNH, q_rope_BTNR, k_nope_BSNH, k_pe_BSR, v_BSNV, mask_BTS, scale)


def mla_prefill_kernel(q_nope_BTNH: jax.Array, q_rope_BTNR: jax.Array, k_nope_BSNH: jax.Array,
                       k_pe_BSR: jax.Array, v_BSNV: jax.Array, positions_BT: jax.Array, scale: float, *,
                       block_q: int = 64, block_k: int = 32, num_warps: int | None = 8,
                       num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas version of `mla_prefill_reference` (same arguments and result); head dims must be
    powers of 2. Key tiles past a query tile's last position are skipped."""
    b, t, n, h = q_nope_BTNH.shape
    s = k_nope_BSNH.shape[1]
    r, vd = q_rope_BTNR.shape[-1], v_BSNV.shape[-1]
    block_q = min(block_q, max(16, next_pow2(t)))        # no 64-row tile for a 5-token chunk
    mla_flash.check_dims(h, r, vd, block_q, block_k)
    lay = mla_flash.Layout(t, s, 0, block_q, block_k)
    dtype = q_nope_BTNH.dtype
    lim_BQ = pad_to(_limits(positions_BT, s), 1, lay.q_pad)          # padded rows see nothing
    o = _prefill_call(lim_BQ, pad_to(q_nope_BTNH, 1, lay.q_pad), pad_to(q_rope_BTNR.astype(dtype), 1, lay.q_pad),
                      mla_flash.pad_keys(k_nope_BSNH.astype(dtype), lay, s),
                      mla_flash.pad_keys(k_pe_BSR.astype(dtype), lay, s),
                      mla_flash.pad_keys(v_BSNV.astype(dtype), lay, s),
                      lay=lay, scale=float(scale), num_warps=num_warps, num_stages=num_stages,
                      interpret=interpret)
    return o[:, :t]


@functools.partial(jax.jit, static_argnames=("lay", "scale", "num_warps", "num_stages", "interpret"))
def _prefill_call(lim_BQ, qn, qr, kn, kr, v, *, lay, scale, num_warps, num_stages, interpret):
    # no block keys (lay.block_size == 0): the segment input is never read, any [B, Qp] int array does
    o, _ = mla_flash.flash_forward(lim_BQ, lim_BQ, qn, qr, kn, kr, v, lay=lay, scale=scale,
                                   num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return o
