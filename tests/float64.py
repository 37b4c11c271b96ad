"""Float64 parity: both sides of a comparison against a reference computed in float64, so the
tolerance is float64 rounding and not the summation order of one CPU's float32 kernels.

- `x64()`: JAX float64 for the body of one test only (`jax.enable_x64` is a thread-local context,
  so nothing leaks into other tests; jit caches key on it).
- `TorchFloat64()`: a torch function mode for running a reference: every explicit float32 in the
  reference's own code (`.float()`, `.to(torch.float32)`, `.type(torch.float32)`,
  `softmax(dtype=torch.float32)`, factories with `dtype=torch.float32` or the default dtype) becomes
  float64, and any op that still yields a float32 tensor raises. transformers' Kimi-Linear, Llama
  and DeepseekV3 upcast to float32 on purpose (RMSNorm, softmax, router, the whole KDA recurrence,
  RoPE angles): under `.double()` alone they would still round to float32 there, so a float64
  comparison needs the mode. The reference code itself runs unchanged.
- `assert_close(got, want, what)`: max |got - want| <= RTOL * max |want| over the tensor.
- `assert_f32_close(got, want, what)`: the same bound at F32_RTOL, for float32 results of two
  programs that compute the same values in different summation orders.
- `share_rope_table(hf_rotary, rope)`: RoPE frequency tables are float32 by definition on both
  sides; after checking they agree to TABLE_ULPS, the reference gets ours, so a float64 comparison
  is not decided by the last bit of two pow() implementations.

RTOL = 1e-10: float64 has eps = 1.1e-16. The computations compared here (a few layers of
matmuls of width <= 150, softmax, RMSNorm, a 150-token delta-rule recurrence) lose at most a few
hundred eps to reassociation, i.e. ~1e-14 (measured: at most 6e-14 in these tests), so 1e-10
leaves >1000x headroom for any CPU's summation order. A single float32 rounding anywhere on either
side moves the result by ~6e-8 relative, 600x above the tolerance, so a float32 leak cannot pass.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

RTOL = 1e-10


def x64():
    """`with x64():` runs the body with JAX float64 enabled (this thread only)."""
    return jax.enable_x64(True)


def _swap(a):
    if a is torch.float32:
        return torch.float64
    if isinstance(a, str) and a in ("torch.FloatTensor", "torch.float32"):
        return "torch.DoubleTensor"
    if isinstance(a, (list, tuple)) and any(x is torch.float32 for x in a):
        return type(a)(_swap(x) for x in a)
    return a


def _float32_in(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.dtype == torch.float32
    if isinstance(out, (list, tuple)):
        return any(_float32_in(o) for o in out)
    return False


class _Float32To64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(_swap(a) for a in args)
        kwargs = {k: _swap(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if _float32_in(out):
            raise AssertionError(f"{getattr(func, '__name__', func)} produced a float32 tensor inside "
                                 "TorchFloat64: the reference would not be computed in float64")
        return out


@contextlib.contextmanager
def TorchFloat64():
    """Run a (`.double()`) torch reference entirely in float64; see the module docstring."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float32To64():
            yield
    finally:
        torch.set_default_dtype(old)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def assert_close(got, want, what: str, rtol: float = RTOL) -> float:
    """max |got - want| <= rtol * max |want|; both must be float64 (a float32 result can't pass)."""
    got, want = (a.detach().numpy() if isinstance(a, torch.Tensor) else a for a in (got, want))
    for name, a in (("ours", got), ("reference", want)):
        assert np.dtype(a.dtype) == np.float64, f"{what}: {name} is {a.dtype}, not float64"
    err = rel_err(got, want)
    assert err <= rtol, f"{what}: max|diff|/max|ref| = {err:.2e} > {rtol:.0e}"
    return err


# Two float32 programs computing the same rows in different shapes (a one-token and a T+1-token
# step, a chunked and a whole prefill, ours and torch's) sum in different orders: a dot of length
# K moves by up to ~K eps32 (6e-8) of the sum of |terms|, and the few layers of a tiny model
# compound it, so ~1e-4 of the largest value bounds it on any CPU (observed: 4e-6). A wrong,
# stale or missing row differs by O(1) of that value.
F32_RTOL = 2.0 ** -13


def assert_f32_close(got, want, what: str, rtol: float = F32_RTOL) -> float:
    """max |got - want| <= rtol * max |want| for float32 results of two equivalent programs."""
    err = rel_err(got, want)
    assert err <= rtol, f"{what}: max|diff|/max|ref| = {err:.2e} > {rtol:.1e}"
    return err


def ulps(a, b) -> np.ndarray:
    """|a - b| in units of b's float32 spacing."""
    b = np.asarray(b, np.float32)
    return np.abs(np.asarray(a, np.float64) - b) / np.spacing(np.abs(b))


# Rotary frequency tables are float32 in every implementation (transformers computes
# `base ** (arange / dim)` in float32 even in a float64 model). Each side's pow is within ~1 ulp of
# the exact value and 1/x (and YaRN's blend, the same float32 ops on both sides) round correctly,
# so two tables may differ by a few ulps: allow 4.
TABLE_ULPS = 4


def share_rope_table(hf_rotary, rope) -> None:
    """Give a transformers rotary module (`inv_freq` buffer) our float32 frequency table after
    checking the two agree to TABLE_ULPS: a float64 comparison then tests everything but pow()'s
    last bit, which this check covers."""
    assert np.all(ulps(rope.inv_freq, hf_rotary.inv_freq.float().numpy()) <= TABLE_ULPS)
    with torch.no_grad():
        hf_rotary.inv_freq.copy_(torch.from_numpy(np.array(rope.inv_freq, np.float64)))
