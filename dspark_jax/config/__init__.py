"""Typed model configs read from HF `config.json`, one module per family (`kimi`, `llama`,
`draft`) over the shared key reading (`keys`); `load_config` picks the family."""

from __future__ import annotations

from pathlib import Path

from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.keys import ConfigError, read_json, with_generation_eos
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.config.llama import LLAMA_MODEL_TYPES, LlamaConfig


def load_config(path: str | Path) -> KimiConfig | LlamaConfig | DraftConfig:
    """Pick the config class from `model_type` / `architectures`."""
    raw = read_json(path)
    where = str(path)
    archs = raw.get("architectures") or []
    mt = raw.get("model_type", "")
    if mt == "k3_dspark" or "K3DSparkModel" in archs:
        return DraftConfig.from_dict(raw, where)
    if "text_config" in raw or mt in ("kimi_linear", "kimi_k3"):
        return KimiConfig.from_dict(raw, where)
    if mt in LLAMA_MODEL_TYPES:
        return with_generation_eos(LlamaConfig.from_dict(raw, where), path)
    raise ConfigError(f"{where}: model_type {mt!r} is not a supported family "
                      f"(kimi_linear / kimi_k3, {' / '.join(LLAMA_MODEL_TYPES)}, k3_dspark)")
