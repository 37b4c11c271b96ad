"""Pallas kernels (interpret mode on CPU) against their pure-JAX references, and the dispatch.

Shapes are tiny but keep every structural case: ragged lengths, keys crossing page / tile / split
boundaries, T = 1..7 query rows, bf16 and fp8 caches, strong and bounded KDA gates, dropped
anchors. Interpret-mode compiles dominate the run time, so each kernel compiles once per dtype:
the row padding makes every T share one compiled kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.cache import FP8, PagedPool
from dspark_jax.kernels import dispatch
from dspark_jax.kernels.block_sparse import (block_sparse_kernel, block_sparse_mask, block_sparse_reference,
                                             multi_anchor_kernel, multi_anchor_reference,
                                             multi_anchor_shared)
from dspark_jax.kernels.kda_chunked import kda_chunked_kernel, kda_recurrent_kernel
from dspark_jax.kernels.mla_paged import mla_paged_kernel, mla_paged_reference
from dspark_jax.kernels.mla_prefill import mla_prefill_kernel, mla_prefill_reference
from dspark_jax.kernels.kda_reference import kda_chunked, kda_recurrent
from dspark_jax.layers.kda import kda_gate, l2_normalize
from dspark_jax.kernels.mla_reference import mla_attend_absorbed, mla_attend_expanded
from dspark_jax.layers.mla import causal_mask, split_kv_b
from tests.float64 import x64

# f32 compute: kernel and reference differ only in summation order / online-softmax rescaling,
# ~1e-7 relative on O(1) outputs; 2e-5 leaves room without hiding a wrong mask (which moves
# outputs by O(0.1)).
TOL_F32 = 2e-5
# bf16 compute: the kernel rounds the unnormalised softmax weights to bf16 (the reference rounds
# the normalised ones): a few bf16 ulps (2^-8 = 4e-3) of an O(1) output.
TOL_BF16 = 3e-2


def _normal(rng: np.random.Generator, shape, dtype=jnp.float32, scale=1.0):
    # numpy, not jax.random: every new shape would cost a CPU compile of the RNG (~1 s)
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)


def _close(a, b, tol, what=""):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:g}"


# ---------------------------------------------------------------------------------------------
# MLA over the paged pool


B, N, C, R, PAGE, PAGES_PER_SEQ = 3, 2, 32, 16, 4, 5
LENS = np.array([0, 4, 12])        # cached tokens per sequence before the T new rows (ragged)


def _paged_inputs(cache_dtype, q_dtype, t: int, seed: int = 0):
    """numpy inputs (host arrays: slicing them compiles nothing) for T = t query rows."""
    rng = np.random.default_rng(seed)
    num_pages = B * PAGES_PER_SEQ + 3                # spare pages nobody owns
    table = rng.permutation(num_pages)[:B * PAGES_PER_SEQ].reshape(B, PAGES_PER_SEQ).astype(np.int32)
    # rows: 2 pool rows of [c_kv | k_pe]; the kernel reads row 1 (row 0 is different garbage)
    pages = np.asarray(_normal(rng, (2, num_pages, PAGE, C + R)).astype(cache_dtype))
    q_lat = np.asarray(_normal(rng, (B, t, N, C), q_dtype, 0.5))
    q_rope = np.asarray(_normal(rng, (B, t, N, R), q_dtype, 0.5))
    positions = (LENS[:, None] + np.arange(t)[None]).astype(np.int32)
    return q_lat, q_rope, pages, table, positions


@jax.jit
def _paged_reference_both(q_lat, q_rope, pages, table, positions):
    """Verify (causal) and draft-block references, in f32: XLA's CPU runtime cannot run their
    bf16 x bf16 -> f32 batched einsums; the query values are the same bf16-rounded ones."""
    q_lat, q_rope = q_lat.astype(jnp.float32), q_rope.astype(jnp.float32)
    return tuple(mla_paged_reference(q_lat, q_rope, pages, table, positions, 0.3, causal=causal, row=1)
                 for causal in (True, False))


# block_k 2 < page 4: two key tiles per page (the in-page offset path the K3 pages of 128 take)
@pytest.mark.parametrize("cache_dtype,q_dtype,tol,block_k", [
    (jnp.bfloat16, jnp.float32, TOL_F32, 2),
    (FP8, jnp.float32, TOL_F32, 4),
    (FP8, jnp.bfloat16, TOL_BF16, 2),
])
def test_mla_paged_matches_reference(cache_dtype, q_dtype, tol, block_k):
    q_lat7, q_rope7, pages, table, positions7 = _paged_inputs(cache_dtype, q_dtype, 7)
    for t in range(1, 8):                            # verify T+1 rows / draft blocks of 1..7
        # One reference compile for all T: rows are independent, so the reference runs on 7 rows
        # with rows >= t at position -1 (no key visible, no effect on the block's last position).
        pos_ref = np.where(np.arange(7)[None] < t, positions7, -1).astype(np.int32)
        want_both = _paged_reference_both(q_lat7, q_rope7, pages, table, pos_ref)
        for causal, want in zip((True, False), want_both):
            got = mla_paged_kernel(q_lat7[:, :t], q_rope7[:, :t], pages, table, positions7[:, :t], 0.3,
                                   causal=causal, row=1, block_k=block_k, kv_splits=2, interpret=True)
            assert got.shape == (B, t, N, C) and got.dtype == q_dtype
            _close(got, want[:, :t], tol, f"T={t} causal={causal}")


def test_mla_paged_reference_is_the_layer_math():
    """The reference = mla_attend_absorbed on the gathered cache (before W_UV), with the verify
    causal mask and the draft-block mask (context < anchor, plus the whole block)."""
    t, h = 4, 8
    q_lat, q_rope, pages, table, positions = _paged_inputs(jnp.float32, jnp.float32, t)
    rng = np.random.default_rng(7)
    w_uk = _normal(rng, (N, h, C), scale=0.3)
    q_nope = _normal(rng, (B, t, N, h))
    q_lat = jnp.einsum("btnh,nhc->btnc", q_nope, w_uk)
    kv = PagedPool(pages, table).read(1, jnp.float32)
    eye_uv = jnp.broadcast_to(jnp.eye(C), (N, C, C))        # W_UV = I keeps the latent context
    pos_s = jnp.arange(kv.shape[1])[None, None, :]
    anchors = positions[:, :1, None]                          # block rows at anchor..anchor+t-1
    masks = {True: pos_s <= positions[..., None], False: pos_s < anchors + t}
    for causal, mask in masks.items():
        want = mla_attend_absorbed(q_nope, q_rope, kv, jnp.broadcast_to(mask, (B, t, kv.shape[1])),
                                   w_uk, eye_uv, 0.3)
        got = mla_paged_reference(q_lat, q_rope, pages, table, positions, 0.3, causal=causal, row=1)
        _close(got, want, TOL_F32, f"causal={causal}")


def test_mla_paged_nothing_visible_gives_zero():
    q_lat, q_rope, pages, table, _ = _paged_inputs(jnp.float32, jnp.float32, 2)
    positions = jnp.full((B, 2), -1, jnp.int32)    # no key at position <= -1
    got = mla_paged_kernel(q_lat, q_rope, pages, table, positions, 0.3, causal=True, row=1, kv_splits=2,
                           interpret=True)
    assert np.all(np.asarray(got) == 0.0)


# ---------------------------------------------------------------------------------------------
# MLA prefill (expanded, causal)


def test_mla_prefill_matches_reference_and_layer():
    b, t, s, n, h, r, v = 2, 13, 21, 2, 16, 8, 16
    rng = np.random.default_rng(1)
    q_nope, q_rope = _normal(rng, (b, t, n, h)), _normal(rng, (b, t, n, r))
    k_nope, k_pe, val = _normal(rng, (b, s, n, h)), _normal(rng, (b, s, r)), _normal(rng, (b, s, n, v))
    # row 0: a later chunk (positions 8..20 over 21 cached keys); row 1: a fresh prompt (0..12)
    positions = jnp.stack([jnp.arange(t) + 8, jnp.arange(t)]).astype(jnp.int32)
    got = mla_prefill_kernel(q_nope, q_rope, k_nope, k_pe, val, positions, 0.25, block_q=16, block_k=8,
                             interpret=True)
    _close(got, mla_prefill_reference(q_nope, q_rope, k_nope, k_pe, val, positions, 0.25), TOL_F32, "prefill")

    # the reference is mla_attend_expanded's math: keys from latent rows through kv_b_proj
    c = 12
    kv = _normal(rng, (b, s, c + r))
    w_uk, w_uv = split_kv_b(_normal(rng, (n * (h + v), c), scale=0.3), n, h)
    k_nope = jnp.einsum("bsc,nhc->bsnh", kv[..., :c], w_uk)
    val = jnp.einsum("bsc,nvc->bsnv", kv[..., :c], w_uv)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    q_nope, q_rope = _normal(rng, (b, s, n, h)), _normal(rng, (b, s, n, r))
    want = mla_attend_expanded(q_nope, q_rope, kv, causal_mask(b, s), w_uk, w_uv, 0.25)
    _close(mla_prefill_reference(q_nope, q_rope, k_nope, kv[..., c:], val, pos, 0.25), want, TOL_F32, "layer")


# ---------------------------------------------------------------------------------------------
# KDA


def _kda_inputs(t: int, lower_bound, seed: int = 0, b: int = 2, h: int = 2, dk: int = 16, dv: int = 32):
    rng = np.random.default_rng(seed)
    q = l2_normalize(_normal(rng, (b, t, h, dk))) * dk ** -0.5
    k = l2_normalize(_normal(rng, (b, t, h, dk)))
    v = _normal(rng, (b, t, h, dv))
    a_log = jnp.log(jnp.linspace(1.0, 16.0, h))
    g = kda_gate(_normal(rng, (b, t, h, dk), scale=2.0), a_log, _normal(rng, (h, dk)), lower_bound)
    beta = jax.nn.sigmoid(_normal(rng, (b, t, h)))
    s0 = _normal(rng, (b, h, dk, dv), scale=0.5)
    return q, k, v, g, beta, s0


# Kimi-Linear's unbounded softplus gate reaches log-decays far below -88 (exp underflow / a
# factorised form would overflow); K3's bounded gate keeps them in (-5, 0).
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_chunked_matches_reference(lower_bound):
    t = 37                                           # 3 kernel chunks of 16, the last one padded
    args = _kda_inputs(t, lower_bound)
    o, s, snaps = kda_chunked_kernel(*args, interpret=True)
    ro, rs, _ = kda_chunked(*args)                   # the reference chunks by 64: another split
    assert snaps is None and o.shape == ro.shape and s.shape == rs.shape
    # fp32 recurrences over 37 tokens, O(1) values; summation order differs, ~1e-6
    _close(o, ro, TOL_F32, "o")
    _close(s, rs, TOL_F32, "state")
    _close(o, kda_recurrent(*args)[0], TOL_F32, "o vs recurrent")


def test_kda_recurrent_snapshots_match_reference():
    args = _kda_inputs(8, -5.0, seed=3)              # a verify step: T+1 = 8 tokens
    o, s, snaps = kda_recurrent_kernel(*args, return_snapshots=True, block_v=16, interpret=True)
    ro, rs, rsnaps = kda_recurrent(*args, return_snapshots=True)
    _close(o, ro, TOL_F32, "o")
    _close(s, rs, TOL_F32, "state")
    _close(snaps, rsnaps, TOL_F32, "snapshots")
    np.testing.assert_array_equal(np.asarray(snaps[:, -1]), np.asarray(s))


# ---------------------------------------------------------------------------------------------
# multi-anchor block-sparse attention (draft training)


# name -> (B, A, T, S, block_q, block_k, anchors, keep). The rows of one call hold the cases, so
# each shape compiles once.
_BS_CASES = {
    # blocks of 3 straddle 4-row query tiles and 8-row key tiles. Rows: anchor 0 (no context) and
    # S-1; a dropped anchor between kept ones; anchors at and past S (all context, clipped);
    # every anchor dropped (a row of padding only)
    "T3": (4, 3, 3, 10, 4, 8, [[0, 5, 9], [2, 4, 7], [8, 10, 12], [0, 0, 0]],
           [[1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 0]]),
    # the real block width 7 over key tiles of 4 (a block spans two of them), a context of 23 (no
    # tile multiple). Rows: consecutive anchors from 0 (overlapping positions); ragged keep and
    # an anchor at S-2, the last one training samples
    "T7": (2, 4, 7, 23, 8, 4, [[0, 1, 2, 3], [5, 12, 20, 21]], [[1, 1, 1, 1], [1, 0, 1, 1]]),
}
_BS_N, _BS_H, _BS_R, _BS_V, _BS_C = 2, 16, 8, 16, 32     # heads, nope / rope / v head dims, kv_lora


def _block_sparse_inputs(case: str, seed: int = 0):
    """Expanded-head inputs of the core kernel: (q_nope, q_rope, k_nope, k_pe, v), anchors, keep, tiles."""
    b, a, t, s, block_q, block_k, anchors, keep = _BS_CASES[case]
    n, h, r, v = _BS_N, _BS_H, _BS_R, _BS_V
    rng = np.random.default_rng(seed)
    q = a * t
    args = (_normal(rng, (b, q, n, h)), _normal(rng, (b, q, n, r)), _normal(rng, (b, s + q, n, h)),
            _normal(rng, (b, s + q, r)), _normal(rng, (b, s + q, n, v)))
    return args, jnp.asarray(anchors, jnp.int32), jnp.asarray(keep, bool), dict(block_q=block_q, block_k=block_k)


def _multi_anchor_inputs(case: str, seed: int = 0):
    """Latent inputs of training's form (q_nope, q_rope, kv_ctx, kv_blk, w_uk, w_uv), context
    lengths (anchor, 0 if dropped) and tiles; the core kernel sees the shapes of `case`."""
    b, a, t, s, block_q, block_k, anchors, keep = _BS_CASES[case]
    n, h, r, v, c = _BS_N, _BS_H, _BS_R, _BS_V, _BS_C
    rng = np.random.default_rng(seed)
    args = (_normal(rng, (b, a, t, n, h)), _normal(rng, (b, a, t, n, r)), _normal(rng, (b, s, c + r)),
            _normal(rng, (b, a, t, c + r)), _normal(rng, (n, h, c), scale=0.3), _normal(rng, (n, v, c), scale=0.3))
    ctx_len = jnp.where(jnp.asarray(keep, bool), jnp.asarray(anchors, jnp.int32), 0)
    return args, ctx_len, dict(block_q=block_q, block_k=block_k)


def test_block_sparse_mask_semantics():
    anchors = jnp.array([[1, 3]], jnp.int32)
    keep = jnp.array([[True, False]])
    m = np.asarray(block_sparse_mask(anchors, keep, 4, 2))[0].astype(int)
    np.testing.assert_array_equal(m, [[1, 0, 0, 0, 1, 1, 0, 0],      # anchor 1: context 0, own block
                                      [1, 0, 0, 0, 1, 1, 0, 0],
                                      [0, 0, 0, 0, 0, 0, 0, 0],      # dropped: nothing
                                      [0, 0, 0, 0, 0, 0, 0, 0]])


def _grads(fn, args, w):
    return jax.grad(lambda *x: jnp.sum(fn(*x) * w), argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("case", sorted(_BS_CASES))
def test_block_sparse_forward_and_gradient(case):
    args, anchors, keep, tiles = _block_sparse_inputs(case)
    scale = 0.3
    kernel = lambda *x: block_sparse_kernel(*x, anchors, keep, scale, **tiles, interpret=True)
    reference = jax.jit(lambda *x: block_sparse_reference(*x, anchors, keep, scale))
    out = kernel(*args)
    _close(out, reference(*args), TOL_F32, "forward")
    # the dropped anchors' rows are exactly zero
    dropped_BQ = np.repeat(~np.asarray(keep), _BS_CASES[case][2], axis=1)
    assert dropped_BQ.any() and np.all(np.asarray(out)[dropped_BQ] == 0.0)

    w = _normal(np.random.default_rng(9), out.shape)
    grads, want = _grads(kernel, args, w), jax.jit(lambda *x: _grads(reference, x, w))(*args)
    for name, g, gw in zip(("q_nope", "q_rope", "k_nope", "k_pe", "v"), grads, want):
        assert g.shape == gw.shape and np.all(np.isfinite(np.asarray(g)))
        _close(g, gw, TOL_F32, f"d{name}")


def test_multi_anchor_kernel_matches_training_attention():
    """The latent form training calls (dispatch.block_sparse_attention): keys / values lifted
    once per sequence through the kernel equal training's own absorbed attention with one batch
    row per block, forward and every gradient; dropped blocks (context length 0) see their own
    rows in both. Same core shapes and tiles as case T7: its kernel compiles are reused."""
    args, ctx_len, tiles = _multi_anchor_inputs("T7", seed=4)
    scale = 0.3
    kernel = lambda *x: multi_anchor_kernel(*x, ctx_len, scale, **tiles, interpret=True)
    reference = jax.jit(lambda *x: multi_anchor_reference(*x, ctx_len, scale))
    out = kernel(*args)
    assert out.shape == args[0].shape[:4] + (_BS_V,)
    _close(out, reference(*args), TOL_F32, "forward")
    w = _normal(np.random.default_rng(9), out.shape)
    grads, want = _grads(kernel, args, w), jax.jit(lambda *x: _grads(reference, x, w))(*args)
    for name, g, gw in zip(("q_nope", "q_rope", "kv_ctx", "kv_blk", "w_uk", "w_uv"), grads, want):
        assert g.shape == gw.shape and np.any(np.asarray(gw) != 0)
        _close(g, gw, TOL_F32, f"d{name}")


def test_multi_anchor_shared_context_is_the_reference_in_float64():
    """The form training runs without a kernel (one product over the shared context rows per
    sequence) equals the reference (a copy of the context per block), forward and every gradient,
    in float64; blocks with context length 0 (dropped) and S (everything) included."""
    rng = np.random.default_rng(3)
    b, a, t, n, h, r, c, v, s = 2, 5, 4, 3, 8, 4, 6, 7, 11
    with x64():
        args = tuple(jnp.asarray(rng.standard_normal(shape)) for shape in
                     ((b, a, t, n, h), (b, a, t, n, r), (b, s, c + r), (b, a, t, c + r), (n, h, c), (n, v, c)))
        ctx_len = jnp.asarray(rng.integers(1, s, (b, a))).at[0, 1].set(0).at[1, 2].set(s)
        shared = lambda *x: multi_anchor_shared(*x, ctx_len, 0.3)
        reference = lambda *x: multi_anchor_reference(*x, ctx_len, 0.3)
        out = jax.jit(shared)(*args)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(reference)(*args)), rtol=1e-12, atol=1e-12)
        w = jnp.asarray(rng.standard_normal(out.shape))
        grads = jax.jit(lambda *x: (_grads(shared, x, w), _grads(reference, x, w)))(*args)
        for name, g, gw in zip(("q_nope", "q_rope", "kv_ctx", "kv_blk", "w_uk", "w_uv"), *grads):
            assert np.any(np.asarray(gw) != 0), name
            np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-12, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------------------------------------
# dispatch


def test_dispatch_modes(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.kernel_mode() == "auto"
    assert dispatch.kernel_interpret() is None                       # CPU: reference
    monkeypatch.setenv(dispatch.ENV_VAR, "on")
    assert dispatch.kernel_interpret() is True                       # kernel, interpreted on CPU
    with dispatch.use_kernels("off"):                                # the context manager wins
        assert dispatch.kernel_interpret() is None
        with dispatch.use_kernels("interpret"):
            assert dispatch.kernel_interpret() is True
        assert dispatch.kernel_mode() == "off"
    monkeypatch.setenv(dispatch.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="DSPARK_KERNELS"):
        dispatch.kernel_mode()
    with pytest.raises(ValueError):
        with dispatch.use_kernels("always"):
            pass


def test_dispatch_routes_to_kernel_and_reference():
    """The entry points give the same numbers either way (kernels forced on = interpret here),
    also split over the heads of a mesh, gradients included; the dispatch records each path."""
    q_lat, q_rope, pages, table, positions = _paged_inputs(FP8, jnp.float32, 3)
    kda_args = _kda_inputs(37, -5.0, seed=5)       # the chunked test's shapes: cached compiles
    verify_args = tuple(x[:, :8] for x in kda_args[:5]) + kda_args[5:]
    bs_args = _block_sparse_inputs("T3", seed=2)[0]
    pf = [x[:2, :9] for x in bs_args[:2]] + [x[:2, :12] for x in bs_args[2:]]
    ma_args, ctx_len, _ = _multi_anchor_inputs("T3", seed=2)     # dispatch: the default tiles

    def run():
        return (dispatch.mla_paged_attention(q_lat, q_rope, pages, table, positions, 0.3, causal=False, row=1),
                dispatch.mla_prefill_attention(*pf, jnp.broadcast_to(jnp.arange(9) + 3, (2, 9)), 0.3),
                dispatch.kda_prefill(*kda_args)[:2],
                dispatch.kda_verify(*verify_args, return_snapshots=True),
                dispatch.block_sparse_attention(*ma_args, ctx_len, 0.3))

    with dispatch.use_kernels("off"):
        want = run()
    with dispatch.use_kernels("on"), dispatch.record_paths() as calls:
        got = run()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(g, w, TOL_F32, "dispatch")
    entries = ["mla_paged_attention", "mla_prefill_attention", "kda_prefill", "kda_verify", "block_sparse_attention"]
    assert calls == [dispatch.KernelCall(e, "kernel", 1) for e in entries]
    if jax.device_count() < 2:
        return
    # under a context mesh with the heads (2 everywhere here) on a tensor axis of 2: one kernel
    # per device on its own head, inside a shard_map, same numbers
    from dspark_jax.sharding import make_mesh

    with jax.set_mesh(make_mesh(tensor=2)), dispatch.use_kernels("on"), dispatch.record_paths() as calls:
        got = run()
    assert calls == [dispatch.KernelCall(e, "kernel", 2) for e in entries]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(g, w, TOL_F32, "dispatch under the mesh")

    # training differentiates the draft's attention: the replicated latent rows' gradient is
    # the sum over the devices' heads
    def grads():
        loss = lambda *a: jnp.sum(dispatch.block_sparse_attention(*a, ctx_len, 0.3) ** 2)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*ma_args)

    with dispatch.use_kernels("off"):
        want = grads()
    with jax.set_mesh(make_mesh(tensor=2)), dispatch.use_kernels("on"), dispatch.record_paths() as calls:
        got = grads()
    assert calls == [dispatch.KernelCall("block_sparse_attention", "kernel", 2)]
    for name, g, w in zip(("q_nope", "q_rope", "kv_ctx", "kv_blk", "w_uk", "w_uv"), got, want):
        _close(g, w, TOL_F32, f"d{name} under the mesh")


def test_mla_paged_auto_crossover(monkeypatch):
    """`auto` on a GPU runs the paged MLA kernel only for spans (block-table pages x page size)
    of at least `mla_paged_min_keys()` keys, the reference below; the numbers are the same either
    way. The GPU is simulated: `_on_gpu` patched, the kernel then run in interpret mode."""
    from dspark_jax.kernels import mla_paged

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.MLA_PAGED_MIN_KEYS_ENV, raising=False)
    # pages of 16 (a GPU compile needs dims >= 16), 2 sequences of 3 rows after 9 / 27 tokens
    rng = np.random.default_rng(11)
    pages = np.asarray(_normal(rng, (2, 6, 16, C + R)).astype(FP8))
    q_lat, q_rope = _normal(rng, (2, 3, N, C), scale=0.5), _normal(rng, (2, 3, N, R), scale=0.5)
    positions = (np.array([9, 27])[:, None] + np.arange(3)[None]).astype(np.int32)
    short = np.array([[4, 1], [0, 5]], np.int32)             # 2 pages of 16: a span of 32 keys
    long = np.concatenate([short, short[::-1]], axis=1)      # 64 keys (the extra ones masked)
    calls = []
    real_kernel = mla_paged.mla_paged_kernel

    def kernel(*args, interpret, **kw):
        calls.append(interpret)
        return real_kernel(*args, interpret=True, **kw)

    monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
    monkeypatch.setattr(mla_paged, "mla_paged_kernel", kernel)

    def run(tbl):
        del calls[:]
        out = dispatch.mla_paged_attention(q_lat, q_rope, pages, tbl, positions, 0.3, causal=True, row=1)
        return out, ("kernel" if calls else "reference")

    want = mla_paged_reference(q_lat, q_rope, pages, short, positions, 0.3, causal=True, row=1)
    with dispatch.use_kernels("auto"):
        assert dispatch.mla_paged_min_keys() == mla_paged.AUTO_MIN_KEYS == 32768
        assert run(long)[1] == "reference"                   # 64 keys << the H200 crossover
        with dispatch.mla_paged_min_keys_override(64):
            got_short, route_short = run(short)
            got_long, route_long = run(long)
        assert (route_short, route_long) == ("reference", "kernel")
        assert calls == [False]                              # a GPU compile: no interpret flag
        _close(got_short, want, TOL_F32, "below the crossover")
        _close(got_long, want, TOL_F32, "above the crossover")
        monkeypatch.setenv(dispatch.MLA_PAGED_MIN_KEYS_ENV, "32")   # the bound is inclusive
        assert dispatch.mla_paged_min_keys() == 32 and run(short)[1] == "kernel"
        with dispatch.mla_paged_min_keys_override(33):       # the override beats the env var
            assert run(short)[1] == "reference"
        monkeypatch.setenv(dispatch.MLA_PAGED_MIN_KEYS_ENV, "4k")
        with pytest.raises(ValueError, match="DSPARK_MLA_PAGED_MIN_KEYS='4k'"):
            run(short)
    with pytest.raises(ValueError, match="non-negative integer"):
        with dispatch.mla_paged_min_keys_override(-1):
            pass
    monkeypatch.delenv(dispatch.MLA_PAGED_MIN_KEYS_ENV)
    with dispatch.use_kernels("on"), dispatch.mla_paged_min_keys_override(10 ** 9):
        assert run(short)[1] == "kernel"                     # "on" forces the kernel at any span
    with dispatch.use_kernels("off"), dispatch.mla_paged_min_keys_override(0):
        assert run(long)[1] == "reference"
