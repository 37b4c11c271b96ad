"""RoPE (plain + DeepSeek YaRN, interleaved / NeoX) and the MLA layer against transformers and
numpy references (docs/architecture.md §1.5.4, §3.3, §3.4, §5.4)."""

import os

# The sharding test needs 8 host devices; `make test` sets this, a bare `pytest` gets it here
# (read when the CPU backend starts, which is after collection).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers import LlamaConfig as HFLlamaConfig
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kl
from transformers.models.llama import modeling_llama as hf_llama

from dspark_jax import sharding
from dspark_jax.config.keys import yarn_mscale
from dspark_jax.config.draft import DraftConfig, RopeScaling
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.mla import MLAttention, causal_mask
from dspark_jax.layers.rope import RotaryEmbedding, softmax_scale, yarn_correction_range, yarn_inv_freq_and_mscale
from dspark_jax.params import flat_params, logical_axes
from tests.float64 import TABLE_ULPS, TorchFloat64, assert_close, x64
from tests.float64 import share_rope_table as _share_table
from tests.float64 import ulps as _ulps

DRAFT_JSON = Path(__file__).resolve().parents[2] / "dspark_jax" / "configs" / "kimi-k3-dspark.json"

# Small yarn setting whose ramp falls inside the 8 rotary pairs (low 2, high 6) and whose
# mscale != mscale_all_dim, so the cos/sin multiplier differs from 1 and is exercised.
TINY_YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, rope_theta=10000.0,
                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)


def _to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))




def _randomize(module: nnx.Module, seed: int) -> nnx.Module:
    """O(1) activations instead of the 0.02-std init: matrices ~ N(0, 1/fan_in), norm weights ~ 1 ± 0.3,
    so attention scores are O(1) and the softmax is far from uniform (a weak layout/scale bug shows)."""
    rng = np.random.default_rng(seed)
    for p in flat_params(module).values():
        v = p.get_value()
        if v.ndim == 2:
            new = rng.standard_normal(v.shape) / np.sqrt(v.shape[1])
        else:
            new = 1.0 + 0.3 * rng.standard_normal(v.shape)
        p.set_value(jnp.asarray(new, v.dtype))
    return module


def _load_into_torch(ours: nnx.Module, theirs: torch.nn.Module) -> None:
    """Copy our weights by name; strict loading proves the NNX paths are the torch names."""
    sd = {name: _to_torch(p.get_value()) for name, p in flat_params(ours).items()}
    theirs.load_state_dict(sd, strict=True)


@nnx.jit(static_argnames="absorbed")
def _self_attn(m: MLAttention, x, pos, absorbed: bool = False):
    """One compiled program per call site shape instead of op-by-op dispatch (test speed)."""
    return m(x, pos, absorbed=absorbed)


@nnx.jit(static_argnames="absorbed")
def _attend(m: MLAttention, x, pos, kv, mask, absorbed: bool):
    return m.attend(x, pos, kv, mask, absorbed=absorbed)


def _additive_mask(mask_BTS: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.where(mask_BTS, 0.0, -1e30))[:, None]


# ---------------------------------------------------------------------------------------------
# 1. YaRN numbers (docs/architecture.md §3.4)


def test_yarn_k3_draft_numbers_and_transformers_inv_freq():
    cfg = DraftConfig.from_json(DRAFT_JSON)
    assert yarn_correction_range(cfg.rope, 64) == (15, 26)
    assert yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) == pytest.approx(1.3465736, abs=1e-7)
    assert softmax_scale(cfg.qk_head_dim, cfg.rope) == pytest.approx(0.13086080, abs=1e-8)
    inv_freq, attn_factor = yarn_inv_freq_and_mscale(cfg.rope, cfg.qk_rope_head_dim)
    assert inv_freq.shape == (32,) and inv_freq.dtype == np.float32
    assert attn_factor == 1.0  # mscale / mscale_all_dim = 1: the temperature is all in the softmax scale

    rp = cfg.raw["rope_parameters"]
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                              qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
                              max_position_embeddings=cfg.raw["max_position_embeddings"], rope_parameters=dict(rp))
    hf_inv, hf_factor = _compute_yarn_parameters(hf_cfg)
    assert hf_inv.dtype == torch.float32 and np.all(_ulps(inv_freq, hf_inv.numpy()) <= TABLE_ULPS)
    assert hf_factor == attn_factor
    # the ramp really interpolates: pairs < 15 keep base**(-2i/64), pairs > 26 are divided by 32
    base = 50000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv_freq[:15], base[:15], rtol=1e-6)
    np.testing.assert_allclose(inv_freq[27:], base[27:] / 32, rtol=1e-6)
    assert softmax_scale(192, RopeScaling()) == 192 ** -0.5  # no yarn -> no temperature


