"""Typed model configs read from HF `config.json`.

- `KimiConfig`: the `kimi_linear` family (Kimi-Linear and Kimi-K3; K3 extensions switch on by key).
  Accepts the K3 multimodal wrapper (`text_config`, tensor prefix `language_model.`), the plain
  causal-LM layout, and what `transformers`' `save_pretrained` writes.
- `LlamaConfig`: dense GQA decoders: Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral.
- `DraftConfig`: the DSpark MLA draft (`K3DSparkModel`, docs/architecture.md §3.1).

Layer ids are 0-based everywhere in this package; the 1-based `kda_layers`/`full_attn_layers`
lists of the checkpoint are converted on read.

One module although it is over 450 lines: the three config classes share the key parsing and
the error reporting, and a reader looking up what a config.json key does finds every key here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json that is missing a key or contradicts itself; the message names the key."""


def _read_json(path: str | Path) -> dict:
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


class _Keys:
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


class _MLADims:
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


# ---------------------------------------------------------------------------------------------
# kimi_linear family (Kimi-Linear, Kimi-K3)


@dataclass(frozen=True)
class KimiConfig(_MLADims):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int                    # dense MLP (layers < first_k_dense_replace)
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None     # latent MoE width (K3); None = experts on full width
    latent_moe_use_norm: bool
    moe_renormalize: bool
    routed_scaling_factor: float
    topk_method: str
    num_expert_group: int
    topk_group: int
    hidden_act: str                           # "silu" | "situ"
    situ_beta: float
    situ_linear_beta: float
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    rope_theta: float
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None            # K3 "safe gate" (-5.0); None = Kimi-Linear softplus gate
    use_full_rank_gate: bool                  # K3 g_proj; False = Kimi-Linear g_a_proj/g_b_proj
    kda_layers: tuple[int, ...]               # 0-based
    full_attn_layers: tuple[int, ...]         # 0-based (MLA)
    # K3 residual scheme
    attn_res_block_size: int | None           # Block Attention Residuals; None = plain residual
    rms_norm_eps: float
    tie_word_embeddings: bool
    quantization: str | None                  # None | "mxfp4" (compressed-tensors mxfp4-pack-quantized)
    quant_group_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    tensor_prefix: str                        # "" or "language_model." (K3 multimodal wrapper)
    dtype: str = "bfloat16"
    mla_norm_eps: float = 1e-6                # q_a/kv_a layernorm eps is hard-coded 1e-6 in the target
    eos_token_ids: tuple[int, ...] = ()       # every id of config.json; eos_token_id is the first

    family = "kimi_linear"

    # derived -----------------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        return layer in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def mla_layer_index(self) -> dict[int, int]:
        """Target layer id -> row in the MLA cache pool (index in full_attn_layers)."""
        return {l: i for i, l in enumerate(self.full_attn_layers)}

    @property
    def kda_layer_index(self) -> dict[int, int]:
        return {l: i for i, l in enumerate(self.kda_layers)}

    @property
    def moe_expert_in(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "KimiConfig":
        prefix = ""
        if "text_config" in raw:                        # K3 multimodal wrapper
            raw, prefix, where = raw["text_config"], "language_model.", f"{where}: text_config"
        k = _Keys(raw, where)
        mt = k.opt("model_type", default="kimi_linear")
        if mt not in ("kimi_linear", "kimi_k3"):
            k.fail("model_type", f"expected 'kimi_linear', got {mt!r}")
        n_layers = int(k.req("num_hidden_layers"))
        lac = raw.get("linear_attn_config") or {}
        if not isinstance(lac, Mapping):
            k.fail("linear_attn_config", "must be an object")
        lk = _Keys(lac, f"{where}: linear_attn_config")
        kda, full = _layer_split(k, lk, n_layers)

        quant, group = None, 32
        qc = raw.get("quantization_config")
        if qc:
            method, fmt = qc.get("quant_method"), qc.get("format")
            if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
                k.fail("quantization_config",
                       f"unsupported quantization {method!r}/{fmt!r}; only compressed-tensors "
                       "mxfp4-pack-quantized is known")
            groups = [g for g in (qc.get("config_groups") or {}).values()]
            weights = groups[0].get("weights", {}) if groups else {}
            if weights.get("num_bits", 4) != 4 or weights.get("type", "float") != "float":
                k.fail("quantization_config.config_groups", "expected 4-bit float (MXFP4) weights")
            quant, group = "mxfp4", int(weights.get("group_size", 32))

        act = k.opt("hidden_act", default="silu")
        if act not in ("silu", "situ"):
            k.fail("hidden_act", f"expected 'silu' or 'situ', got {act!r}")
        q_lora = k.opt("q_lora_rank")
        routed_hidden = k.opt("routed_expert_hidden_size")
        num_experts = int(k.opt("num_experts", "num_local_experts", "n_routed_experts", default=0))
        first_dense = k.opt("first_k_dense_replace")
        if first_dense is None:
            mlp_types = k.opt("mlp_layer_types")
            first_dense = (next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
                           if mlp_types else 1)
        eos = _eos_ids(k.opt("eos_token_id"))
        cfg = cls(
            vocab_size=int(k.req("vocab_size")),
            hidden_size=int(k.req("hidden_size")),
            num_hidden_layers=n_layers,
            intermediate_size=int(k.req("intermediate_size")),
            first_k_dense_replace=int(first_dense),
            moe_layer_freq=int(k.opt("moe_layer_freq", default=1)),
            num_experts=num_experts,
            num_experts_per_token=int(k.opt("num_experts_per_token", "num_experts_per_tok", default=0)),
            num_shared_experts=int(k.opt("num_shared_experts", "n_shared_experts", default=0)),
            moe_intermediate_size=int(k.opt("moe_intermediate_size", default=0)),
            routed_expert_hidden_size=int(routed_hidden) if routed_hidden else None,
            latent_moe_use_norm=bool(k.opt("latent_moe_use_norm", default=False)),
            moe_renormalize=bool(k.opt("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(k.opt("routed_scaling_factor", default=1.0)),
            topk_method=str(k.opt("topk_method", default="noaux_tc")),
            num_expert_group=int(k.opt("num_expert_group", "n_group", default=1)),
            topk_group=int(k.opt("topk_group", default=1)),
            hidden_act=act,
            situ_beta=float(k.opt("activation_situ_beta", default=4.0)),
            situ_linear_beta=float(k.opt("activation_situ_linear_beta", default=25.0)),
            num_attention_heads=int(k.req("num_attention_heads")),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(k.req("kv_lora_rank")),
            qk_nope_head_dim=int(k.req("qk_nope_head_dim")),
            qk_rope_head_dim=int(k.req("qk_rope_head_dim")),
            v_head_dim=int(k.req("v_head_dim")),
            # transformers' KimiLinear never rotates: NoPE is the family default
            mla_use_nope=bool(k.opt("mla_use_nope", default=True)),
            mla_use_output_gate=bool(k.opt("mla_use_output_gate", default=False)),
            rope_theta=float(k.opt("rope_theta", default=10000.0)),
            kda_num_heads=int(lk.opt("num_heads", default=k.opt("linear_num_heads", default=0))),
            kda_head_dim=int(lk.opt("head_dim", default=k.opt("linear_head_dim", default=0))),
            short_conv_kernel_size=int(lk.opt("short_conv_kernel_size",
                                              default=k.opt("linear_conv_kernel_dim", default=4))),
            gate_lower_bound=(float(lk.opt("gate_lower_bound"))
                              if lk.opt("gate_lower_bound") is not None else None),
            use_full_rank_gate=bool(lk.opt("use_full_rank_gate", default=False)),
            kda_layers=kda,
            full_attn_layers=full,
            attn_res_block_size=(int(k.opt("attn_res_block_size"))
                                 if k.opt("attn_res_block_size") else None),
            rms_norm_eps=float(k.opt("rms_norm_eps", default=1e-5)),
            tie_word_embeddings=bool(k.opt("tie_word_embeddings", default=False)),
            quantization=quant,
            quant_group_size=group,
            bos_token_id=k.opt("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
            pad_token_id=k.opt("pad_token_id"),
            tensor_prefix=prefix,
            dtype=str(k.opt("dtype", "torch_dtype", default="bfloat16")),
            eos_token_ids=eos,
        )
        cfg._validate(k)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "KimiConfig":
        return cls.from_dict(_read_json(path), where=str(path))

    def _validate(self, k: _Keys) -> None:
        if self.kda_layers and (self.kda_num_heads <= 0 or self.kda_head_dim <= 0):
            k.fail("linear_attn_config.num_heads", "KDA layers present but num_heads/head_dim missing")
        if self.num_experts:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                k.fail("num_experts_per_token",
                       f"{self.num_experts_per_token} not in 1..num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                k.fail("moe_intermediate_size", "required when num_experts > 0")
            if self.num_experts % self.num_expert_group:
                k.fail("num_expert_group", f"{self.num_expert_group} does not divide {self.num_experts}")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            k.fail("routed_expert_hidden_size", "must be positive")
        if self.quantization == "mxfp4":
            for key, width in (("moe_intermediate_size", self.moe_intermediate_size),
                               ("routed_expert_hidden_size", self.moe_expert_in)):
                if width % self.quant_group_size:
                    k.fail(key, f"{width} is not a multiple of the MXFP4 group size {self.quant_group_size}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            k.fail("attn_res_block_size", "must be positive")
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            k.fail("qk_rope_head_dim", "must be even for RoPE")


def _layer_split(k: _Keys, lk: _Keys, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """0-based (kda, full-attention) layer ids from 1-based config lists or `layer_types`."""
    if "kda_layers" in lk.raw or "full_attn_layers" in lk.raw:
        kda1 = list(lk.opt("kda_layers", default=[]))
        full1 = list(lk.opt("full_attn_layers", default=[]))
        for name, ids in (("kda_layers", kda1), ("full_attn_layers", full1)):
            bad = [i for i in ids if not isinstance(i, int) or not 1 <= i <= n_layers]
            if bad:
                lk.fail(name, f"ids {bad} outside 1..num_hidden_layers={n_layers} (the lists are 1-based)")
        kda, full = [i - 1 for i in kda1], [i - 1 for i in full1]
    elif k.opt("layer_types"):
        types = list(k.opt("layer_types"))
        if len(types) != n_layers:
            k.fail("layer_types", f"{len(types)} entries for num_hidden_layers={n_layers}")
        unknown = sorted({t for t in types} - {"linear_attention", "full_attention"})
        if unknown:
            k.fail("layer_types", f"unknown layer types {unknown}")
        kda = [i for i, t in enumerate(types) if t == "linear_attention"]
        full = [i for i, t in enumerate(types) if t == "full_attention"]
    else:
        k.fail("linear_attn_config", "needs kda_layers/full_attn_layers (or layer_types)")
    both = sorted(set(kda) & set(full))
    if both:
        lk.fail("kda_layers", f"layers {[i + 1 for i in both]} (1-based) are also in full_attn_layers")
    missing = sorted(set(range(n_layers)) - set(kda) - set(full))
    if missing:
        lk.fail("full_attn_layers", f"layers {[i + 1 for i in missing]} (1-based) are in neither list")
    return tuple(sorted(kda)), tuple(sorted(full))


# ---------------------------------------------------------------------------------------------
# llama family (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral)

LLAMA_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# rope types with position-independent frequencies (transformers' modeling_rope_utils math);
# `dynamic` rescales them with the running sequence length, so keys cached at one length would be
# rotated by frequencies another step no longer uses
LLAMA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaRope:
    """A llama-family config's `rope_parameters` / `rope_scaling`, resolved the way transformers
    resolves them (defaults filled in, YaRN's cos/sin multiplier computed)."""
    rope_type: str = "default"                # one of LLAMA_ROPE_TYPES
    rope_theta: float = 10000.0
    factor: float = 1.0                       # linear, llama3, yarn
    original_max_position_embeddings: int = 0 # llama3, yarn
    low_freq_factor: float = 1.0              # llama3
    high_freq_factor: float = 4.0             # llama3
    beta_fast: float = 32.0                   # yarn
    beta_slow: float = 1.0                    # yarn
    attention_factor: float = 1.0             # yarn: cos/sin multiplier


def _llama_rope(k: _Keys, max_positions: int) -> LlamaRope:
    key = next((n for n in ("rope_parameters", "rope_scaling") if k.raw.get(n)), "rope_scaling")
    rp = k.opt(key, default={})
    if not isinstance(rp, Mapping):
        k.fail(key, "must be an object")
    if any(isinstance(v, Mapping) for v in rp.values()):
        k.fail(key, "per-layer-type rope parameters are not supported")
    rk = _Keys(rp, f"{k.where}: {key}")
    partial = rk.opt("partial_rotary_factor", default=k.opt("partial_rotary_factor", default=1.0))
    if float(partial) != 1.0:
        k.fail("partial_rotary_factor", f"{partial}: only full-width rotary embeddings are supported")
    rope_type = rk.opt("rope_type", "type", default="default")
    theta = float(rk.opt("rope_theta", default=k.opt("rope_theta", default=10000.0)))
    if rope_type not in LLAMA_ROPE_TYPES:
        why = (" (it rescales the frequencies with the running sequence length, which a key cache "
               "cannot follow)" if rope_type == "dynamic" else "")
        k.fail(f"{key}.rope_type", f"{rope_type!r} is not supported{why}; supported: "
                                   f"{', '.join(LLAMA_ROPE_TYPES)}")
    if rope_type == "default":
        return LlamaRope(rope_theta=theta)
    original = int(rk.opt("original_max_position_embeddings", default=max_positions))
    factor = rk.opt("factor")
    if factor is None and rope_type == "yarn":          # transformers: the context-length ratio
        factor = max_positions / original
    if factor is None:
        k.fail(f"{key}.factor", f"required for rope_type {rope_type!r}")
    factor = float(factor)
    if factor < 1.0:
        k.fail(f"{key}.factor", f"{factor} must be >= 1")
    if rope_type == "linear":
        return LlamaRope("linear", theta, factor)
    if rope_type == "llama3":
        low, high = (float(rk.req(n)) for n in ("low_freq_factor", "high_freq_factor"))
        if not 0 < low < high:
            k.fail(f"{key}.high_freq_factor", f"{high} must exceed low_freq_factor {low} > 0")
        return LlamaRope("llama3", theta, factor, original, low_freq_factor=low, high_freq_factor=high)
    if rk.opt("truncate", default=True) is not True:
        k.fail(f"{key}.truncate", "only the truncated (floor/ceil) YaRN correction range is supported")
    attn = rk.opt("attention_factor")
    if attn is None:
        mscale, mscale_all = rk.opt("mscale"), rk.opt("mscale_all_dim")
        attn = (yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
                if mscale and mscale_all else yarn_mscale(factor))
    return LlamaRope("yarn", theta, factor, original, beta_fast=float(rk.opt("beta_fast") or 32),
                     beta_slow=float(rk.opt("beta_slow") or 1), attention_factor=float(attn))


def _sliding_layers(k: _Keys, model_type: str, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, ids of the layers that use it) as transformers reads them: Mistral windows every
    layer when `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`, on the layers
    `layer_types` marks (default: those from `max_window_layers` on); Llama has none."""
    types = k.opt("layer_types")
    if types is not None:
        if len(types) != n_layers:
            k.fail("layer_types", f"{len(types)} entries for num_hidden_layers={n_layers}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            k.fail("layer_types", f"unknown layer types {unknown}")
    if model_type == "mistral":
        window, layers = k.opt("sliding_window"), range(n_layers)
    elif model_type in ("qwen2", "qwen3"):
        window = k.opt("sliding_window") if k.opt("use_sliding_window", default=False) else None
        layers = ([i for i, t in enumerate(types) if t == "sliding_attention"] if types is not None
                  else range(int(k.opt("max_window_layers", default=28)), n_layers))
    else:
        return None, ()
    if window is None:
        return None, ()
    if not isinstance(window, int) or window <= 0:
        k.fail("sliding_window", f"{window!r} must be a positive integer")
    return window, tuple(layers)


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None                  # the first of eos_token_ids
    pad_token_id: int | None
    hidden_act: str = "silu"
    dtype: str = "bfloat16"
    tensor_prefix: str = ""
    model_type: str = "llama"
    rope: LlamaRope = LlamaRope()
    qkv_bias: bool = False                    # Qwen2 always; Llama/Qwen3 `attention_bias`
    o_bias: bool = False                      # Llama/Qwen3 `attention_bias`
    qk_norm: bool = False                     # Qwen3: per-head RMSNorm of q and k before RoPE
    sliding_window: int | None = None         # keys per query (itself included) on sliding_layers
    sliding_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()       # every id of config.json (+ generation_config.json)

    family = "llama"

    def window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (None: the whole causal prefix)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config.json") -> "LlamaConfig":
        k = _Keys(raw, where)
        mt = k.opt("model_type", default="llama")
        if mt not in LLAMA_MODEL_TYPES:
            k.fail("model_type", f"expected a llama-family model ({', '.join(LLAMA_MODEL_TYPES)}), got {mt!r}")
        heads = int(k.req("num_attention_heads"))
        hidden = int(k.req("hidden_size"))
        n_layers = int(k.req("num_hidden_layers"))
        kv = int(k.opt("num_key_value_heads", default=heads))
        if heads % kv:
            k.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
        # transformers' Qwen3Config defaults head_dim to 128, the others to hidden_size / heads
        head_dim = int(k.opt("head_dim", default=128 if mt == "qwen3" else hidden // heads))
        if head_dim % 2:
            k.fail("head_dim", f"{head_dim} must be even for RoPE")
        act = k.opt("hidden_act", default="silu")
        if act != "silu":
            k.fail("hidden_act", f"expected 'silu', got {act!r}")
        if k.opt("mlp_bias", default=False):
            k.fail("mlp_bias", "MLP biases are not supported")
        max_positions = int(k.opt("max_position_embeddings", default=2048))
        rope = _llama_rope(k, max_positions)
        window, sliding = _sliding_layers(k, mt, n_layers)
        attention_bias = bool(k.opt("attention_bias", default=False)) and mt in ("llama", "qwen3")
        eos = _eos_ids(k.opt("eos_token_id"))
        return cls(
            vocab_size=int(k.req("vocab_size")), hidden_size=hidden,
            intermediate_size=int(k.req("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            rms_norm_eps=float(k.opt("rms_norm_eps", default=1e-6)),
            rope_theta=rope.rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(k.opt("tie_word_embeddings", default=False)),
            bos_token_id=k.opt("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
            pad_token_id=k.opt("pad_token_id"),
            hidden_act=act,
            dtype=str(k.opt("dtype", "torch_dtype", default="bfloat16")),
            model_type=mt, rope=rope,
            qkv_bias=attention_bias or mt == "qwen2", o_bias=attention_bias, qk_norm=mt == "qwen3",
            sliding_window=window, sliding_layers=sliding, eos_token_ids=eos,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        """config.json, with the eos ids of a generation_config.json beside it added."""
        cfg = cls.from_dict(_read_json(path), where=str(path))
        return _with_generation_eos(cfg, path)


def _with_generation_eos(cfg, path: str | Path):
    """`cfg` with the eos ids of the generation_config.json next to `path` (a config.json or its
    directory) appended: instruct checkpoints end turns with a token listed only there
    (Llama 3's `<|eot_id|>`)."""
    path = Path(path)
    gen = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not gen.is_file():
        return cfg
    try:
        extra = _eos_ids(json.loads(gen.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"{gen}: eos_token_id: not an id or a list of ids ({e})") from None
    ids = cfg.eos_token_ids + tuple(i for i in extra if i not in cfg.eos_token_ids)
    return dataclasses.replace(cfg, eos_token_ids=ids, eos_token_id=ids[0] if ids else None)


# ---------------------------------------------------------------------------------------------
# DSpark draft (docs/architecture.md §3.1)


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
class DraftConfig(_MLADims):
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
        k = _Keys(raw, where)
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
        return cls.from_dict(_read_json(path), where=str(path))


def load_config(path: str | Path) -> KimiConfig | LlamaConfig | DraftConfig:
    """Pick the config class from `model_type` / `architectures`."""
    raw = _read_json(path)
    where = str(path)
    archs = raw.get("architectures") or []
    mt = raw.get("model_type", "")
    if mt == "k3_dspark" or "K3DSparkModel" in archs:
        return DraftConfig.from_dict(raw, where)
    if "text_config" in raw or mt in ("kimi_linear", "kimi_k3"):
        return KimiConfig.from_dict(raw, where)
    if mt in LLAMA_MODEL_TYPES:
        return _with_generation_eos(LlamaConfig.from_dict(raw, where), path)
    raise ConfigError(f"{where}: model_type {mt!r} is not a supported family "
                      f"(kimi_linear / kimi_k3, {' / '.join(LLAMA_MODEL_TYPES)}, k3_dspark)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def replace(cfg, **changes):
    return dataclasses.replace(cfg, **changes)
