"""The kimi_linear-family target against transformers' KimiLinear (extensions off) and against
numpy references of the K3 extensions (docs/architecture.md §1.5)."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.checkpoint.loader import load_kimi
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.models.kimi import KimiLinearModel, Residual
from tests.float64 import TorchFloat64, assert_close, x64
from tests.kimi_configs import kimi_linear_dict, tiny_k3_dict, write_k3_checkpoint

# jitted: eager op-by-op dispatch of the MoE/KDA loops is far slower than one compile
_forward = jax.jit(lambda m, x, aux=(): m.forward(x, aux_layer_ids=aux), static_argnums=2)

# ------------------------------------------------------------------------------------------------
# Kimi-Linear vs transformers


def _hf_config(d: dict):
    from transformers import KimiLinearConfig
    return KimiLinearConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        moe_intermediate_size=d["moe_intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        num_local_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_token"],
        n_shared_experts=d["num_shared_experts"], routed_scaling_factor=d["routed_scaling_factor"],
        first_k_dense_replace=d["first_k_dense_replace"], rms_norm_eps=d["rms_norm_eps"],
        linear_attn_config=d["linear_attn_config"], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def hf_kimi_linear(tmp_path_factory):
    """A random tiny KimiLinearForCausalLM written by save_pretrained, plus the torch model."""
    from transformers import KimiLinearForCausalLM
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(_hf_config(kimi_linear_dict())).float().eval()
    model.set_experts_implementation("eager")   # the default grouped_mm has no float64 kernel
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # large enough to change which experts win the selection
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    path = tmp_path_factory.mktemp("kimi_linear")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def test_kimi_linear_matches_transformers(hf_kimi_linear):
    """Float64 on both sides (tests/float64.py): the checkpoint's float32 weights are exact in
    float64, our model runs under x64, transformers' model `.double()` under TorchFloat64 (its
    own float32 casts in RMSNorm, softmax, router and the KDA chunk recurrence become float64).
    Differences are then float64 reassociation only (measured <= 6e-14 relative)."""
    model, path = hf_kimi_linear
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 96, size=(2, 150))                  # > 2 KDA chunks of 64
    model64 = copy.deepcopy(model).double()
    with torch.no_grad(), TorchFloat64():
        ref = model64(torch.as_tensor(ids), output_hidden_states=True, use_cache=False)
    with x64():
        ours = load_kimi(path, dtype=jnp.float64)
        cfg = ours.cfg
        n = cfg.num_hidden_layers
        out = jax.jit(lambda m, x: m.forward(x, aux_layer_ids=tuple(range(n))))(ours, jnp.asarray(ids))
        aux = np.asarray(out.aux_hidden).reshape(2, 150, n, cfg.hidden_size)
        logits = np.asarray(out.logits)
    hs = ref.hidden_states
    assert len(hs) == n + 1
    for layer in range(n - 1):   # HF's last hidden_states entry is post-norm, not the layer output
        assert_close(aux[:, :, layer], hs[layer + 1], f"layer {layer} output")
    assert_close(logits, ref.logits, "logits")


def test_final_hidden_feeds_lm_head(hf_kimi_linear):
    _, path = hf_kimi_linear
    ours = load_kimi(path, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 96, size=(1, 20)))
    out = _forward(ours, ids)
    w = ours.lm_head.weight.get_value()
    np.testing.assert_allclose(np.asarray(out.final_hidden @ w.T), np.asarray(out.logits), rtol=1e-5, atol=1e-5)


def test_config_reads_save_pretrained(hf_kimi_linear):
    _, path = hf_kimi_linear
    cfg = KimiConfig.from_json(path)
    assert cfg.kda_layers == (0, 2) and cfg.full_attn_layers == (1, 3)
    assert cfg.num_experts == 6 and cfg.num_experts_per_token == 2 and cfg.num_shared_experts == 1
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate and cfg.attn_res_block_size is None


# ------------------------------------------------------------------------------------------------
# K3 extensions


def _tiny_k3(quantized=True, seed=0, dtype=jnp.float32):
    cfg = KimiConfig.from_dict(tiny_k3_dict(quantized))
    return KimiLinearModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def test_tiny_k3_runs_and_aux_is_layer_output():
    model = _tiny_k3()
    cfg = model.cfg
    assert cfg.tensor_prefix == "language_model." and cfg.quantization == "mxfp4"
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 96, size=(2, 24)))
    out = _forward(model, ids, (1, 3, 4))
    assert np.isfinite(np.asarray(out.logits)).all()
    # the captured aux is exactly what each decoder layer returns (docs/architecture.md §2: prefix, not the mix)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    mask = jnp.tril(jnp.ones((24, 24), bool))[None]

    def attention(idx, attn, x):
        return attn(x, positions, mask) if model.cfg.is_mla(idx) else attn(x)[0]

    @jax.jit
    def layer_outputs(model, ids):
        res = Residual(model.model.embed_tokens(ids), ())
        outs = []
        for layer in model.model.layers:
            res = layer(res, attention)
            outs.append(res.prefix)
        return outs

    outs = layer_outputs(model, ids)
    want = np.concatenate([np.asarray(outs[i]) for i in (1, 3, 4)], -1)
    np.testing.assert_allclose(np.asarray(out.aux_hidden), want, rtol=1e-6, atol=1e-6)
    # final_hidden @ lm_head == logits
    w = model.lm_head.weight.get_value()
    np.testing.assert_allclose(np.asarray(out.final_hidden @ w.T), np.asarray(out.logits), rtol=1e-5, atol=1e-5)


def _np_attn_res(prefix, blocks, proj_w, norm_w, eps):
    v = np.concatenate([np.stack(blocks, -2), prefix[..., None, :]], -2).astype(np.float64)
    k = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
    s = (k * (norm_w * proj_w[0])).sum(-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p[..., None] * v).sum(-2)


def test_attn_res_banking_matches_spec_loop():
    """The model's layer loop vs a numpy transcription of docs/architecture.md §1.5.2, with attention and FFN as
    black boxes evaluated on the numpy inputs: checks banking at idx % block == 0 (layer 0 banks
    the embeddings), the two mixes per layer, and the output mix. Float64 on both sides."""
    with x64():
        _attn_res_banking_check()


def _attn_res_banking_check():
    model = _tiny_k3(quantized=False, dtype=jnp.float64)
    cfg = model.cfg
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 96, size=(1, 16)))
    rng = np.random.default_rng(3)
    attn_w = {l.layer_idx: rng.normal(size=(cfg.hidden_size, cfg.hidden_size)) / 6 for l in model.model.layers}

    def attention(idx, attn, x):
        return jnp.tanh(x @ jnp.asarray(attn_w[idx], jnp.float64))

    res, _ = model.run_layers(model.model.embed_tokens(ids), attention)
    final = model.model.final_hidden(res)

    eps = cfg.rms_norm_eps
    g = lambda p: np.asarray(p.get_value(), np.float64)
    prefix = np.asarray(model.model.embed_tokens(ids), np.float64)
    blocks = []
    for layer in model.model.layers:
        h = prefix
        if blocks:
            h = _np_attn_res(prefix, blocks, g(layer.self_attention_res_proj.weight),
                             g(layer.self_attention_res_norm.weight), eps)
        if layer.layer_idx % cfg.attn_res_block_size == 0:
            blocks.append(prefix)
            prefix = None
        x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps) * g(layer.input_layernorm.weight)
        a = np.tanh(x @ attn_w[layer.layer_idx])
        prefix = a if prefix is None else prefix + a
        h = _np_attn_res(prefix, blocks, g(layer.mlp_res_proj.weight), g(layer.mlp_res_norm.weight), eps)
        x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps) * g(layer.post_attention_layernorm.weight)
        prefix = prefix + np.asarray(layer.ffn(jnp.asarray(x, jnp.float64)))
    assert len(blocks) == math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size)
    mixed = _np_attn_res(prefix, blocks, g(model.model.output_attn_res_proj.weight),
                         g(model.model.output_attn_res_norm.weight), eps)
    want = mixed / np.sqrt(np.mean(mixed ** 2, -1, keepdims=True) + eps) * g(model.model.norm.weight)
    assert_close(np.asarray(final), want, "final hidden after the AttnRes layer loop")


# ------------------------------------------------------------------------------------------------
# checkpoints: the K3 layout (language_model. prefix, per-expert packed tensors)


def _write_k3_checkpoint(model: KimiLinearModel, path, **defect):
    return write_k3_checkpoint(model, path, tiny_k3_dict(model.cfg.quantization is not None), **defect)


def test_k3_checkpoint_round_trip(tmp_path):
    model = _tiny_k3()
    path = _write_k3_checkpoint(model, tmp_path / "k3")
    loaded = load_kimi(path, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(4).integers(3, 96, size=(2, 12)))
    np.testing.assert_array_equal(np.asarray(_forward(model, ids).logits), np.asarray(_forward(loaded, ids).logits))
    # packed experts stay packed in memory
    w1 = loaded.model.layers[1].block_sparse_moe.experts.w1.weight_packed.get_value()
    assert w1.dtype == jnp.uint8


@pytest.mark.parametrize("kind", ["missing", "extra", "shape", "dtype", "truncated"])
def test_loader_errors_name_the_tensor(tmp_path, kind):
    model = _tiny_k3()
    name = "language_model.model.layers.1.self_attn.q_proj.weight"
    kw = {"missing": dict(drop=name), "extra": dict(extra="language_model.model.bogus.weight"),
          "shape": dict(reshape=name), "dtype": dict(retype=name), "truncated": {}}[kind]
    path = _write_k3_checkpoint(model, tmp_path / "k3", **kw)
    if kind == "truncated":
        shard = path / "model-00002-of-00002.safetensors"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as e:
        load_kimi(path, dtype=jnp.float32, dtype_policy="strict")
    msg = str(e.value)
    want = {"missing": name, "extra": "bogus", "shape": name, "dtype": name,
            "truncated": "model-00002-of-00002.safetensors"}[kind]
    assert want in msg, msg


def test_unknown_quantization_is_rejected(tmp_path):
    d = tiny_k3_dict()
    d["text_config"]["quantization_config"]["quant_method"] = "gptq"
    from dspark_jax.config.keys import ConfigError
    with pytest.raises(ConfigError, match="quantization_config"):
        KimiConfig.from_dict(d)


# ------------------------------------------------------------------------------------------------
# sharding and the full-size abstract build


def test_eight_devices_equal_one_device():
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    d = tiny_k3_dict(quantized=False)
    d["text_config"].update(num_attention_heads=8, num_experts=8,
                            linear_attn_config=dict(d["text_config"]["linear_attn_config"], num_heads=8))
    cfg = KimiConfig.from_dict(d)
    single = KimiLinearModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(tensor=8)
    sharded = sharding.shard_module(nnx.clone(single), mesh)
    spec = lambda p: p.get_value().sharding.spec
    assert spec(sharded.model.layers[0].self_attn.q_proj.weight)[0] == "tensor"
    assert spec(sharded.model.layers[1].block_sparse_moe.experts.w1.weight)[0] == "tensor"
    assert spec(sharded.lm_head.weight)[0] == "tensor"
    ids = jnp.asarray(np.random.default_rng(5).integers(3, 96, size=(2, 16)))
    a = np.asarray(_forward(single, ids).logits)
    b = np.asarray(jax.jit(lambda m, x: m.forward(x).logits)(sharded, ids))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_full_k3_builds_abstractly_with_exact_param_count():
    from importlib import resources
    path = resources.files("dspark_jax") / "configs" / "kimi-k3.json"
    cfg = KimiConfig.from_json(path)
    model = params_lib.abstract(lambda: KimiLinearModel(cfg, rngs=nnx.Rngs(0)))
    flat = params_lib.flat_params(model)
    expert = {k: v for k, v in flat.items() if ".experts." in k}
    other = {k: v for k, v in flat.items() if ".experts." not in k}
    n = lambda d: sum(math.prod(v.get_value().shape) for v in d.values())
    # from the docs/architecture.md §1.3 shapes: globals + per-layer common + 69 KDA + 24 MLA + dense layer 0 + 92 MoE
    assert n(other) == 56_743_648_000
    packed = n({k: v for k, v in expert.items() if k.endswith("weight_packed")})
    scales = n({k: v for k, v in expert.items() if k.endswith("weight_scale")})
    assert packed * 2 == 92 * 896 * 3 * 3072 * 3584 == 2_722_740_830_208    # 4-bit params
    assert scales * 32 == packed * 2
    assert all(v.get_value().dtype == jnp.uint8 for v in expert.values())
