"""The library entry points: `load_target`, `load_draft` (and `generate`, in generate.py).

Both loaders take an HF-layout directory, an Orbax directory written by our converters, or a
preset name (`smollm2-135m`, `smollm2-135m-dspark`: the embedded demo pair, installed and
converted on first use).
"""

from __future__ import annotations

import os
from pathlib import Path

from dspark_jax.config import ConfigError, DraftConfig, KimiConfig, LlamaConfig, load_config
from dspark_jax.presets import resolve_model_path
from dspark_jax.sources import register_source

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-dspark"


def load_target(path_or_name: str | os.PathLike = DEFAULT_TARGET, *, dtype=None, mesh=None, progress=None):
    """A target model (kimi_linear or llama family) ready for `generate`."""
    path = resolve_model_path(path_or_name)
    from dspark_jax.checkpoint import target_io
    if target_io.is_orbax_target_dir(Path(path)):          # written by `python -m convert.target`
        model = target_io.load_kimi_orbax(path, mesh=mesh, dtype=dtype)
        register_source(model, path)
        return model
    cfg = load_config(path)
    if isinstance(cfg, KimiConfig):
        from dspark_jax.models.kimi import load_kimi
        model = load_kimi(path, dtype=dtype, mesh=mesh, progress=progress)
    elif isinstance(cfg, LlamaConfig):
        from dspark_jax.models.llama import load_llama
        model = load_llama(path, dtype=dtype, mesh=mesh, progress=progress)
    elif isinstance(cfg, DraftConfig):
        raise ConfigError(f"{path}: this is a DSpark draft checkpoint; use load_draft")
    else:  # pragma: no cover - load_config raises for unknown families
        raise ConfigError(f"{path}: unsupported model family")
    register_source(model, path)
    return model


def load_draft(path_or_name: str | os.PathLike = DEFAULT_DRAFT, *, dtype=None, mesh=None):
    """A DSpark draft from its torch layout (config.json + model.safetensors) or an Orbax dir."""
    from dspark_jax.checkpoint.draft_io import load_draft as _load

    path = Path(resolve_model_path(path_or_name))
    return _load(path, dtype=dtype, mesh=mesh)