def test_yarn_tiny_multiplier_and_scale_match_transformers():
    rope = RopeScaling(**{k: float(v) if k != "rope_type" else v for k, v in TINY_YARN.items()})
    assert yarn_correction_range(rope, 16) == (2, 6)
    inv_freq, attn_factor = yarn_inv_freq_and_mscale(rope, 16)
    hf_cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=2, qk_rope_head_dim=16, qk_nope_head_dim=8,
                              rope_parameters=dict(TINY_YARN))
    hf_inv, hf_factor = _compute_yarn_parameters(hf_cfg)
    assert np.all(_ulps(inv_freq, hf_inv.numpy()) <= TABLE_ULPS)
    assert attn_factor == pytest.approx(hf_factor, rel=1e-12) and attn_factor != 1.0
    assert softmax_scale(24, rope) == pytest.approx(hf_ds.yarn_apply_mscale(hf_cfg.rope_parameters, 24 ** -0.5),
                                                    rel=1e-12)


# ---------------------------------------------------------------------------------------------
# 2. Rotation layouts


def _numpy_interleaved(x, pos, inv_freq, factor, angle_dtype):
    """The interleaved rotation of docs/architecture.md §3.4 in float64, from angles `pos * inv_freq` formed in
    `angle_dtype`: float32 is what every float32 implementation does (at position 65535 that
    rounding alone is ~4e-3 rad, so a float64 angle would not be its reference); float64 is our
    path for float64 inputs."""
    ang = (pos.astype(angle_dtype)[..., None] * inv_freq.astype(angle_dtype)).astype(np.float64)
    c, s = np.cos(ang) * factor, np.sin(ang) * factor
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return out


def _float32_rotation_bound(x, factor, pairs: str) -> np.ndarray:
    """Per element, how far a float32 rotation may be from the float64 evaluation of the same
    formula on the same float32 angles: each output is a*cos - b*sin (or b*cos + a*sin) with
    float32 cos/sin within 2 ulp(1) = 2^-23 of exact (libm, SLEEF, XLA: <= 1-2 ulp) and 1 ulp more
    for the multiplier, plus <= 2^-23 relative for the two products and the sum: (|a| + |b|) *
    factor * 2^-21 bounds all of it with room."""
    x = np.abs(np.asarray(x, np.float64))
    if pairs == "interleaved":
        m = x[..., 0::2] + x[..., 1::2]
        m = np.repeat(m, 2, axis=-1)
    else:
        half = x.shape[-1] // 2
        m = np.concatenate([x[..., :half] + x[..., half:]] * 2, axis=-1)
    return m * max(1.0, factor) * 2.0 ** -21


