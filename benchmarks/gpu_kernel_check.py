"""Pallas kernels vs their pure-JAX references: correctness and speed on a GPU.

    python -m benchmarks.gpu_kernel_check              # defaults
    python -m benchmarks.gpu_kernel_check --tune       # also time a few other tile settings
    python -m benchmarks.gpu_kernel_check --only mla_paged,kda
    python -m benchmarks.gpu_kernel_check --crossover --only none   # only the paged-MLA crossover sweep

On a GPU (CUDA or ROCm) every kernel is compiled with the Triton lowering, compared with its
reference on K3-like shapes (MLA: 64 / 96 heads, 512 + 64 latent, pages of 128, bf16 and fp8
caches; KDA: 96 heads of 128; draft training: 64 heads, blocks of 7, forward and backward, also in
the latent form training calls) and timed; one line per shape with both times and the kernel /
reference ratio. Without a GPU it says so, lowers every kernel to Triton IR for CUDA and ROCm at
those shapes (no GPU needed for that step), and compares kernels with references in interpret mode
on tiny shapes. Exit status 1 on any mismatch or error.

`--crossover` also sweeps the paged MLA decode kernel against its reference as `auto` runs it below
the crossover (`mla_paged_chunked`, key chunk by key chunk) over spans (block-table keys per
sequence: 64k down to 1k on a GPU, for verify and draft-block shapes, bf16 and fp8 caches) and
reports the crossover: the smallest measured span from which the kernel is never slower, i.e. the
value for `mla_paged.AUTO_MIN_KEYS` / $DSPARK_MLA_PAGED_MIN_KEYS, and whether `auto` with the
current value is ever slower than the reference. `--output_json FILE` writes every result.

One file although it is a little over 450 lines: each kernel group's cases beside the one timing
harness they share.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dspark_jax.bench.crossover import auto_choice, crossover_report
from dspark_jax.cache import FP8
from dspark_jax.kernels import dispatch
from dspark_jax.kernels.block_sparse import (block_sparse_kernel, block_sparse_reference, multi_anchor_kernel,
                                             multi_anchor_reference)
from dspark_jax.kernels.kda_chunked import kda_chunked_kernel, kda_recurrent_kernel
from dspark_jax.kernels.mla_paged import mla_paged_chunked, mla_paged_kernel, mla_paged_reference
from dspark_jax.kernels.mla_prefill import mla_prefill_kernel, mla_prefill_reference
from dspark_jax.kernels.kda_reference import kda_chunked, kda_recurrent
from dspark_jax.layers.kda import kda_gate, l2_normalize

_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per function (after a compile/warm-up call)")
_TUNE = flags.DEFINE_boolean("tune", False, "also time alternative tile settings of each kernel")
_ONLY = flags.DEFINE_list("only", [], "run only these groups: mla_paged, mla_prefill, kda, block_sparse "
                          "(`none`: no group, e.g. with --crossover)")
_MATCH = flags.DEFINE_string("match", "", "run only the cases whose name contains this string")
_LOWER = flags.DEFINE_boolean("lower", True, "without a GPU: also lower every kernel to Triton IR at K3 shapes")
_CROSSOVER = flags.DEFINE_boolean("crossover", False, "also sweep the paged MLA kernel against its reference "
                                  "over spans and report the crossover span for `auto`")
_SPANS = flags.DEFINE_list("crossover_spans", [], "spans (keys per sequence) to sweep; default 65536 down to "
                           "1024 on a GPU, 256 down to 64 without one")
_FULL = flags.DEFINE_boolean("crossover_full", False, "sweep every span (default: stop below the largest "
                             "span at which the kernel lost for some shape: the crossover is above it)")
_JSON = flags.DEFINE_string("output_json", None, "write every result here (JSON)")
_TINY = flags.DEFINE_boolean("tiny", False, "tiny shapes in interpret mode even on a GPU (tests)")


@dataclasses.dataclass
class Case:
    group: str
    name: str
    kernel: Callable          # args -> output pytree
    reference: Callable
    args: tuple
    tol: float                # max |kernel - reference| / max |reference|, per output leaf
    tune: dict[str, Callable] = dataclasses.field(default_factory=dict)   # label -> kernel variant


# ---------------------------------------------------------------------------------------------
# cases (tiny=True: CPU interpret mode: K3 head dims and the default tiles, few heads and keys)


def _tol(tiny: bool, gpu_tol: float) -> float:
    """f32 interpret mode on CPU differs from the reference only in summation order; on GPU the
    bf16 / TF32 tile products differ from XLA's by a few bf16 ulps of the output scale."""
    return 1e-4 if tiny else gpu_tol


