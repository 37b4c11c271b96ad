"""The llama family's config: dense GQA decoders (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3,
Mistral) with their rope scaling, biases, q/k norms and sliding windows; a key the model does not
implement is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dspark_jax.config.keys import Keys, eos_ids, read_json, with_generation_eos, yarn_mscale

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


def _llama_rope(k: Keys, max_positions: int) -> LlamaRope:
    key = next((n for n in ("rope_parameters", "rope_scaling") if k.raw.get(n)), "rope_scaling")
    rp = k.opt(key, default={})
    if not isinstance(rp, Mapping):
        k.fail(key, "must be an object")
    if any(isinstance(v, Mapping) for v in rp.values()):
        k.fail(key, "per-layer-type rope parameters are not supported")
    rk = Keys(rp, f"{k.where}: {key}")
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


def _sliding_layers(k: Keys, model_type: str, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
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
        k = Keys(raw, where)
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
        eos = eos_ids(k.opt("eos_token_id"))
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
        cfg = cls.from_dict(read_json(path), where=str(path))
        return with_generation_eos(cfg, path)


