"""The one place that decides Pallas kernel vs pure-JAX reference.

Modes (`use_kernels(mode)` inside a `with` block, else the env var DSPARK_KERNELS, else "auto"):
- "auto": kernels on GPU (CUDA or ROCm, Triton lowering), references elsewhere (CPU, TPU); the
  paged MLA decode kernel only from a crossover span measured on a GPU (`mla_paged_min_keys`):
  below it XLA's fusion of the reference is the faster of the two;
- "on": kernels everywhere (at every span), in interpret mode where there is no GPU;
- "off": references everywhere;
- "interpret": kernels in interpret mode everywhere (`pallas_call(..., interpret=True)`).
The mode is read when a function is traced: a jitted caller keeps the choice it was traced with.

Each entry point takes exactly the arguments of its reference. Kernels need power-of-2 head dims
and page size (>= 16 on GPU); other shapes fall back to the reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import jax

from dspark_jax.cache import as_values
from dspark_jax.kernels import block_sparse, kda_chunked, mla_paged, mla_prefill
from dspark_jax.kernels import kda_reference

MODES = ("auto", "on", "off", "interpret")
ENV_VAR = "DSPARK_KERNELS"
MLA_PAGED_MIN_KEYS_ENV = "DSPARK_MLA_PAGED_MIN_KEYS"
_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("dspark_kernels", default=None)
_min_keys: contextvars.ContextVar[int | None] = contextvars.ContextVar("dspark_mla_paged_min_keys", default=None)


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: expected one of {MODES} (env {ENV_VAR} or use_kernels)")
    return mode


def kernel_mode() -> str:
    """The active mode: `use_kernels` override, else $DSPARK_KERNELS, else "auto"."""
    mode = _override.get()
    if mode is None:
        mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    return _check(mode)


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Force a mode for the calls traced inside the block (tests, benchmarks)."""
    token = _override.set(_check(mode))
    try:
        yield
    finally:
        _override.reset(token)


def _check_min_keys(n, where: str) -> int:
    ok = (isinstance(n, int) and not isinstance(n, bool) and n >= 0) or (isinstance(n, str) and n.isdigit())
    if not ok:
        raise ValueError(f"{where}={n!r}: expected a non-negative integer (keys per sequence)")
    return int(n)


def mla_paged_min_keys() -> int:
    """`auto` mode runs the paged MLA kernel only when a sequence's span (block-table pages x page
    size) holds at least this many keys; shorter spans use the reference. The
    `mla_paged_min_keys_override` value, else $DSPARK_MLA_PAGED_MIN_KEYS, else
    `mla_paged.AUTO_MIN_KEYS` (measured on an H200, see there). Modes "on" and "interpret"
    ignore it (the kernel at every span)."""
    n = _min_keys.get()
    if n is not None:
        return n
    raw = os.environ.get(MLA_PAGED_MIN_KEYS_ENV, "").strip()
    return _check_min_keys(raw, f"${MLA_PAGED_MIN_KEYS_ENV}") if raw else mla_paged.AUTO_MIN_KEYS


@contextlib.contextmanager
def mla_paged_min_keys_override(min_keys: int) -> Iterator[None]:
    """Set the `auto` crossover span for the calls traced inside the block (0: the kernel at
    every span, as before the crossover existed)."""
    token = _min_keys.set(_check_min_keys(min_keys, "min_keys"))
    try:
        yield
    finally:
        _min_keys.reset(token)


def _on_gpu() -> bool:
    return jax.default_backend() in _GPU_BACKENDS


def kernel_interpret() -> bool | None:
    """None: use the reference; else run the kernel with this `interpret` flag."""
    mode = kernel_mode()
    if mode == "off" or (mode == "auto" and not _on_gpu()):
        return None
    return mode == "interpret" or not _on_gpu()


def _fits(interpret: bool, *dims: int) -> bool:
    """Kernel tiles need power-of-2 dims, and on GPU >= 16 (Triton's smallest dot)."""
    return all(d > 0 and d & (d - 1) == 0 and (interpret or d >= 16) for d in dims)


# ---------------------------------------------------------------------------------------------
# entry points (signatures = the references')