def _rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def mla_paged_cases(tiny: bool, interpret: bool) -> list[Case]:
    if tiny:   # K3 row width and page, default tiles (4 key tiles per page), few heads / keys
        configs = [(2, 8, 4, 512, 64, 128, 300, True), (2, 7, 2, 512, 64, 128, 200, False)]
    else:   # (B, T, heads, C, R, page, context, causal): verify = T+1 = 8 rows, draft block = 7
        configs = [(1, 8, 96, 512, 64, 128, 4096, True), (8, 8, 96, 512, 64, 128, 2048, True),
                   (1, 8, 12, 512, 64, 128, 32768, True), (4, 7, 64, 512, 64, 128, 4096, False)]
    cases = []
    for b, t, n, c, r, page, ctx, causal in configs:
        for cache in (jnp.bfloat16, FP8):
            rng = np.random.default_rng(0)
            per_seq = -(-(ctx + t) // page)
            num_pages = b * per_seq + 1
            table = jnp.asarray(rng.permutation(num_pages)[:b * per_seq].reshape(b, per_seq), jnp.int32)
            pages = _rand(rng, (2, num_pages, page, c + r)).astype(cache)
            lens = rng.integers(ctx // 2, ctx + 1, size=b)                  # ragged contexts
            positions = jnp.asarray(lens[:, None] + np.arange(t)[None], jnp.int32)
            q = jnp.bfloat16 if not tiny else jnp.float32
            args = (_rand(rng, (b, t, n, c), q, 0.5), _rand(rng, (b, t, n, r), q, 0.5), pages, table, positions)
            scale = (c + r) ** -0.5

            def kern(**kw):
                return jax.jit(lambda *a: mla_paged_kernel(*a, scale, causal=causal, row=1, interpret=interpret,
                                                           **kw))

            ref = jax.jit(lambda *a: mla_paged_reference(*a, scale, causal=causal, row=1))
            tune = {f"bm{bm}_bk{bk}_w{w}": kern(block_m=bm, block_k=bk, num_warps=w)
                    for bm, bk, w in ((16, 64, 8), (32, 32, 8), (32, 64, 8), (16, 32, 4))}
            cases.append(Case("mla_paged", f"B{b} T{t} N{n} ctx{ctx} {'verify' if causal else 'block'} "
                              f"{jnp.dtype(cache).name}", kern(), ref, args, _tol(tiny, 2e-2), tune))
    return cases


def mla_prefill_cases(tiny: bool, interpret: bool) -> list[Case]:
    # (B, T new rows, S keys, heads, H, R, V): a fresh prompt, and a later chunk over a longer cache
    configs = ([(2, 100, 160, 2, 128, 64, 128)] if tiny else
               [(1, 2048, 2048, 96, 128, 64, 128), (1, 512, 4096, 64, 128, 64, 128)])
    cases = []
    for b, t, s, n, h, r, v in configs:
        rng = np.random.default_rng(1)
        dt = jnp.float32 if tiny else jnp.bfloat16
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t), (b, t))
        args = (_rand(rng, (b, t, n, h), dt), _rand(rng, (b, t, n, r), dt), _rand(rng, (b, s, n, h), dt),
                _rand(rng, (b, s, r), dt), _rand(rng, (b, s, n, v), dt), positions)
        scale = (h + r) ** -0.5

        def kern(**kw):
            return jax.jit(lambda *a: mla_prefill_kernel(*a, scale, interpret=interpret, **kw))

        tune = {f"bq{bq}_bk{bk}_w{w}": kern(block_q=bq, block_k=bk, num_warps=w)
                for bq, bk, w in ((64, 64, 8), (128, 32, 8), (32, 32, 4))}
        cases.append(Case("mla_prefill", f"B{b} T{t} S{s} N{n}", kern(),
                          jax.jit(lambda *a: mla_prefill_reference(*a, scale)), args, _tol(tiny, 2e-2), tune))
    return cases


