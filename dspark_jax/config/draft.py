"""The DSpark MLA draft's config (`K3DSparkModel`, docs/architecture.md §3.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dspark_jax.config.keys import Keys, MLADims, read_json


@dataclass(frozen=True)
class RopeScaling:
    """DeepSeek-flavour YaRN (docs/architecture.md §3.4). rope_type 'default' = plain RoPE (factor 1)."""
    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class DraftConfig(MLADims):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    target_hidden_size: int
    target_num_hidden_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    rope: RopeScaling
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    markov_head_type: str = "vanilla"
    dtype: str = "bfloat16"
    draft_vocab_size: int | None = None       # K < vocab_size: reduced draft vocabulary (d2t/t2d map)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    family = "dspark"

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def draft_vocab(self) -> int:
        """K, the draft's output vocabulary (= vocab_size unless reduced)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def reduced_vocab(self) -> bool:
        """True when the draft predicts over K < V kept target tokens (EAGLE-3 style `d2t`/`t2d`)."""
        return self.draft_vocab < self.vocab_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "DraftConfig":
        k = Keys(raw, where)
        archs = k.opt("architectures", default=["K3DSparkModel"])
        mt = k.opt("model_type", default="k3_dspark")
        if "K3DSparkModel" not in archs and mt != "k3_dspark":
            k.fail("architectures", f"expected K3DSparkModel / k3_dspark, got {archs!r} / {mt!r}")
        for flag in ("mla_use_nope", "mla_use_output_gate"):
            if k.opt(flag, default=False):
                k.fail(flag, "the DSpark draft uses rotated MLA without an output gate; true is not supported")
        if k.opt("markov_head_type", default="vanilla") != "vanilla":
            k.fail("markov_head_type", f"only 'vanilla' is known, got {k.opt('markov_head_type')!r}")
        if k.opt("hidden_act", default="silu") != "silu":
            k.fail("hidden_act", "the draft MLP is SwiGLU (silu)")
        ids = tuple(int(i) for i in k.req("target_layer_ids"))
        n_target = int(k.req("target_num_hidden_layers"))
        bad = [i for i in ids if not 0 <= i < n_target]
        if bad:
            k.fail("target_layer_ids", f"{bad} outside 0..target_num_hidden_layers-1={n_target - 1}")
        if int(k.opt("num_target_layers", default=len(ids))) != len(ids):
            k.fail("num_target_layers", f"{k.opt('num_target_layers')} != len(target_layer_ids)={len(ids)}")
        rp = dict(k.opt("rope_parameters", "rope_scaling", default={}) or {})
        theta = float(rp.get("rope_theta", k.opt("rope_theta", default=10000.0)))
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            k.fail("rope_parameters.rope_type", f"{rope_type!r} not supported (default or yarn)")
        rope = RopeScaling(
            rope_type=rope_type, rope_theta=theta, factor=float(rp.get("factor", 1.0)),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rp.get("beta_fast", 32)), beta_slow=float(rp.get("beta_slow", 1)),
            mscale=float(rp.get("mscale", 1.0)), mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)))
        q_lora = k.opt("q_lora_rank")
        vocab = int(k.req("vocab_size"))
        draft_vocab = int(k.opt("draft_vocab_size", default=vocab))
        if not 0 < draft_vocab <= vocab:
            k.fail("draft_vocab_size", f"{draft_vocab} must be in 1..vocab_size={vocab}")
        cfg = cls(
            hidden_size=int(k.req("hidden_size")),
            intermediate_size=int(k.req("intermediate_size")),
            num_hidden_layers=int(k.req("num_hidden_layers")),
            num_attention_heads=int(k.req("num_attention_heads")),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(k.req("kv_lora_rank")),
            qk_nope_head_dim=int(k.req("qk_nope_head_dim")),
            qk_rope_head_dim=int(k.req("qk_rope_head_dim")),
            v_head_dim=int(k.req("v_head_dim")),
            vocab_size=vocab,
            rms_norm_eps=float(k.opt("rms_norm_eps", default=1e-5)),
            target_hidden_size=int(k.req("target_hidden_size")),
            target_num_hidden_layers=n_target,
            target_layer_ids=ids,
            mask_token_id=int(k.req("mask_token_id")),
            markov_rank=int(k.opt("markov_rank", default=0)),
            enable_confidence_head=bool(k.opt("enable_confidence_head", default=False)),
            confidence_head_with_markov=bool(k.opt("confidence_head_with_markov", default=False)),
            rope=rope,
            bos_token_id=k.opt("bos_token_id"),
            eos_token_id=k.opt("eos_token_id"),
            pad_token_id=k.opt("pad_token_id"),
            dtype=str(k.opt("torch_dtype", "dtype", default="bfloat16")),
            draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
            raw=dict(raw),
        )
        if not 0 <= cfg.mask_token_id < vocab:
            k.fail("mask_token_id", f"{cfg.mask_token_id} outside the vocabulary (0..{vocab - 1})")
        if cfg.qk_rope_head_dim % 2:
            k.fail("qk_rope_head_dim", "must be even for RoPE")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "DraftConfig":
        return cls.from_dict(read_json(path), where=str(path))