def test_interleaved_rotation_matches_spec_formula_and_deepseek_v3():
    rng = np.random.default_rng(0)
    B, T, N, R = 2, 5, 3, 16
    rope_cfg = RopeScaling(**{k: float(v) if k != "rope_type" else v for k, v in TINY_YARN.items()})
    rope = RotaryEmbedding.from_scaling(rope_cfg, R, interleaved=True)
    pos = np.array([[0, 1, 2, 3, 4], [7, 100, 2048, 9000, 65535]], np.int32)
    q = rng.standard_normal((B, T, N, R))
    k = rng.standard_normal((B, T, R))
    f = rope.attention_factor

    # float32 (the path of every bf16/f32 model): against the formula on the same float32 angles
    for x, p in ((q, pos[:, :, None]), (k, pos)):
        x32 = x.astype(np.float32)
        got = np.asarray(rope(jnp.asarray(x32), jnp.asarray(pos)), np.float64)
        want = _numpy_interleaved(x32, p, rope.inv_freq, f, np.float32)
        assert np.all(np.abs(got - want) <= _float32_rotation_bound(x32, f, "interleaved"))

    # float64, against the formula and against transformers' DeepseekV3 rotary (tests/float64.py)
    hf_cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=N, qk_rope_head_dim=R, qk_nope_head_dim=8,
                              rope_parameters=dict(TINY_YARN), rope_interleave=True)
    rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg).double()
    _share_table(rotary, rope)
    with torch.no_grad(), TorchFloat64():
        cos, sin = rotary(torch.zeros(1), torch.from_numpy(pos).long())
        hf_q, hf_k = hf_ds.apply_rotary_pos_emb_interleave(torch.from_numpy(q).transpose(1, 2),
                                                           torch.from_numpy(k)[:, None], cos, sin)
    with x64():
        q_rot = np.asarray(rope(jnp.asarray(q), jnp.asarray(pos)))     # ...TNR
        k_rot = np.asarray(rope(jnp.asarray(k), jnp.asarray(pos)))     # ...TR
    assert_close(q_rot, _numpy_interleaved(q, pos[:, :, None], rope.inv_freq, f, np.float64), "q vs formula")
    assert_close(k_rot, _numpy_interleaved(k, pos, rope.inv_freq, f, np.float64), "k vs formula")
    # transformers emits the rotated pairs de-interleaved ([evens | odds]); q·k is unchanged by that
    # shared permutation, but the cache keeps ATOM's interleaved layout, so compare after permuting.
    perm = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    assert_close(q_rot[..., perm], hf_q.transpose(1, 2), "q vs DeepseekV3")
    assert_close(k_rot[..., perm], hf_k[:, 0], "k vs DeepseekV3")


def test_neox_rotation_matches_llama():
    rng = np.random.default_rng(1)
    B, T, N, R = 2, 6, 3, 8
    rope = RotaryEmbedding.plain(R, 10000.0, interleaved=False)
    pos = np.array([[0, 1, 2, 3, 4, 5], [11, 12, 13, 500, 501, 502]], np.int32)
    q = rng.standard_normal((B, T, N, R))
    k = rng.standard_normal((B, T, 1, R))
    hf_cfg = HFLlamaConfig(hidden_size=N * R, num_attention_heads=N, head_dim=R, rope_theta=10000.0)
    rotary = hf_llama.LlamaRotaryEmbedding(hf_cfg).double()
    _share_table(rotary, rope)
    with torch.no_grad(), TorchFloat64():       # float64 both sides (tests/float64.py)
        cos, sin = rotary(torch.zeros(1), torch.from_numpy(pos).long())
        hf_q, hf_k = hf_llama.apply_rotary_pos_emb(torch.from_numpy(q).transpose(1, 2),
                                                   torch.from_numpy(k).transpose(1, 2), cos, sin)
    with x64():
        q_rot = np.asarray(rope(jnp.asarray(q), jnp.asarray(pos)))
        k_rot = np.asarray(rope(jnp.asarray(k), jnp.asarray(pos)))
    assert_close(q_rot, hf_q.transpose(1, 2), "q vs Llama rotary")
    assert_close(k_rot, hf_k.transpose(1, 2), "k vs Llama rotary")
    # float32: the same rotation within the float32 bound (see _float32_rotation_bound)
    q32 = q.astype(np.float32)
    got = np.asarray(rope(jnp.asarray(q32), jnp.asarray(pos)), np.float64)
    with torch.no_grad():
        cos32, sin32 = hf_llama.LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.from_numpy(pos).long())
        want = hf_llama.apply_rotary_pos_emb(torch.from_numpy(q32).transpose(1, 2).double(),
                                             torch.from_numpy(q32).transpose(1, 2).double(),
                                             cos32.double(), sin32.double())[0].transpose(1, 2).numpy()
    # transformers' float32 cos/sin, applied in float64: one float32 trig evaluation per side
    assert np.all(np.abs(got - want) <= _float32_rotation_bound(q32, 1.0, "neox"))
    # the two layouts really differ (a swapped flag must fail the parity tests above)
    other = RotaryEmbedding.plain(R, 10000.0, interleaved=True)
    with x64():
        assert not np.allclose(np.asarray(other(jnp.asarray(q), jnp.asarray(pos))), q_rot, atol=1e-3)


