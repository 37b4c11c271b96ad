"""Helpers shared by the Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Triton lowering rules every kernel here follows (jax/_src/pallas/triton/lowering.py):
- every loaded / stored tile and every `jnp.arange` has a power-of-2 number of elements, so
  wide dims are loaded in power-of-2 pieces (e.g. MLA rows as 512 + 64) and ragged lengths are
  padded in the wrapper and masked inside;
- no scratch buffers: running state lives in `fori_loop` carries (registers);
- no dynamic slicing of values: rows/columns of a register tile are picked with masked
  reductions, memory with `pl.ds` loads at dynamic offsets;
- dots are 2-D with both operands of one dtype and f32 accumulation, at the default precision
  (tensor cores: bf16 as is, f32 as TF32, like XLA's own default on GPU); on GPU each dot dim
  should be >= 16 (the interpret-mode tests also use smaller tiles).
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Same finite "minus infinity" as mla_reference._MASKED: fully masked rows give exp(0) * 0, never NaN.
NEG = -1e30


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `axis` of x at the end up to `size` entries."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def check_pow2(**dims: int) -> None:
    for name, d in dims.items():
        if d <= 0 or d & (d - 1):
            raise ValueError(f"kernel dim {name}={d} must be a power of 2 (Triton tile rule); "
                             "use the reference for this shape")


_interpreting: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_interpreting", default=False)


def pallas_call(kernel, *, interpret: bool, **kwargs):
    """`pl.pallas_call` that lets the kernel body know (while it is traced) whether it will be
    interpreted rather than lowered to Triton."""
    call = pl.pallas_call(kernel, interpret=interpret, **kwargs)

    def run(*args):
        token = _interpreting.set(bool(interpret))
        try:
            return call(*args)
        finally:
            _interpreting.reset(token)

    return run


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    if a.dtype != jnp.float32 and _interpreting.get():
        # XLA's CPU runtime has no bf16 x bf16 -> f32 dot inside the interpreter's loops; bf16
        # products are exact in f32 and the sum is f32 either way, so upcasting changes nothing.
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=jnp.float32)


def mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M,K] @ b [K,N] -> f32 [M,N]."""
    return _dot(a, b, (1, 0))


def mm_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M,K] @ b[N,K]^T -> f32 [M,N]."""
    return _dot(a, b, (1, 1))


def mm_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a[K,M]^T @ b [K,N] -> f32 [M,N]."""
    return _dot(a, b, (0, 0))


def cdiv(a, b: int):
    """Ceil division of a non-negative traced int32 scalar by a static int (lax.div truncates,
    which equals floor here and lowers to one Triton op)."""
    return lax.div(a + (b - 1), jnp.int32(b))


def compiler_params(num_warps: int | None, num_stages: int | None) -> plgpu.CompilerParams:
    """Triton launch parameters; None keeps Pallas' per-platform default (stages: 3 CUDA, 1 ROCm)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
