"""Tiny kimi_linear-family configs shared by tests (float32, seconds to run), and a writer of
models in the K3 checkpoint layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.safetensors_io import save_arrays


def kimi_linear_dict(**over) -> dict:
    """Plain Kimi-Linear (every K3 extension off): 2 KDA + 2 MLA layers, MoE with shared experts."""
    d = dict(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=6, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=1, topk_group=1,
        hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=4,
                                kda_layers=[1, 3], full_attn_layers=[2, 4]),
    )
    d.update(over)
    return d


def tiny_k3_dict(quantized: bool = True, **over) -> dict:
    """Every K3 extension on: AttnRes (block 2), latent MoE + norm, SiTU, MLA output gate,
    full-rank KDA gate with the -5 lower bound, MXFP4 experts, the multimodal wrapper."""
    text = kimi_linear_dict(
        model_type="kimi_linear", num_hidden_layers=5, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        routed_expert_hidden_size=32, latent_moe_use_norm=True, moe_intermediate_size=32,
        routed_scaling_factor=1.0, mla_use_nope=True, mla_use_output_gate=True,
        attn_res_block_size=2, num_experts=8,
        linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0, use_full_rank_gate=True,
                                kda_layers=[1, 2, 3], full_attn_layers=[4, 5]),
    )
    if quantized:
        text["quantization_config"] = dict(
            quant_method="compressed-tensors", format="mxfp4-pack-quantized",
            config_groups=dict(group_0=dict(targets=["Linear"], weights=dict(
                num_bits=4, type="float", strategy="group", group_size=32, symmetric=True))))
    text.update(over)
    return dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
                text_config=copy.deepcopy(text))


def write_k3_checkpoint(model, path: Path, config: dict, drop=None, extra=None, reshape=None,
                        retype=None) -> Path:
    """`model` in the K3 HF layout (prefixed names, one tensor per expert, two shards + index),
    with at most one defect of each kind: a tensor dropped, an extra one, one reshaped, retyped."""
    prefix = model.cfg.tensor_prefix
    arrays = {}
    for name, p in params_lib.flat_params(model).items():
        arr = np.asarray(p.get_value())
        if ".experts." in name:
            stem, leaf = name.split(".experts.")
            arrays.update({f"{prefix}{stem}.experts.{e}.{leaf}": arr[e] for e in range(arr.shape[0])})
        else:
            arrays[prefix + name] = arr
    if drop:
        del arrays[drop]
    if extra:
        arrays[extra] = np.zeros(3, np.float32)
    if reshape:
        arrays[reshape] = np.zeros((2, 2), arrays[reshape].dtype)
    if retype:
        arrays[retype] = arrays[retype].astype(np.float16)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(arrays)
    index = {}
    for shard, chunk in (("model-00001-of-00002.safetensors", names[: len(names) // 2]),
                         ("model-00002-of-00002.safetensors", names[len(names) // 2:])):
        save_arrays(path / shard, {n: arrays[n] for n in chunk})
        index.update({n: shard for n in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def tiny_k3_tp_dict(num_layers: int = 5) -> dict:
    """tiny K3 (every extension, MXFP4 experts) with 4 MLA and 4 KDA heads and 8 experts: a
    tensor axis of 4 gives each device one head of each kind and 2 experts. `num_layers` >= 3:
    the last two MLA (one with 3), the others KDA; the first dense, the others MoE."""
    full = [num_layers] if num_layers == 3 else [num_layers - 1, num_layers]
    return tiny_k3_dict(num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
                        linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=4,
                                                gate_lower_bound=-5.0, use_full_rank_gate=True,
                                                kda_layers=[i for i in range(1, num_layers + 1) if i not in full],
                                                full_attn_layers=full))
