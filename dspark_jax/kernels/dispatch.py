"""The one place that decides Pallas kernel vs pure-JAX reference.

Modes (`use_kernels(mode)` inside a `with` block, else the env var DSPARK_KERNELS, else "auto"):
- "auto": kernels on GPU (Triton lowering: CUDA, run on an H200; ROCm, not run yet), references elsewhere; the
  paged MLA decode kernel only for block tables of at least a crossover measured on a GPU
  (`mla_paged_min_keys`), below it the reference read chunk by chunk (`mla_paged_chunked`);
- "on": kernels everywhere (at every table width), in interpret mode where there is no GPU;
- "off": references everywhere;
- "interpret": kernels in interpret mode everywhere (`pallas_call(..., interpret=True)`).
The mode is read when a function is traced: a jitted caller keeps the choice it was traced with.

Each entry point takes exactly the arguments of its reference. Kernels need power-of-2 head dims
and page size (>= 16 on GPU); other shapes fall back to the reference.

Under a mesh whose "tensor" axis shards the heads (the rules table in `sharding`), a kernel runs
inside `jax.shard_map` over that axis, one kernel per device on its own heads: GSPMD does not
partition a `pallas_call`, it would gather the heads and run the whole kernel on every device.
The mesh is found as the MoE finds its EP mesh: the context mesh (`jax.set_mesh`), else the mesh
carried by the inputs' types (activations projected by sharded weights carry it), so callers pass
nothing new. Inputs that every head reads (the latent pool, the shared rope key) are replicated.
`record_paths()` lists which path each traced call took.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
from jax.sharding import PartitionSpec as P

from dspark_jax.cache import as_values
from dspark_jax.kernels import block_sparse, kda_chunked, kda_reference, mla_paged, mla_prefill

MODES = ("auto", "on", "off", "interpret")
ENV_VAR = "DSPARK_KERNELS"
MLA_PAGED_MIN_KEYS_ENV = "DSPARK_MLA_PAGED_MIN_KEYS"
_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("dspark_kernels", default=None)
_min_keys: contextvars.ContextVar[int | None] = contextvars.ContextVar("dspark_mla_paged_min_keys", default=None)
_log: contextvars.ContextVar[list | None] = contextvars.ContextVar("dspark_kernel_log", default=None)
HEAD_AXIS = "tensor"      # the mesh axis the rules table puts "heads" on


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
    """`auto` mode runs the paged MLA kernel only when a sequence's block table (pages x page size)
    holds at least this many keys; shorter tables use the reference. The
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


class KernelCall(NamedTuple):
    """One traced dispatch call: the entry point, "kernel" or "reference", and over how many
    devices the heads were split (1: the kernel ran whole; always 1 for the reference, which
    GSPMD partitions itself)."""
    entry: str
    path: str
    head_shards: int


@contextlib.contextmanager
def record_paths() -> Iterator[list[KernelCall]]:
    """Collect a `KernelCall` for every dispatch call traced inside the block (a jitted function
    already compiled outside it is not traced again, so it records nothing)."""
    token = _log.set([])
    try:
        yield _log.get()
    finally:
        _log.reset(token)


def _record(entry: str, path: str, head_shards: int = 1) -> None:
    log = _log.get()
    if log is not None:
        log.append(KernelCall(entry, path, head_shards))