def test_rope_keeps_dtype_and_is_hashable_by_value():
    rope_a = RotaryEmbedding.plain(8, 10000.0, interleaved=True)
    rope_b = RotaryEmbedding.plain(8, 10000.0, interleaved=True)
    assert rope_a == rope_b and hash(rope_a) == hash(rope_b)
    assert rope_a != RotaryEmbedding.plain(8, 10000.0, interleaved=False)
    x = jnp.ones((1, 3, 8), jnp.bfloat16)
    assert rope_a(x, jnp.arange(3)[None]).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# 3./4. MLA parity with transformers


def _kimi_hf_config(q_lora_rank: int | None) -> KimiLinearConfig:
    return KimiLinearConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                            num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16, num_local_experts=4,
                            num_experts_per_tok=2, linear_num_heads=2, linear_head_dim=8, vocab_size=64,
                            pad_token_id=None, bos_token_id=None, eos_token_id=None, attn_implementation="eager")


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_target_mla_matches_transformers_kimi_linear(q_lora_rank):
    """Float64 on both sides (tests/float64.py: transformers' RMSNorm and softmax cast to float32,
    TorchFloat64 makes them float64)."""
    with x64():
        _target_mla_check(q_lora_rank)


def _target_mla_check(q_lora_rank):
    hf_cfg = _kimi_hf_config(q_lora_rank)
    cfg = KimiConfig.from_dict(hf_cfg.to_dict())
    assert cfg.mla_use_nope and not cfg.mla_use_output_gate
    ours = _randomize(MLAttention.for_target(cfg, dtype=jnp.float64, rngs=nnx.Rngs(0)), 0)
    theirs = hf_kl.KimiLinearAttention(hf_cfg, layer_idx=0).double().eval()
    # transformers' KimiLinearRMSNorm defaults to eps 1e-6 for q_a/kv_a, the same hard-coded value
    # as the K3 reference (docs/architecture.md §1.5.4), not the config's rms_norm_eps (1e-5)
    hf_norms = [theirs.kv_a_layernorm] + ([theirs.q_a_layernorm] if q_lora_rank else [])
    assert all(n.variance_epsilon == 1e-6 for n in hf_norms)
    assert ours.kv_a_layernorm.eps == cfg.mla_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    _load_into_torch(ours, theirs)

    B, T = 2, 7
    x = np.random.default_rng(2).standard_normal((B, T, 32))
    pos = np.broadcast_to(np.arange(T), (B, T))
    mask = np.asarray(causal_mask(B, T))
    with torch.no_grad(), TorchFloat64():
        ref = theirs(torch.from_numpy(x), _additive_mask(mask))[0]
    for absorbed in (False, True):
        out = np.asarray(_self_attn(ours, jnp.asarray(x), jnp.asarray(pos), absorbed))
        assert_close(out, ref, f"target MLA (absorbed={absorbed}) vs KimiLinearAttention")
    # NoPE: the cache row carries k_pe raw, so positions do not matter
    kv0 = ours.latent_kv(jnp.asarray(x), jnp.asarray(pos))
    kv1 = ours.latent_kv(jnp.asarray(x), jnp.asarray(pos) + 1000)
    np.testing.assert_array_equal(np.asarray(kv0), np.asarray(kv1))