def mla_paged_attention(q_lat_BTNC: jax.Array, q_rope_BTNR: jax.Array, pages: jax.Array,
                        block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                        causal: bool, row: int | None = None) -> jax.Array:
    """Latent MLA attention over the paged pool -> latent context [B,T,N,C] (see mla_paged).
    In `auto` mode spans shorter than `mla_paged_min_keys()` keys use the reference."""
    interpret = kernel_interpret()
    span = block_table_BP.shape[1] * pages.shape[-2]        # static: keys the step may attend to
    if (interpret is None or not _fits(interpret, q_lat_BTNC.shape[-1], q_rope_BTNR.shape[-1], pages.shape[-2])
            or (kernel_mode() == "auto" and span < mla_paged_min_keys())):
        # the reference reads bit-pattern storage itself (PagedPool.read: gather, then bitcast),
        # so no conversion touches pages outside the span
        return mla_paged.mla_paged_reference(q_lat_BTNC, q_rope_BTNR, pages, block_table_BP, positions_BT,
                                             scale, causal=causal, row=row)
    return mla_paged.mla_paged_kernel(q_lat_BTNC, q_rope_BTNR, as_values(pages), block_table_BP, positions_BT,
                                      scale, causal=causal, row=row, interpret=interpret)


def mla_prefill_attention(q_nope_BTNH: jax.Array, q_rope_BTNR: jax.Array, k_nope_BSNH: jax.Array,
                          k_pe_BSR: jax.Array, v_BSNV: jax.Array, positions_BT: jax.Array,
                          scale: float) -> jax.Array:
    """Causal expanded-MLA attention over keys 0..S-1 -> [B,T,N,V] (see mla_prefill)."""
    interpret = kernel_interpret()
    args = (q_nope_BTNH, q_rope_BTNR, k_nope_BSNH, k_pe_BSR, v_BSNV, positions_BT, scale)
    if interpret is None or not _fits(interpret, q_nope_BTNH.shape[-1], q_rope_BTNR.shape[-1], v_BSNV.shape[-1]):
        return mla_prefill.mla_prefill_reference(*args)
    return mla_prefill.mla_prefill_kernel(*args, interpret=interpret)


def kda_prefill(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *, chunk_size: int = 64,
                return_snapshots: bool = False):
    """`kda_reference.kda_chunked` (the chunked kernel has no snapshot output: with
    return_snapshots the reference runs)."""
    interpret = kernel_interpret()
    args = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)
    if interpret is None or return_snapshots or not _fits(interpret, k_BTHK.shape[-1], v_BTHV.shape[-1]):
        return kda_reference.kda_chunked(*args, chunk_size=chunk_size, return_snapshots=return_snapshots)
    return kda_chunked.kda_chunked_kernel(*args, interpret=interpret)


def kda_verify(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
               return_snapshots: bool = False):
    """`kda_reference.kda_recurrent` (the verify step: state snapshot after every token)."""
    interpret = kernel_interpret()
    args = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)
    if interpret is None or not _fits(interpret, k_BTHK.shape[-1], v_BTHV.shape[-1]):
        return kda_reference.kda_recurrent(*args, return_snapshots=return_snapshots)
    return kda_chunked.kda_recurrent_kernel(*args, return_snapshots=return_snapshots, interpret=interpret)


def block_sparse_attention(q_nope_BATNH: jax.Array, q_rope_BATNR: jax.Array, kv_ctx_BSL: jax.Array,
                           kv_blk_BATL: jax.Array, w_uk_NHC: jax.Array, w_uv_NVC: jax.Array,
                           ctx_len_BA: jax.Array, scale: float) -> jax.Array:
    """Draft training's multi-anchor attention -> [B, A, T, N, V], differentiable: block a sees
    context rows < ctx_len[a] and its own rows (see block_sparse.multi_anchor_reference; without a
    kernel: block_sparse.multi_anchor_shared, the same attention)."""
    interpret = kernel_interpret()
    args = (q_nope_BATNH, q_rope_BATNR, kv_ctx_BSL, kv_blk_BATL, w_uk_NHC, w_uv_NVC, ctx_len_BA, scale)
    if interpret is None or not _fits(interpret, q_nope_BATNH.shape[-1], q_rope_BATNR.shape[-1], w_uv_NVC.shape[1]):
        return block_sparse.multi_anchor_shared(*args)
    return block_sparse.multi_anchor_kernel(*args, interpret=interpret)