def _head_mesh(xs: Sequence, heads: int):
    """The mesh to split the heads over, or None: the context mesh, else the first input whose
    type carries a mesh; None without a "tensor" axis > 1 dividing `heads`, or inside a caller's
    shard_map already manual over it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        for x in xs:
            m = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if m is not None and not m.empty:
                mesh = m
                break
    if mesh.empty or HEAD_AXIS not in mesh.axis_names or HEAD_AXIS in mesh.manual_axes:
        return None
    n = mesh.shape[HEAD_AXIS]
    return mesh if n > 1 and heads % n == 0 else None


def _head_spec(ndim: int, axis: int | None) -> P:
    """Heads of a rank-`ndim` array at `axis` on the tensor axis; None: replicated."""
    if axis is None:
        return P()
    return P(*(HEAD_AXIS if i == axis % ndim else None for i in range(ndim)))


def _run_kernel(entry: str, kernel: Callable, args: Sequence[jax.Array], head_axes: Sequence[int | None],
                outs: Sequence[tuple[int, int]], heads: int):
    """`kernel(*args)` (a tuple of arrays out, each (rank, head axis) in `outs`), inside a
    shard_map over the heads when a mesh shards them. Only the tensor axis is manual, as in the
    MoE: a data/fsdp split of the batch stays with the compiler."""
    mesh = _head_mesh(args, heads)
    if mesh is None:
        _record(entry, "kernel")
        return kernel(*args)
    _record(entry, "kernel", mesh.shape[HEAD_AXIS])
    in_specs = tuple(_head_spec(a.ndim, ax) for a, ax in zip(args, head_axes))
    out_specs = tuple(_head_spec(ndim, ax) for ndim, ax in outs)
    # pallas_call carries no varying-axes typing; every output is per-head (no collectives).
    # jit: an eager shard_map manual over only some axes is refused (JAX 0.10); inside a
    # caller's jit this is an inline call
    return jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 axis_names={HEAD_AXIS}, check_vma=False))(*args)


def _fits(interpret: bool, *dims: int) -> bool:
    """Kernel tiles need power-of-2 dims, and on GPU >= 16 (Triton's smallest dot)."""
    return all(d > 0 and d & (d - 1) == 0 and (interpret or d >= 16) for d in dims)


# ---------------------------------------------------------------------------------------------
# entry points (signatures = the references')


def mla_paged_attention(q_lat_BTNC: jax.Array, q_rope_BTNR: jax.Array, pages: jax.Array,
                        block_table_BP: jax.Array, positions_BT: jax.Array, scale: float, *,
                        causal: bool, row: int | None = None) -> jax.Array:
    """Latent MLA attention over the paged pool -> latent context [B,T,N,C] (see mla_paged).
    In `auto` mode tables shorter than `mla_paged_min_keys()` keys use the reference, read chunk by
    chunk as far as the longest query reaches (`mla_paged.mla_paged_chunked`). Heads split
    over the mesh; the pool (every head reads every latent row) and the block table replicated."""
    interpret = kernel_interpret()
    span = block_table_BP.shape[1] * pages.shape[-2]        # static: keys the step may attend to
    if (interpret is None or not _fits(interpret, q_lat_BTNC.shape[-1], q_rope_BTNR.shape[-1], pages.shape[-2])
            or (kernel_mode() == "auto" and span < mla_paged_min_keys())):
        # the reference reads bit-pattern storage itself (PagedPool.fold_keys: gather, then
        # bitcast), chunk by chunk up to the longest query's limit
        _record("mla_paged_attention", "reference")
        return mla_paged.mla_paged_chunked(q_lat_BTNC, q_rope_BTNR, pages, block_table_BP, positions_BT,
                                           scale, causal=causal, row=row)
    kernel = lambda *a: (mla_paged.mla_paged_kernel(*a, scale, causal=causal, row=row, interpret=interpret),)
    args = (q_lat_BTNC, q_rope_BTNR, as_values(pages), block_table_BP, positions_BT)
    return _run_kernel("mla_paged_attention", kernel, args, (2, 2, None, None, None), ((4, 2),),
                       q_lat_BTNC.shape[2])[0]


def mla_prefill_attention(q_nope_BTNH: jax.Array, q_rope_BTNR: jax.Array, k_nope_BSNH: jax.Array,
                          k_pe_BSR: jax.Array, v_BSNV: jax.Array, positions_BT: jax.Array,
                          scale: float) -> jax.Array:
    """Causal expanded-MLA attention over keys 0..S-1 -> [B,T,N,V] (see mla_prefill). Heads split
    over the mesh; the shared rope key k_pe replicated."""
    interpret = kernel_interpret()
    args = (q_nope_BTNH, q_rope_BTNR, k_nope_BSNH, k_pe_BSR, v_BSNV, positions_BT)
    if interpret is None or not _fits(interpret, q_nope_BTNH.shape[-1], q_rope_BTNR.shape[-1], v_BSNV.shape[-1]):
        _record("mla_prefill_attention", "reference")
        return mla_prefill.mla_prefill_reference(*args, scale)
    kernel = lambda *a: (mla_prefill.mla_prefill_kernel(*a, scale, interpret=interpret),)
    return _run_kernel("mla_prefill_attention", kernel, args, (2, 2, 2, None, 2, None), ((4, 2),),
                       q_nope_BTNH.shape[2])[0]


# KDA inputs: q, k, v, g [B,T,H,*], beta [B,T,H], state [B,H,K,V]: heads at axis 2, the state's at 1
_KDA_HEAD_AXES = (2, 2, 2, 2, 2, 1)
_KDA_OUTS = ((4, 2), (4, 1))    # o [B,T,H,V], state [B,H,K,V] (+ snapshots [B,T,H,K,V])


def kda_prefill(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *, chunk_size: int = 64,
                return_snapshots: bool = False):
    """`kda_reference.kda_chunked` (the chunked kernel has no snapshot output: with
    return_snapshots the reference runs). Heads split over the mesh."""
    interpret = kernel_interpret()
    args = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)
    if interpret is None or return_snapshots or not _fits(interpret, k_BTHK.shape[-1], v_BTHV.shape[-1]):
        _record("kda_prefill", "reference")
        return kda_reference.kda_chunked(*args, chunk_size=chunk_size, return_snapshots=return_snapshots)
    kernel = lambda *a: kda_chunked.kda_chunked_kernel(*a, interpret=interpret)[:2]
    o, state = _run_kernel("kda_prefill", kernel, args, _KDA_HEAD_AXES, _KDA_OUTS, k_BTHK.shape[2])
    return o, state, None