def _kda_args(rng, b: int, t: int, h: int, d: int) -> tuple:
    q = l2_normalize(_rand(rng, (b, t, h, d))) * d ** -0.5
    k = l2_normalize(_rand(rng, (b, t, h, d)))
    g = kda_gate(_rand(rng, (b, t, h, d)), jnp.log(jnp.linspace(1.0, 16.0, h)), _rand(rng, (h, d), scale=0.5),
                 -5.0)                                                     # K3's bounded gate
    return (q, k, _rand(rng, (b, t, h, d)), g, jax.nn.sigmoid(_rand(rng, (b, t, h))),
            _rand(rng, (b, h, d, d), scale=0.1))


def kda_cases(tiny: bool, interpret: bool) -> list[Case]:
    h, d = (2, 128) if tiny else (96, 128)
    rng = np.random.default_rng(2)
    b, t = (1, 40) if tiny else (1, 4096)
    args = _kda_args(rng, b, t, h, d)

    def chunked(**kw):
        return jax.jit(lambda *a: kda_chunked_kernel(*a, interpret=interpret, **kw)[:2])

    cases = [Case("kda", f"chunked prefill B{b} T{t} H{h} K=V={d}", chunked(),
                  jax.jit(lambda *a: kda_chunked(*a)[:2]), args, _tol(tiny, 2e-2),
                  {f"bv{bv}_c{c}_w{w}": chunked(block_v=bv, chunk=c, num_warps=w)
                   for bv, c, w in ((32, 16, 8), (64, 16, 4), (64, 32, 8))})]

    def recurrent(**kw):
        return jax.jit(lambda *a: kda_recurrent_kernel(*a, return_snapshots=True, interpret=interpret, **kw))

    b = 2 if tiny else 8                                                    # verify: T+1 = 8 tokens
    cases.append(Case("kda", f"verify+snapshots B{b} T8 H{h}", recurrent(),
                      jax.jit(lambda *a: kda_recurrent(*a, return_snapshots=True)), _kda_args(rng, b, 8, h, d),
                      _tol(tiny, 2e-2),
                      {f"bv{bv}_w{w}": recurrent(block_v=bv, num_warps=w) for bv, w in ((32, 4), (128, 8))}))
    return cases


def block_sparse_cases(tiny: bool, interpret: bool) -> list[Case]:
    b, a, t, s, n, h, r, v = (1, 10, 7, 64, 2, 128, 64, 128) if tiny else (1, 128, 7, 2048, 64, 128, 64, 128)
    rng = np.random.default_rng(3)
    dt = jnp.float32 if tiny else jnp.bfloat16
    q = a * t
    anchors = jnp.asarray(np.sort(rng.choice(s - t, size=(b, a), replace=False), axis=1), jnp.int32)
    keep = jnp.asarray(rng.random((b, a)) < 0.9)
    args = (_rand(rng, (b, q, n, h), dt), _rand(rng, (b, q, n, r), dt), _rand(rng, (b, s + q, n, h), dt),
            _rand(rng, (b, s + q, r), dt), _rand(rng, (b, s + q, n, v), dt))
    w = _rand(rng, (b, q, n, v))
    scale = (h + r) ** -0.5
    kern = lambda **kw: (lambda *x: block_sparse_kernel(*x, anchors, keep, scale, interpret=interpret, **kw))
    ref = lambda *x: block_sparse_reference(*x, anchors, keep, scale)
    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w), argnums=tuple(range(5))))
    tiles = ((64, 64, 8), (32, 32, 4), (128, 32, 8))
    return [Case("block_sparse", f"fwd B{b} A{a} T{t} S{s} N{n}", jax.jit(kern()), jax.jit(ref), args,
                 _tol(tiny, 2e-2), {f"bq{bq}_bk{bk}_w{nw}": jax.jit(kern(block_q=bq, block_k=bk, num_warps=nw))
                        for bq, bk, nw in tiles}),
            Case("block_sparse", f"fwd+bwd B{b} A{a} T{t} S{s} N{n}", grad(kern()), grad(ref), args,
                 _tol(tiny, 5e-2), {f"bq{bq}_bk{bk}_w{nw}": grad(kern(block_q=bq, block_k=bk, num_warps=nw))
                        for bq, bk, nw in tiles}),
            _training_case(tiny, interpret, tiles)]


