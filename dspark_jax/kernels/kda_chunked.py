"""KDA delta-rule kernels (docs/architecture.md §1.5.3): chunked prefill, and the verify recurrence with snapshots.

Both take what `kda_reference.kda_chunked` / `kda_recurrent` take (q l2-normalised and scaled, k
l2-normalised, per-channel log-decay g <= 0, beta, fp32 state [B,H,K,V]) and return the same.

`kda_chunked_kernel`: one program per (batch, head, V tile) walks the chunks in order with the
state tile in the loop carry (Triton has no scratch buffers; registers play that part). The V
columns of the delta rule are independent, so splitting V only repeats the small per-chunk
K-side work. Per chunk of C tokens (gc = in-chunk cumulative g):
  Akk[i,j] = beta_i sum_d k_i k_j exp(gc_i - gc_j)   (i > j)      Aqk: the same with q_i, i >= j
  Tm = (I + Akk)^-1  (forward substitution, row by row)
  Vn = Tm (beta v) - Tm (beta k exp(gc)) S ;  o = (q exp(gc)) S + Aqk Vn
  S <- exp(gc_last) S + (k exp(gc_last - gc))^T Vn
Akk / Aqk are built one column j at a time with the exponent gc_i - gc_j masked to i >= j, so every
exponent is <= 0 and nothing overflows for any gate (Kimi-Linear's unbounded softplus gate
included); a factorised exp(gc_i) exp(-gc_j) form would overflow. The chunk length is the kernel's
own (`chunk`, default 16); the result does not depend on it beyond fp32 rounding.

`kda_recurrent_kernel` (decision: implemented, it pays): the verify step runs T+1 = 8 tokens and
must keep the state after every token (docs/architecture.md §5.2). As an XLA scan each token reads and writes the
whole fp32 state several times (decay, k^T S, rank-1 update, q^T S, snapshot copy; 96 x 128 x 128
x 4 B = 6 MiB per sequence per layer, x 69 layers); the kernel reads the state once, keeps it in
registers and writes each snapshot once, about a quarter of the memory traffic, in one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dspark_jax.kernels import common
from dspark_jax.kernels.common import check_pow2, compiler_params, mm, mm_tn, pad_to, round_up


def _chunk_kernel(q_ref, k_ref, v_ref, gc_ref, beta_ref, s0_ref, o_ref, s_ref, *, chunk: int, n_chunks: int):
    c = chunk
    rows = jnp.arange(c, dtype=jnp.int32)[:, None]      # [C,1]
    cols = jnp.arange(c, dtype=jnp.int32)[None, :]      # [1,C]

    def chunk_body(ci, s_KV):
        t0 = ci * c
        tok = pl.ds(t0, c)
        q = q_ref[tok, :].astype(jnp.float32)           # [C,K]
        k = k_ref[tok, :].astype(jnp.float32)
        v = v_ref[tok, :].astype(jnp.float32)           # [C,bv]
        gc = gc_ref[tok, :]                              # [C,K] in-chunk cumulative log-decay
        beta = beta_ref[tok].astype(jnp.float32)        # [C]

        def column(j, carry):
            a_kk, a_qk = carry
            k_j = k_ref[t0 + j, :].astype(jnp.float32)  # [K] (a load: cheaper than picking a row)
            gc_j = gc_ref[t0 + j, :]
            decay = jnp.where(rows >= j, jnp.exp(jnp.minimum(gc - gc_j[None, :], 0.0)), 0.0)
            kd = decay * k_j[None, :]                    # [C,K]
            col_kk = jnp.where(rows > j, jnp.sum(k * kd, axis=1)[:, None], 0.0)    # [C,1]
            col_qk = jnp.sum(q * kd, axis=1)[:, None]
            return jnp.where(cols == j, col_kk, a_kk), jnp.where(cols == j, col_qk, a_qk)

        zeros = jnp.zeros((c, c), jnp.float32)
        a_kk, a_qk = lax.fori_loop(0, c, column, (zeros, zeros))
        a_kk = a_kk * beta[:, None]

        def substitute(i, t_inv):   # row i of (I + A)^-1 = e_i - A[i, :i] @ rows :i (already final)
            a_i = jnp.sum(jnp.where(rows == i, a_kk, 0.0), axis=0)          # [C], zero from column i on
            new = jnp.where(jnp.arange(c, dtype=jnp.int32) == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t_inv, axis=0)
            return jnp.where(rows == i, new[None, :], t_inv)

        t_inv = lax.fori_loop(1, c, substitute, jnp.where(rows == cols, 1.0, 0.0))
        u = mm(t_inv, v * beta[:, None])
        w = mm(t_inv, k * (beta[:, None] * jnp.exp(gc)))
        v_new = u - mm(w, s_KV)                          # [C,bv]
        o_ref[tok, :] = (mm(q * jnp.exp(gc), s_KV) + mm(a_qk, v_new)).astype(o_ref.dtype)
        g_last = gc_ref[t0 + c - 1, :]                   # [K]
        return jnp.exp(g_last)[:, None] * s_KV + mm_tn(k * jnp.exp(g_last[None, :] - gc), v_new)

    s_ref[...] = lax.fori_loop(0, n_chunks, chunk_body, s0_ref[...].astype(jnp.float32))


def _specs(t: int, k: int, bv: int):
    """BlockSpecs on the (batch, head, V tile) grid: whole sequences of one head."""
    tk = pl.BlockSpec((None, t, None, k), lambda b, h, j: (b, 0, h, 0))
    tv = pl.BlockSpec((None, t, None, bv), lambda b, h, j: (b, 0, h, j))
    th = pl.BlockSpec((None, t, None), lambda b, h, j: (b, 0, h))
    st = pl.BlockSpec((None, None, k, bv), lambda b, h, j: (b, h, 0, j))
    return tk, tv, th, st


def kda_chunked_kernel(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
                       chunk_size: int = 64, return_snapshots: bool = False, chunk: int = 16,
                       block_v: int = 64, num_warps: int | None = 8, num_stages: int | None = None,
                       interpret: bool = False):
    """Pallas version of `kda_chunked` (same arguments and results; `chunk_size` is accepted for
    that and unused: the kernel's chunk is `chunk`). Snapshots are the verify path's job
    (`kda_recurrent_kernel`), so return_snapshots must be False here."""
    del chunk_size
    if return_snapshots:
        raise ValueError("the chunked kernel does not write snapshots; use kda_recurrent_kernel")
    b, t, h, dk = k_BTHK.shape
    dv = v_BTHV.shape[-1]
    bv = min(block_v, dv)
    check_pow2(K=dk, V=dv, block_v=bv, chunk=chunk)
    t_pad = round_up(t, chunk)
    # padding tokens have g = beta = 0: the identity on the state (as in kda_chunked)
    pad = lambda x: pad_to(x, 1, t_pad)
    g_NCHK = pad(g_BTHK).astype(jnp.float32).reshape(b, t_pad // chunk, chunk, h, dk)
    gc_BTHK = jnp.cumsum(g_NCHK, axis=2).reshape(b, t_pad, h, dk)     # one cheap XLA pass
    o, s = _chunked_call(pad(q_BTHK), pad(k_BTHK), pad(v_BTHV), gc_BTHK, pad(beta_BTH), initial_state_BHKV,
                         chunk=chunk, bv=bv, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return o[:, :t], s, None


@functools.partial(jax.jit, static_argnames=("chunk", "bv", "num_warps", "num_stages", "interpret"))
def _chunked_call(q, k, v, g, beta, s0, *, chunk, bv, num_warps, num_stages, interpret):
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    tk, tv, th, st = _specs(t, dk, bv)
    return common.pallas_call(
        functools.partial(_chunk_kernel, chunk=chunk, n_chunks=t // chunk),
        grid=(b, h, dv // bv),
        in_specs=[tk, tk, tv, tk, th, st],
        out_specs=[tv, st],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="kda_chunked",
    )(q, k, v, g, beta, s0)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, s_ref, *snap_refs, n_tokens: int):
    def step(i, s_KV):
        k = k_ref[i, :].astype(jnp.float32)             # [K]
        s_KV = s_KV * jnp.exp(g_ref[i, :].astype(jnp.float32))[:, None]
        u = beta_ref[i].astype(jnp.float32) * (v_ref[i, :].astype(jnp.float32)
                                               - jnp.sum(k[:, None] * s_KV, axis=0))   # [bv]
        s_KV = s_KV + k[:, None] * u[None, :]
        o_ref[i, :] = jnp.sum(q_ref[i, :].astype(jnp.float32)[:, None] * s_KV, axis=0)
        if snap_refs:
            snap_refs[0][i, :, :] = s_KV
        return s_KV

    s_ref[...] = lax.fori_loop(0, n_tokens, step, s0_ref[...].astype(jnp.float32))


def kda_recurrent_kernel(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
                         return_snapshots: bool = False, block_v: int = 64, num_warps: int | None = 4,
                         num_stages: int | None = None, interpret: bool = False):
    """Pallas version of `kda_recurrent` (same arguments and results: o [B,T,H,V] f32, final state,
    snapshots [B,T,H,K,V] f32 or None)."""
    dk, dv = k_BTHK.shape[-1], v_BTHV.shape[-1]
    bv = min(block_v, dv)
    check_pow2(K=dk, V=dv, block_v=bv)
    out = _recurrent_call(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV,
                          snapshots=return_snapshots, bv=bv, num_warps=num_warps, num_stages=num_stages,
                          interpret=interpret)
    return out[0], out[1], out[2] if return_snapshots else None


@functools.partial(jax.jit, static_argnames=("snapshots", "bv", "num_warps", "num_stages", "interpret"))
def _recurrent_call(q, k, v, g, beta, s0, *, snapshots, bv, num_warps, num_stages, interpret):
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    tk, tv, th, st = _specs(t, dk, bv)
    out_specs = [tv, st]
    out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)]
    if snapshots:
        out_specs.append(pl.BlockSpec((None, t, None, dk, bv), lambda bi, hi, j: (bi, 0, hi, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32))
    return common.pallas_call(
        functools.partial(_recurrent_kernel, n_tokens=t),
        grid=(b, h, dv // bv),
        in_specs=[tk, tk, tv, tk, th, st],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="kda_recurrent",
    )(q, k, v, g, beta, s0)
