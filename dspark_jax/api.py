"""The library entry points: `load_target`, `load_draft` (and `generate`, in generate.py).

Both loaders take an HF-layout directory, an Orbax directory written by our converters, or a
preset name (`smollm2-135m`, `smollm2-135m-dspark`: the embedded demo pair, installed and
converted on first use).

`dtype` (both loaders, and `generate` when it loads by name): `"auto"` (the default) is bfloat16 on
accelerators and on CPUs whose XLA runs a bf16 GEMM natively (`numerics.native_bf16_gemm`), the
checkpoint's own dtype elsewhere; `"checkpoint"` (or None) keeps the stored dtype; a dtype name or
`jnp.dtype` casts the floating-point weights to it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from dspark_jax.config import load_config
from dspark_jax.config.keys import ConfigError
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.presets import resolve_model_path
from dspark_jax.sources import register_source

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-dspark"
DTYPE_NAMES = ("auto", "checkpoint", "float32", "bfloat16")

log = logging.getLogger("dspark_jax")


def auto_dtype() -> tuple[jnp.dtype | None, str]:
    """What `dtype="auto"` loads in (None: the checkpoint's dtype), and why."""
    from dspark_jax.numerics import native_bf16_gemm, on_cpu
    if not on_cpu():
        return jnp.dtype(jnp.bfloat16), f"bfloat16 on {jax.default_backend()}"
    from dspark_jax.hostinfo import describe_cpu
    if native_bf16_gemm():
        return jnp.dtype(jnp.bfloat16), f"bfloat16: XLA:CPU runs bf16 GEMMs natively on the {describe_cpu()}"
    return None, (f"the checkpoint's dtype: XLA:CPU has no native bf16 GEMM on the {describe_cpu()} "
                  "(bf16 would be slower there; --dtype bfloat16 forces it)")


def resolve_dtype(dtype, what: str = "dtype") -> jnp.dtype | None:
    """A `dtype=` argument as the dtype to load in (None: the checkpoint's); `"auto"` logs its choice."""
    if dtype is None or (isinstance(dtype, str) and dtype == "checkpoint"):
        return None
    if isinstance(dtype, str) and dtype == "auto":
        chosen, why = auto_dtype()
        log.info("%s auto -> %s", what, why)
        return chosen
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{what}={dtype!r}: expected one of {', '.join(DTYPE_NAMES)} or a numpy/jax dtype") from None


def load_target(path_or_name: str | os.PathLike = DEFAULT_TARGET, *, dtype="auto", mesh=None, progress=None,
                rules=None):
    """A target model (kimi_linear or llama family) ready for `generate`; `dtype`: see the module doc.
    `rules`: the logical-axis table that places it on `mesh` (default `sharding.LOGICAL_RULES`; the
    training programs pass `train_mesh.TEACHER_RULES`)."""
    dtype = resolve_dtype(dtype, "target dtype")
    path = resolve_model_path(path_or_name)
    from dspark_jax.checkpoint import target_io
    if target_io.is_orbax_target_dir(Path(path)):          # written by `python -m convert.target`
        model = target_io.load_kimi_orbax(path, mesh=mesh, dtype=dtype, rules=rules)
        register_source(model, path)
        return model
    cfg = load_config(path)
    if isinstance(cfg, KimiConfig):
        from dspark_jax.checkpoint.loader import load_kimi
        model = load_kimi(path, dtype=dtype, mesh=mesh, progress=progress, rules=rules)
    elif isinstance(cfg, LlamaConfig):
        from dspark_jax.checkpoint.loader import load_llama
        model = load_llama(path, dtype=dtype, mesh=mesh, progress=progress, rules=rules)
    elif isinstance(cfg, DraftConfig):
        raise ConfigError(f"{path}: this is a DSpark draft checkpoint; use load_draft")
    else:  # pragma: no cover - load_config raises for unknown families
        raise ConfigError(f"{path}: unsupported model family")
    register_source(model, path)
    return model


def load_draft(path_or_name: str | os.PathLike = DEFAULT_DRAFT, *, dtype="auto", mesh=None):
    """A DSpark draft from its torch layout (config.json + model.safetensors) or an Orbax dir;
    `dtype`: see the module doc (to run beside a loaded target, pass `dtype=target.dtype`)."""
    from dspark_jax.checkpoint.draft_io import load_draft as _load

    dtype = resolve_dtype(dtype, "draft dtype")
    path = Path(resolve_model_path(path_or_name))
    return _load(path, dtype=dtype, mesh=mesh)