def _training_case(tiny: bool, interpret: bool, tiles) -> Case:
    """What training runs per draft layer (dispatch.block_sparse_attention, forward + backward
    into queries, latent rows and kv_b_proj): the kernel path (rows lifted to heads once per
    sequence) against training's own reference (absorbed MLA, one batch row per block).
    GPU: the K3 draft's default 512 anchors of 7 over a 2048-token sequence."""
    b, a, t, s, n, c = (1, 10, 7, 64, 2, 512) if tiny else (1, 512, 7, 2048, 64, 512)
    h, r, v = 128, 64, 128
    rng = np.random.default_rng(4)
    dt = jnp.float32 if tiny else jnp.bfloat16
    anchors = np.sort(rng.choice(s - 1, size=(b, a), replace=False), axis=1)
    ctx_len = jnp.asarray(np.where(rng.random((b, a)) < 0.9, anchors, 0), jnp.int32)   # 0: dropped
    args = (_rand(rng, (b, a, t, n, h), dt), _rand(rng, (b, a, t, n, r), dt), _rand(rng, (b, s, c + r), dt),
            _rand(rng, (b, a, t, c + r), dt), _rand(rng, (n, h, c), dt, c ** -0.5),
            _rand(rng, (n, v, c), dt, c ** -0.5))
    w = _rand(rng, (b, a, t, n, v))
    scale = (h + r) ** -0.5
    grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w), argnums=tuple(range(6))))
    kern = lambda **kw: grad(lambda *x: multi_anchor_kernel(*x, ctx_len, scale, interpret=interpret, **kw))
    return Case("block_sparse", f"train fwd+bwd B{b} A{a} T{t} S{s} N{n}", kern(),
                grad(lambda *x: multi_anchor_reference(*x, ctx_len, scale)), args, _tol(tiny, 5e-2),
                {f"bq{bq}_bk{bk}_w{nw}": kern(block_q=bq, block_k=bk, num_warps=nw) for bq, bk, nw in tiles})


GROUPS = {"mla_paged": mla_paged_cases, "mla_prefill": mla_prefill_cases, "kda": kda_cases,
          "block_sparse": block_sparse_cases}


# ---------------------------------------------------------------------------------------------
# running


def _block(tree):
    return jax.tree.map(lambda x: x.block_until_ready(), tree)