def kda_verify(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV, *,
               return_snapshots: bool = False):
    """`kda_reference.kda_recurrent` (the verify step: state snapshot after every token). Heads
    split over the mesh."""
    interpret = kernel_interpret()
    args = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, initial_state_BHKV)
    if interpret is None or not _fits(interpret, k_BTHK.shape[-1], v_BTHV.shape[-1]):
        _record("kda_verify", "reference")
        return kda_reference.kda_recurrent(*args, return_snapshots=return_snapshots)
    if return_snapshots:
        kernel = lambda *a: kda_chunked.kda_recurrent_kernel(*a, return_snapshots=True, interpret=interpret)
        return _run_kernel("kda_verify", kernel, args, _KDA_HEAD_AXES, _KDA_OUTS + ((5, 2),), k_BTHK.shape[2])
    kernel = lambda *a: kda_chunked.kda_recurrent_kernel(*a, interpret=interpret)[:2]
    o, state = _run_kernel("kda_verify", kernel, args, _KDA_HEAD_AXES, _KDA_OUTS, k_BTHK.shape[2])
    return o, state, None


def block_sparse_attention(q_nope_BATNH: jax.Array, q_rope_BATNR: jax.Array, kv_ctx_BSL: jax.Array,
                           kv_blk_BATL: jax.Array, w_uk_NHC: jax.Array, w_uv_NVC: jax.Array,
                           ctx_len_BA: jax.Array, scale: float) -> jax.Array:
    """Draft training's multi-anchor attention -> [B, A, T, N, V], differentiable: block a sees
    context rows < ctx_len[a] and its own rows (see block_sparse.multi_anchor_reference; without a
    kernel: block_sparse.multi_anchor_shared, the same attention). Heads split over the mesh; the
    latent rows (kv_ctx, kv_blk) replicated."""
    interpret = kernel_interpret()
    args = (q_nope_BATNH, q_rope_BATNR, kv_ctx_BSL, kv_blk_BATL, w_uk_NHC, w_uv_NVC, ctx_len_BA)
    if interpret is None or not _fits(interpret, q_nope_BATNH.shape[-1], q_rope_BATNR.shape[-1], w_uv_NVC.shape[1]):
        _record("block_sparse_attention", "reference")
        return block_sparse.multi_anchor_shared(*args, scale)
    kernel = lambda *a: (block_sparse.multi_anchor_kernel(*a, scale, interpret=interpret),)
    return _run_kernel("block_sparse_attention", kernel, args, (3, 3, None, None, 0, 0, None), ((5, 3),),
                       q_nope_BATNH.shape[3])[0]
