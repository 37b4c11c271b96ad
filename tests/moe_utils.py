"""Tiny Kimi MoE configs, weight randomisation and numpy SiTU shared by the MoE tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.params import flat_params

D = 32
MXFP4 = dict(quant_method="compressed-tensors", format="mxfp4-pack-quantized",
             config_groups=dict(group_0=dict(targets=["Linear"], weights=dict(
                 num_bits=4, type="float", strategy="group", group_size=32, symmetric=True))))


def kimi_cfg(**over) -> KimiConfig:
    """Kimi-Linear MoE (SiLU, full-width experts, shared experts); K3 keys come in via `over`."""
    d = dict(vocab_size=64, hidden_size=D, num_hidden_layers=2, intermediate_size=48,
             num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
             num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16,
             moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=1, topk_group=1,
             hidden_act="silu", rms_norm_eps=1e-5,
             linear_attn_config=dict(num_heads=2, head_dim=8, kda_layers=[1], full_attn_layers=[2]))
    d.update(over)
    return KimiConfig.from_dict(d)


def k3_cfg(**over) -> KimiConfig:
    """K3 FFN: latent experts (D -> 32) with routed_expert_norm, SiTU, 2 shared experts, 3-of-8."""
    kw = dict(hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
              routed_expert_hidden_size=32, latent_moe_use_norm=True, moe_intermediate_size=32,
              num_shared_experts=2, num_experts_per_token=3, routed_scaling_factor=1.0)
    kw.update(over)
    return kimi_cfg(**kw)


def randomize(module, seed: int, std: float = 0.3, bias: float = 0.15) -> dict[str, np.ndarray]:
    """Give every float weight N(0, std) (the 0.02 init leaves the router nearly uniform) and the
    selection bias U(-bias, bias); returns the numpy values by torch name."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in flat_params(module).items():
        v = p.get_value()
        if jnp.issubdtype(v.dtype, jnp.integer):
            out[name] = np.asarray(v)
            continue
        if name.endswith("e_score_correction_bias"):
            new = rng.uniform(-bias, bias, v.shape)
        elif name.endswith("norm.weight"):
            new = 1.0 + 0.2 * rng.standard_normal(v.shape)
        else:
            new = std * rng.standard_normal(v.shape)
        p.set_value(jnp.asarray(new, v.dtype))
        out[name] = np.asarray(p.get_value()).astype(np.float64)
    return out


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))          # no exp overflow at |x| ~ 1e4


def np_situ(g, u, beta=4.0, linear_beta=25.0):
    return beta * np.tanh(g / beta) * np_sigmoid(g) * (linear_beta * np.tanh(u / linear_beta))