def _tiny_draft(eps: float, heads: int = 4) -> DraftConfig:
    raw = dict(architectures=["K3DSparkModel"], model_type="k3_dspark", hidden_size=32, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=16,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=6, vocab_size=64,
               rms_norm_eps=eps, target_hidden_size=32, target_num_hidden_layers=4, target_layer_ids=[1, 2],
               num_target_layers=2, mask_token_id=63, markov_rank=4, rope_parameters=dict(TINY_YARN))
    return DraftConfig.from_dict(raw)


def test_draft_mla_matches_transformers_deepseek_v3_yarn_interleaved():
    """Float64 on both sides (tests/float64.py), with one float32 frequency table (_share_table)."""
    with x64():
        _draft_mla_check()


def _draft_mla_check():
    # DeepseekV3RMSNorm hard-codes eps 1e-6 on q_a/kv_a; the K3 draft uses config rms_norm_eps (1e-5,
    # docs/architecture.md §3.3), so the tiny draft is built with 1e-6 to compare like with like.
    cfg = _tiny_draft(eps=1e-6)
    hf_cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=6,
                              rope_parameters=dict(TINY_YARN), rope_interleave=True, attention_bias=False,
                              num_hidden_layers=1, vocab_size=64, attn_implementation="eager",
                              pad_token_id=None, bos_token_id=None, eos_token_id=None)
    ours = _randomize(MLAttention.for_draft(cfg, dtype=jnp.float64, rngs=nnx.Rngs(1)), 1)
    theirs = hf_ds.DeepseekV3Attention(hf_cfg, layer_idx=0).double().eval()
    rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg).double()
    _share_table(rotary, ours.rope)
    # same softmax temperature: qk**-0.5 * mscale(s, mscale_all_dim)**2 in both
    assert ours.softmax_scale == pytest.approx(theirs.scaling, rel=1e-12)
    assert theirs.q_a_layernorm.variance_epsilon == ours.q_a_layernorm.eps
    _load_into_torch(ours, theirs)

    B, T = 2, 6
    x = np.random.default_rng(3).standard_normal((B, T, 32))
    pos = np.array([np.arange(T), np.arange(T) + 300])       # absolute positions differ per row
    mask = np.asarray(causal_mask(B, T))
    with torch.no_grad(), TorchFloat64():
        cos_sin = rotary(torch.zeros(1), torch.from_numpy(pos).long())
        ref = theirs(torch.from_numpy(x), cos_sin, _additive_mask(mask))[0]
    for absorbed in (False, True):
        out = np.asarray(_self_attn(ours, jnp.asarray(x), jnp.asarray(pos), absorbed))
        assert_close(out, ref, f"draft MLA (absorbed={absorbed}) vs DeepseekV3Attention")
    # RoPE is relative: a common shift leaves the output alone (float64 angles: to float64
    # rounding of angles up to ~300 rad), a changed spacing does not
    shifted = np.asarray(_self_attn(ours, jnp.asarray(x), jnp.asarray(pos) + 7))
    assert_close(shifted, ref, "draft MLA at positions shifted by 7")
    spread = np.asarray(_self_attn(ours, jnp.asarray(x), jnp.asarray(pos) * 3))
    assert not np.allclose(spread, ref.numpy(), rtol=1e-2, atol=1e-2)


