"""What every config reader shares: the error naming the file and key, JSON reading, a key
reader that says which key is missing or malformed, MLA widths, eos ids (config.json and
generation_config.json) and YaRN's mscale."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json that is missing a key or contradicts itself; the message names the key."""


def read_json(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


class Keys:
    """Reads keys from a config dict, naming the key (and source) in every error."""

    def __init__(self, raw: Mapping[str, Any], where: str):
        self.raw, self.where = raw, where

    def req(self, *names: str):
        for n in names:
            if n in self.raw and self.raw[n] is not None:
                return self.raw[n]
        raise ConfigError(f"{self.where}: missing required key {names[0]!r}")

    def opt(self, *names: str, default=None):
        for n in names:
            if n in self.raw and self.raw[n] is not None:
                return self.raw[n]
        return default

    def fail(self, key: str, msg: str):
        raise ConfigError(f"{self.where}: {key}: {msg}")


class MLADims:
    """Widths derived from the MLA fields both the target and the draft configs carry."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_lora_rank: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of one MLA cache row: normalised c_kv + the (unrotated for NoPE) k_rope lane."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def with_generation_eos(cfg, path: str | Path):
    """`cfg` with the eos ids of the generation_config.json next to `path` (a config.json or its
    directory) appended: instruct checkpoints end turns with a token listed only there
    (Llama 3's `<|eot_id|>`)."""
    path = Path(path)
    gen = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not gen.is_file():
        return cfg
    try:
        extra = eos_ids(json.loads(gen.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"{gen}: eos_token_id: not an id or a list of ids ({e})") from None
    ids = cfg.eos_token_ids + tuple(i for i in extra if i not in cfg.eos_token_ids)
    return dataclasses.replace(cfg, eos_token_ids=ids, eos_token_id=ids[0] if ids else None)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def replace(cfg, **changes):
    return dataclasses.replace(cfg, **changes)