def _timed(fn, args, iters: int) -> tuple[object, float, float]:
    """(output, first-call seconds incl. compile, median seconds of `iters` further calls)."""
    t0 = time.perf_counter()
    out = _block(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _block(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, first, statistics.median(times) if times else float("nan")


def _error(got, want) -> float:
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.shape != w.shape:
            return float("inf")
        errs.append(float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-6))
    return max(errs)


def run_case(case: Case, iters: int, tune: bool, timing: bool) -> tuple[bool, dict]:
    """Compare (and time) one case; prints one line. Returns (ok, a JSON-able record)."""
    rec = {"group": case.group, "name": case.name, "tol": case.tol}
    try:
        want, _, t_ref = _timed(case.reference, case.args, iters if timing else 0)
        got, t_first, t_kernel = _timed(case.kernel, case.args, iters if timing else 0)
    except Exception as e:   # a kernel that does not compile / run is a failure to report, not a crash
        print(f"[FAIL] {case.group:12s} {case.name}: error\n{traceback.format_exc()}", flush=True)
        return False, rec | {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                             if str(e) else type(e).__name__}
    err = _error(got, want)
    ok = err <= case.tol
    rec |= {"ok": ok, "err": err}
    line = f"[{'ok' if ok else 'FAIL'}] {case.group:12s} {case.name:42s} err {err:.2e} (tol {case.tol:.0e})"
    if timing:
        rec |= {"kernel_ms": t_kernel * 1e3, "reference_ms": t_ref * 1e3, "ratio": t_kernel / t_ref,
                "first_call_s": t_first}
        line += (f"  kernel {t_kernel * 1e3:9.3f} ms  reference {t_ref * 1e3:9.3f} ms  "
                 f"ratio {t_kernel / t_ref:6.3f}  (first call {t_first:.1f} s)")
    print(line, flush=True)
    if tune and timing:
        rec["tune"] = {}
        for label, fn in case.tune.items():
            try:
                out, _, t = _timed(fn, case.args, iters)
                rec["tune"][label] = {"kernel_ms": t * 1e3, "ratio": t / t_ref, "err": _error(out, want)}
                print(f"       tune {label:18s} err {_error(out, want):.2e}  kernel {t * 1e3:9.3f} ms  "
                      f"ratio {t / t_ref:6.3f}", flush=True)
            except Exception as e:   # an alternative tiling may exceed the chip's resources
                rec["tune"][label] = {"error": f"{type(e).__name__}"}
                print(f"       tune {label:18s} error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return ok, rec


def lower_for_gpu(groups, match: str = "") -> bool:
    """Lower every kernel at K3 shapes to Triton IR for CUDA and ROCm (no GPU needed)."""
    ok = True
    for group in groups:
        for case in GROUPS[group](tiny=False, interpret=False):
            if match not in case.name:
                continue
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)
            for platform in ("cuda", "rocm"):
                try:
                    text = case.kernel.trace(*abstract).lower(lowering_platforms=(platform,)).as_text()
                    assert "triton" in text, "no Triton kernel in the lowered module"
                    print(f"[ok]   lowered for {platform:4s}: {case.group:12s} {case.name}", flush=True)
                except Exception:
                    ok = False
                    print(f"[FAIL] lowering for {platform}: {case.group} {case.name}\n{traceback.format_exc()}")
    return ok


# ---------------------------------------------------------------------------------------------
# the paged MLA crossover: from which span (keys per sequence) is the kernel faster than XLA's
# fusion of its reference? `auto` dispatch runs the kernel from mla_paged.AUTO_MIN_KEYS keys on.


@dataclasses.dataclass(frozen=True)
class PagedShape:
    label: str
    batch: int
    rows: int                 # query rows per sequence: T+1 = 8 for verify, T = 7 for the draft block
    heads: int
    cache: object             # pool dtype
    causal: bool


# K3 (96 heads; 12 per device at TP 8) and its draft (64 heads), pages of 128, 512 + 64 latent
CROSSOVER_SHAPES = (PagedShape("verify B1 N96 bf16", 1, 8, 96, jnp.bfloat16, True),
                    PagedShape("verify B8 N96 fp8", 8, 8, 96, FP8, True),
                    PagedShape("verify B1 N12 fp8", 1, 8, 12, FP8, True),
                    PagedShape("block B4 N64 bf16", 4, 7, 64, jnp.bfloat16, False))
CROSSOVER_SPANS = (65536, 32768, 16384, 8192, 4096, 2048, 1024)
TINY_SHAPES = (PagedShape("verify B2 N2 fp8", 2, 8, 2, FP8, True),
               PagedShape("block B2 N2 bf16", 2, 7, 2, jnp.bfloat16, False))
TINY_SPANS = (256, 128, 64)


def paged_args(shape: PagedShape, span: int, *, tiny: bool, seed: int = 0) -> tuple:
    """Inputs for one sweep point: `span` keys per sequence (the block table's pages x page size,
    as a step sees them), sequences ragged inside the span bucket (generate() picks the smallest
    power-of-two span >= length + T + 1, so lengths lie in (span/2, span - T - 1])."""
    c, r, page = (32, 16, 16) if tiny else (512, 64, 128)
    rng = np.random.default_rng(seed)
    b, t = shape.batch, shape.rows
    per_seq = span // page
    num_pages = b * per_seq + 1
    table = jnp.asarray(rng.permutation(num_pages)[:b * per_seq].reshape(b, per_seq), jnp.int32)
    pages = _rand(rng, (1, num_pages, page, c + r)).astype(shape.cache)
    lens = rng.integers(span // 2, span - t, size=b, endpoint=True)
    positions = jnp.asarray(lens[:, None] + np.arange(t)[None], jnp.int32)
    q = jnp.float32 if tiny else jnp.bfloat16
    return (_rand(rng, (b, t, shape.heads, c), q, 0.5), _rand(rng, (b, t, shape.heads, r), q, 0.5), pages, table,
            positions)


def sweep_crossover(shapes, spans, iters: int, interpret: bool, tiny: bool, full: bool, emit=None) -> list[dict]:
    """Time kernel and reference at every (span, shape), largest spans first; unless `full`, stop
    after the first span at which the kernel lost for some shape (the crossover is above it)."""
    points = []
    for span in sorted(spans, reverse=True):
        lost = False
        for shape in shapes:
            scale = (512 + 64) ** -0.5
            rec = {"shape": shape.label, "span": span}
            try:
                args = paged_args(shape, span, tiny=tiny)
                # what `auto` runs below the crossover: the reference read chunk by chunk
                ref = jax.jit(lambda *a, causal=shape.causal: mla_paged_chunked(*a, scale, causal=causal, row=0))
                kern = jax.jit(lambda *a, causal=shape.causal: mla_paged_kernel(*a, scale, causal=causal, row=0,
                                                                                interpret=interpret))
                want, _, t_ref = _timed(ref, args, iters)
                got, _, t_kernel = _timed(kern, args, iters)
                err = _error(got, want)
                rec |= {"kernel_ms": t_kernel * 1e3, "reference_ms": t_ref * 1e3, "ratio": t_kernel / t_ref,
                        "err": err, "ok": err <= _tol(tiny, 2e-2)}
                line = (f"[{'crossover' if rec['ok'] else 'FAIL'}] span {span:6d}  {shape.label:20s} kernel "
                        f"{t_kernel * 1e3:9.3f} ms  reference {t_ref * 1e3:9.3f} ms  ratio {t_kernel / t_ref:6.3f}  "
                        f"err {err:.1e}")
            except Exception as e:
                msg = str(e).splitlines()[0][:200] if str(e) else ""
                rec |= {"ratio": None, "ok": False, "error": f"{type(e).__name__}: {msg}"}
                line = f"[crossover] span {span:6d}  {shape.label:20s} error: {rec['error']}"
            print(line, flush=True)
            points.append(rec)
            if emit is not None:
                emit(points)
            lost |= rec["ratio"] is None or rec["ratio"] > 1.0
        if lost and not full:
            print(f"[crossover] the kernel lost at span {span}: smaller spans stay with the reference "
                  "(--crossover_full to sweep them anyway)", flush=True)
            break
    return points


def print_crossover(report: dict) -> None:
    m = report["measured_crossover"]
    print(f"[crossover] measured crossover: {m if m is not None else 'none (the kernel lost at the largest span)'}"
          f"; recommended DSPARK_MLA_PAGED_MIN_KEYS={report['recommended_min_keys']} "
          f"(current {report['current_min_keys']}); auto with the current value: worst "
          f"{report['auto_worst_ratio_current']:.3f} x the reference "
          f"({'never slower' if report['auto_never_slower_current'] else 'SLOWER somewhere'})", flush=True)


def main(argv):
    del argv
    groups = [] if _ONLY.value == ["none"] else (_ONLY.value or list(GROUPS))
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise app.UsageError(f"--only: unknown groups {sorted(unknown)}; choose from {sorted(GROUPS)} or none")
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm") and not _TINY.value
    result = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "iters": _ITERS.value,
              "cases": []}

    def save():
        if _JSON.value:
            Path(_JSON.value).write_text(json.dumps(result, indent=1))

    ok = True
    if on_gpu:
        print(f"GPU: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}); Triton lowering; "
              f"times = median of {_ITERS.value} calls", flush=True)
    else:
        lowering = " lowering every kernel to Triton IR for CUDA and ROCm, then" if _LOWER.value and groups else ""
        print(f"no GPU (default backend: {jax.default_backend()}) or --tiny:{lowering} interpret-mode comparisons "
              "on tiny shapes (timings meaningless)", flush=True)
        if _LOWER.value and groups:
            ok &= lower_for_gpu(groups, _MATCH.value)
    for group in groups:
        for case in GROUPS[group](tiny=not on_gpu, interpret=not on_gpu):
            if _MATCH.value not in case.name:
                continue
            case_ok, rec = run_case(case, _ITERS.value if on_gpu else 0, _TUNE.value, timing=on_gpu)
            ok &= case_ok
            result["cases"].append(rec)
            save()
    if _CROSSOVER.value:
        spans = [int(x) for x in _SPANS.value] or list(CROSSOVER_SPANS if on_gpu else TINY_SPANS)

        def emit(points):
            result["crossover"] = {"points": points}
            save()

        points = sweep_crossover(CROSSOVER_SHAPES if on_gpu else TINY_SHAPES, spans,
                                 _ITERS.value if on_gpu else 1, interpret=not on_gpu, tiny=not on_gpu,
                                 full=_FULL.value, emit=emit)
        report = crossover_report(points, dispatch.mla_paged_min_keys())
        result["crossover"] = {"points": auto_choice(points, report["current_min_keys"]), **report,
                               "timings_meaningful": on_gpu}
        save()
        print_crossover(report)
        ok &= all(p.get("ok", False) for p in points)
    result["ok"] = bool(ok)
    save()
    print("all kernels match their references" if ok else "MISMATCH OR ERROR (see [FAIL] lines)", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