def test_k3_draft_mla_shapes_and_576_wide_latent_rows():
    """Abstract (no allocation): the full-size draft MLA declares the C.2 tensors and 576-wide rows."""
    cfg = DraftConfig.from_json(DRAFT_JSON)
    abstract = nnx.eval_shape(lambda: MLAttention.for_draft(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = {n: p.get_value().shape for n, p in flat_params(abstract).items()}
    assert shapes == {"q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,),
                      "q_b_proj.weight": (12288, 1536), "kv_a_proj_with_mqa.weight": (576, 7168),
                      "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (16384, 512),
                      "o_proj.weight": (7168, 8192)}
    # docs/architecture.md §3.2 attention params
    assert sum(np.prod(s) for s in shapes.values()) == 101_124_096
    axes = {n: logical_axes(p) for n, p in flat_params(abstract).items()}
    assert axes["kv_b_proj.weight"] == ("heads", "kv_lora") and axes["o_proj.weight"] == ("embed", "heads")
    assert abstract.q_a_layernorm.eps == 1e-5 and abstract.rope.interleaved
    assert abstract.softmax_scale == pytest.approx(0.13086080, abs=1e-8)
    graphdef, state = nnx.split(abstract)
    out = jax.eval_shape(lambda s, x, p: nnx.merge(graphdef, s).latent_kv(x, p), state,
                         jax.ShapeDtypeStruct((1, 7, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((1, 7), jnp.int32))
    assert out.shape == (1, 7, 576) and out.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# 5. absorbed == expanded over arbitrary latent rows and masks


def test_absorbed_equals_expanded_on_ragged_masks():
    """Float64 (tests/float64.py): the two forms reassociate the same sums."""
    with x64():
        _absorbed_expanded_check()


def _absorbed_expanded_check():
    cfg = _tiny_draft(eps=1e-5)
    mla = _randomize(MLAttention.for_draft(cfg, dtype=jnp.float64, rngs=nnx.Rngs(4)), 4)
    rng = np.random.default_rng(5)
    B, T, S = 2, 4, 11
    x = jnp.asarray(rng.standard_normal((B, T, 32)))
    kv = jnp.asarray(rng.standard_normal((B, S, 32)))                  # L = 16 + 16
    pos = jnp.asarray([[7, 8, 9, 10], [3, 4, 5, 6]])
    ragged = rng.random((B, T, S)) < 0.5
    ragged[0, 1] = False                                             # a dropped row
    block = np.zeros((B, T, S), bool)                                # DSpark: context 0..p + whole block
    block[0, :, :7] = True
    block[0, :, 7:11] = True
    block[1, :, :3] = True
    block[1, :, 7:11] = True
    block[1, 2] = False                                              # another dropped row
    for mask in (ragged, block):
        m = jnp.asarray(mask)
        expanded = np.asarray(_attend(mla, x, pos, kv, m, False))
        absorbed = np.asarray(_attend(mla, x, pos, kv, m, True))
        assert_close(absorbed, expanded, "absorbed vs expanded MLA")
        dropped = ~mask.any(-1)
        assert dropped.sum() == 1 and np.all(expanded[dropped] == 0) and np.all(absorbed[dropped] == 0)
        assert np.abs(expanded[~dropped]).min() > 0
    # gradients stay finite through fully masked rows (training drops blocks)
    def loss(kv_):
        return jnp.sum(mla.attend(x, pos, kv_, jnp.asarray(block), absorbed=True) ** 2)

    grad = jax.jit(jax.grad(loss))(kv)
    assert np.all(np.isfinite(np.asarray(grad)))
    # masking really selects rows: a masked-out row's content does not matter
    kv_changed = kv.at[1, 5].set(100.0)                               # row 5 of batch 1 is hidden by `block`
    np.testing.assert_array_equal(np.asarray(_attend(mla, x, pos, kv_changed, jnp.asarray(block), True)),
                                  np.asarray(_attend(mla, x, pos, kv, jnp.asarray(block), True)))


# ---------------------------------------------------------------------------------------------
# 6. output gate (docs/architecture.md §1.5.4)


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def test_output_gate_matches_spec_numpy_reference():
    """Float64 on both sides (tests/float64.py); then a bf16 sanity check (the bf16 rounding of
    the gate itself: tests/layers/test_bf16_casts.py)."""
    hf_cfg = _kimi_hf_config(16)
    cfg = KimiConfig.from_dict({**hf_cfg.to_dict(), "mla_use_output_gate": True})
    with x64():
        _output_gate_check(cfg)
    # bf16 params: the gate stays in bf16 and the result tracks fp32 to bf16 precision
    mla = _randomize(MLAttention.for_target(cfg, dtype=jnp.float32, rngs=nnx.Rngs(6)), 6)
    mla16 = _randomize(MLAttention.for_target(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(6)), 6)
    x = np.random.default_rng(7).standard_normal((2, 5, 32))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    out16 = _self_attn(mla16, jnp.asarray(x, jnp.bfloat16), pos)
    assert out16.dtype == jnp.bfloat16
    ref16 = np.asarray(_self_attn(mla, jnp.asarray(x, jnp.float32), pos))   # same seed: same weights, rounded
    np.testing.assert_allclose(np.asarray(out16, np.float32), ref16, rtol=0.1, atol=0.05 * np.abs(ref16).max())


def _output_gate_check(cfg):
    mla = _randomize(MLAttention.for_target(cfg, dtype=jnp.float64, rngs=nnx.Rngs(6)), 6)
    w = {n: np.asarray(p.get_value(), np.float64) for n, p in flat_params(mla).items()}
    assert w["g_proj.weight"].shape == (4 * 6, 32)
    B, T, N, H, R, V, C = 2, 5, 4, 8, 4, 6, 16
    x = np.random.default_rng(7).standard_normal((B, T, 32))

    c_q = _rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], 1e-6)
    q = (c_q @ w["q_b_proj.weight"].T).reshape(B, T, N, H + R)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = _rms(kv[..., :C], w["kv_a_layernorm.weight"], 1e-6)
    kvb = (c_kv @ w["kv_b_proj.weight"].T).reshape(B, T, N, H + V)
    k = np.concatenate([kvb[..., :H], np.broadcast_to(kv[:, :, None, C:], (B, T, N, R))], -1)
    s = np.einsum("btnk,bsnk->bnts", q, k) * (H + R) ** -0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnv->btnv", p, kvb[..., H:]).reshape(B, T, N * V)
    o = o / (1 + np.exp(-(x @ w["g_proj.weight"].T)))
    ref = o @ w["o_proj.weight"].T

    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    for absorbed in (False, True):
        out = np.asarray(_self_attn(mla, jnp.asarray(x), pos, absorbed))
        assert_close(out, ref, f"gated MLA (absorbed={absorbed}) vs numpy spec")
    ungated = np.asarray(mla.o_proj(jnp.asarray(o * (1 + np.exp(-(x @ w["g_proj.weight"].T))))))
    assert not np.allclose(ungated, ref, rtol=1e-2)                  # the gate is not a no-op here


# ---------------------------------------------------------------------------------------------
# 7. heads sharded over 8 devices


def test_heads_sharded_over_8_devices_equals_single_device():
    assert len(jax.devices()) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = _tiny_draft(eps=1e-5, heads=8)
    single = _randomize(MLAttention.for_draft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(8)), 8)
    mesh = sharding.make_mesh(tensor=8, devices=jax.devices()[:8])
    sharded = sharding.create_sharded(lambda: MLAttention.for_draft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(8)),
                                      mesh)
    for name, p in flat_params(sharded).items():                      # same values, sharded placement
        p.set_value(jax.device_put(flat_params(single)[name].get_value(), p.get_value().sharding))
    assert sharded.kv_b_proj.weight.get_value().sharding.spec == P("tensor", None)
    assert sharded.o_proj.weight.get_value().sharding.spec == P(None, "tensor")
    assert sharded.q_b_proj.weight.get_value().sharding.spec == P("tensor", None)

    rng = np.random.default_rng(9)
    B, T, S = 2, 5, 9
    x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, S, 32)), jnp.float32)
    pos = jnp.asarray([[4, 5, 6, 7, 8], [1, 2, 3, 4, 5]])
    mask = jnp.asarray(rng.random((B, T, S)) < 0.7)

    pairs = [(_self_attn(sharded, x, pos), _self_attn(single, x, pos))]
    pairs += [(_attend(sharded, x, pos, kv, mask, a), _attend(single, x, pos, kv, mask, a)) for a in (False, True)]
    for got, want in pairs:
        assert got.sharding.num_devices == 8
        # partitioned contractions sum in a different order: fp32 rounding only (outputs of O(1))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
