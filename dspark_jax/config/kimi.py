"""The `kimi_linear` family's config (Kimi-Linear and Kimi-K3; K3 extensions switch on by key):
the K3 multimodal wrapper (`text_config`, tensor prefix `language_model.`), the plain causal-LM
layout, and what `transformers`' `save_pretrained` writes. Layer ids are 0-based; the 1-based
`kda_layers` / `full_attn_layers` lists of the checkpoint are converted on read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dspark_jax.config.keys import Keys, MLADims, eos_ids, read_json


@dataclass(frozen=True)
class KimiConfig(MLADims):
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
        k = Keys(raw, where)
        mt = k.opt("model_type", default="kimi_linear")
        if mt not in ("kimi_linear", "kimi_k3"):
            k.fail("model_type", f"expected 'kimi_linear', got {mt!r}")
        n_layers = int(k.req("num_hidden_layers"))
        lac = raw.get("linear_attn_config") or {}
        if not isinstance(lac, Mapping):
            k.fail("linear_attn_config", "must be an object")
        lk = Keys(lac, f"{where}: linear_attn_config")
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
        eos = eos_ids(k.opt("eos_token_id"))
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
        return cls.from_dict(read_json(path), where=str(path))

    def _validate(self, k: Keys) -> None:
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


def _layer_split(k: Keys, lk: Keys, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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


