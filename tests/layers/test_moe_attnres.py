"""FFN side of the Kimi target (docs/architecture.md §1.4, §1.5.2, §1.5.5): the noaux_tc router and MoE against
transformers' Kimi-Linear, the K3 latent SiTU MoE against a numpy transcription of docs/architecture.md §1.5.5, MXFP4
bytes, GLU MLPs, the AttnRes mixer (incl. values where a naive fp32 RMS overflows) and expert
parallelism on 8 fake devices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.attn_res import attn_res
from dspark_jax.layers.mlp import GLUMLP, situ
from dspark_jax.layers.moe import MoE, route
from dspark_jax.layers.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from dspark_jax.params import flat_params
from tests.device_utils import on_eight_devices
from tests.float64 import TorchFloat64, assert_close, x64
from tests.moe_utils import D, MXFP4, k3_cfg, kimi_cfg, np_sigmoid, np_situ, randomize



@nnx.jit
def apply(module, x):
    """Modules run under jit in the models; here it also keeps the test fast."""
    return module(x)


jit_attn_res = jax.jit(attn_res, static_argnums=4)
jit_route = jax.jit(route, static_argnums=2)


def unbiased_choice_differs(moe: MoE, x: np.ndarray) -> bool:
    """Whether the correction bias changes some token's expert set (else the test proves nothing)."""
    logits = apply(moe.gate, jnp.asarray(x.reshape(-1, D)))
    cfg = moe.cfg
    biased, _ = jit_route(logits, moe.gate.e_score_correction_bias.get_value(), cfg)
    plain, _ = jit_route(logits, jnp.zeros(cfg.num_experts), cfg)
    return any(set(a) != set(b) for a, b in zip(np.asarray(biased).tolist(), np.asarray(plain).tolist()))


# ------------------------------------------------------------------------------------------------
# 1. Kimi-Linear MoE == transformers KimiLinearMoE


def hf_kimi_config(cfg: KimiConfig):
    from transformers import KimiLinearConfig
    return KimiLinearConfig(
        vocab_size=64, hidden_size=D, intermediate_size=48, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8, linear_num_heads=2,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
        n_shared_experts=cfg.num_shared_experts, n_group=cfg.num_expert_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.moe_renormalize, routed_scaling_factor=cfg.routed_scaling_factor,
        hidden_act="silu", first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def copy_into_hf_moe(hf_moe, w: dict[str, np.ndarray]) -> None:
    """Our stacked w1/w3/w2 -> transformers' fused `gate_up_proj [E, 2I, D]` (gate first) and
    `down_proj [E, D, I]` (in the torch module's dtype)."""
    import torch

    t = lambda a: torch.tensor(a, dtype=hf_moe.gate.weight.dtype)
    with torch.no_grad():
        hf_moe.gate.weight.copy_(t(w["gate.weight"]))
        hf_moe.gate.e_score_correction_bias.copy_(t(w["gate.e_score_correction_bias"]))
        hf_moe.experts.gate_up_proj.copy_(t(np.concatenate([w["experts.w1.weight"], w["experts.w3.weight"]], 1)))
        hf_moe.experts.down_proj.copy_(t(w["experts.w2.weight"]))
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf_moe.shared_experts, n).weight.copy_(t(w[f"shared_experts.{n}.weight"]))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_kimi_linear_moe_matches_transformers(n_group, topk_group):
    """Float64 on both sides (tests/float64.py; transformers' router casts to float32, TorchFloat64
    makes that float64). Measured <= 1e-15 relative on the weights and outputs."""
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    cfg = kimi_cfg(num_expert_group=n_group, topk_group=topk_group)
    hf = KimiLinearMoE(hf_kimi_config(cfg)).double().eval()
    with x64():
        moe = MoE(cfg, dtype=jnp.float64, rngs=nnx.Rngs(0))
        w = randomize(moe, seed=1)
        copy_into_hf_moe(hf, w)
        x = np.random.default_rng(2).standard_normal((2, 24, D))
        assert unbiased_choice_differs(moe, x)

        with torch.no_grad(), TorchFloat64():
            _, hf_w, hf_idx = hf.gate(torch.tensor(x))
            y_hf = hf(torch.tensor(x))
        idx, weights = jit_route(apply(moe.gate, jnp.asarray(x.reshape(-1, D))),
                                 moe.gate.e_score_correction_bias.get_value(), cfg)
        # same expert sets and weights (transformers' top-k is unsorted: compare sorted by expert id)
        order, hf_order = np.argsort(np.asarray(idx), -1), np.argsort(hf_idx.numpy(), -1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                      np.take_along_axis(hf_idx.numpy(), hf_order, -1))
        assert_close(np.take_along_axis(np.asarray(weights), order, -1),
                     np.take_along_axis(hf_w.numpy(), hf_order, -1), "combine weights")
        assert_close(np.asarray(apply(moe, jnp.asarray(x))), y_hf, "MoE output")


def test_transformers_save_pretrained_expert_layout(tmp_path):
    """What `save_pretrained` writes for Kimi-Linear (the loader depends on it): the fused
    `mlp.experts.gate_up_proj`/`down_proj` are split back per expert under `block_sparse_moe.`
    (w1 = gate rows, w3 = up rows, w2 = down), and even the DENSE layer-0 MLP is renamed
    `block_sparse_moe.{gate,up,down}_proj` (the reverse of transformers' `.block_sparse_moe.` ->
    `.mlp.` rename). Stacking the per-expert tensors reproduces transformers' MoE output."""
    import torch
    from safetensors.numpy import load_file
    from transformers import KimiLinearForCausalLM

    cfg = kimi_cfg(num_experts=4)
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hf_kimi_config(cfg)).float().eval()
    hf.set_experts_implementation("eager")       # the default grouped_mm has no float64 kernel
    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    pre = "model.layers.1.block_sparse_moe."
    inter = cfg.moe_intermediate_size
    assert not any(".mlp." in k for k in saved)
    assert {f"model.layers.0.block_sparse_moe.{n}_proj.weight" for n in ("gate", "up", "down")} <= set(saved)
    assert {k for k in saved if k.startswith(pre + "experts.")} == {
        f"{pre}experts.{e}.w{j}.weight" for e in range(4) for j in (1, 2, 3)}
    assert saved[pre + "gate.e_score_correction_bias"].dtype == np.float32
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    for e in range(4):
        assert saved[f"{pre}experts.{e}.w1.weight"].shape == (inter, D)
        np.testing.assert_array_equal(saved[f"{pre}experts.{e}.w1.weight"], gate_up[e, :inter])
        np.testing.assert_array_equal(saved[f"{pre}experts.{e}.w3.weight"], gate_up[e, inter:])
        assert saved[f"{pre}experts.{e}.w2.weight"].shape == (D, inter)

    hf_mlp = hf.model.layers[1].mlp.double()
    x = np.random.default_rng(3).standard_normal((1, 16, D))
    with torch.no_grad(), TorchFloat64():
        y_hf = hf_mlp(torch.tensor(x))
    with x64():                                  # float64 both sides (tests/float64.py)
        moe = MoE(cfg, dtype=jnp.float64, rngs=nnx.Rngs(0))
        params = flat_params(moe)
        for name, p in params.items():
            if name.startswith("experts."):
                j = name.split(".")[1]
                p.set_value(jnp.stack([saved[f"{pre}experts.{e}.{j}.weight"] for e in range(4)]).astype(jnp.float64))
            else:
                p.set_value(jnp.asarray(saved[pre + name], jnp.float64))
        assert_close(np.asarray(apply(moe, jnp.asarray(x))), y_hf, "MoE from the save_pretrained tensors")


# ------------------------------------------------------------------------------------------------
# 2. K3 latent SiTU MoE == numpy transcription of docs/architecture.md §1.5.5


def np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def np_k3_moe(x, w, cfg: KimiConfig):
    """docs/architecture.md §1.5.5 line by line in float64 (n_group = 1)."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    scores = np_sigmoid(x @ w["gate.weight"].T)
    choice = scores + w["gate.e_score_correction_bias"]
    idx = np.argsort(-choice, -1, kind="stable")[:, :cfg.num_experts_per_token]
    wts = np.take_along_axis(scores, idx, -1)
    if cfg.moe_renormalize:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    wts = wts * cfg.routed_scaling_factor
    z = x @ w["routed_expert_down_proj.weight"].T
    y = np.zeros_like(z)
    for n in range(x.shape[0]):
        for e, we in zip(idx[n], wts[n]):
            h = np_situ(w["experts.w1.weight"][e] @ z[n], w["experts.w3.weight"][e] @ z[n])
            y[n] += we * (w["experts.w2.weight"][e] @ h)
    if cfg.latent_moe_use_norm:
        y = np_rms(y, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
    y = y @ w["routed_expert_up_proj.weight"].T
    sh = lambda n: w[f"shared_experts.{n}_proj.weight"]
    return y + np_situ(x @ sh("gate").T, x @ sh("up").T) @ sh("down").T


@pytest.mark.parametrize("use_norm,renorm", [(True, True), (False, False)])
def test_k3_latent_situ_moe_matches_spec(use_norm, renorm):
    """Float64 on both sides (tests/float64.py)."""
    with x64():
        _k3_latent_situ_moe_check(use_norm, renorm)


def _k3_latent_situ_moe_check(use_norm, renorm):
    cfg = k3_cfg(latent_moe_use_norm=use_norm, moe_renormalize=renorm)
    moe = MoE(cfg, dtype=jnp.float64, rngs=nnx.Rngs(0))
    w = randomize(moe, seed=4, std=0.4)
    names = set(w)
    assert ("routed_expert_norm.weight" in names) == use_norm
    assert {"routed_expert_down_proj.weight", "routed_expert_up_proj.weight",
            "shared_experts.gate_proj.weight"} <= names
    assert w["experts.w1.weight"].shape == (8, 32, 32) and w["experts.w2.weight"].shape == (8, 32, 32)
    assert w["shared_experts.gate_proj.weight"].shape == (64, D)
    x = np.random.default_rng(5).standard_normal((2, 20, D))
    assert unbiased_choice_differs(moe, x)
    y = np.asarray(apply(moe, jnp.asarray(x))).reshape(-1, D)
    ref = np_k3_moe(x, w, cfg)
    assert np.abs(ref).max() > 1.0
    assert_close(y, ref, "K3 latent SiTU MoE vs numpy spec")


# ------------------------------------------------------------------------------------------------
# 3. MXFP4


def transformers_decode(packed: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """An independent MXFP4 decoder: transformers' `integrations.mxfp4.convert_moe_packed_tensors`
    (GPT-OSS's loader: its own E2M1 table, low nibble first, `ldexp` by the E8M0 exponent, computed
    in `dtype`). It takes `[E, rows, groups, 16]` bytes + `[E, rows, groups]` scales and returns
    `[E, in, rows]`; ours is `[..., rows, in/2]` + `[..., rows, in/32]` -> `[..., rows, in]`."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    *lead, rows, half = packed.shape
    e = math.prod(lead)
    blocks = torch.from_numpy(np.ascontiguousarray(packed).reshape(e, rows, half // 16, 16))
    w = convert_moe_packed_tensors(blocks, torch.from_numpy(np.ascontiguousarray(scales).reshape(e, rows, -1)),
                                   dtype={jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[dtype])
    return w.transpose(1, 2).float().numpy().reshape(*lead, rows, 2 * half)


def _same_bits(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp4_decode_matches_transformers(dtype):
    """Every byte at every E8M0 exponent 2..254, bit for bit (signed zeros and overflow to inf
    included) against transformers' decoder. Excluded: s = 0, 1, whose products are subnormal
    (< 2^-126: XLA:CPU flushes them to 0, torch keeps them), and s = 255, NaN in the OCP MX spec
    (ours: 0 * 2^128 = NaN, torch: ldexp(0, 128) = 0). Real checkpoints have s ~ 115-125."""
    rng = np.random.default_rng(16)
    rows, groups = 2 * 253, 16                          # each row: all 256 bytes in a random order
    packed = np.stack([rng.permutation(256).astype(np.uint8) for _ in range(rows)])[None]
    scales = (2 + (np.arange(rows)[:, None] + 37 * np.arange(groups)) % 253).astype(np.uint8)[None]
    assert set(np.unique(scales)) == set(range(2, 255))
    ours = mxfp4_dequantize(jnp.asarray(packed), jnp.asarray(scales), dtype)
    assert ours.dtype == dtype and ours.shape == (1, rows, 512)
    theirs = transformers_decode(packed, scales, dtype)
    same = _same_bits(ours, theirs)
    assert same.all(), f"{(~same).sum()} values differ, first at {np.argwhere(~same)[0]}"
    assert np.isinf(theirs).any() and (np.signbit(theirs) & (theirs == 0)).any()   # the edges are in


def test_mxfp4_decode_hand_built_bytes():
    packed = np.zeros((2, 256), np.uint8)
    packed[0] = np.arange(256)                          # every byte: all nibble pairs, both orders
    packed[1, :4] = [0x21, 0x8F, 0x7A, 0x80]
    scales = np.zeros((2, 16), np.uint8)
    # extremes that stay finite and normal in f32/bf16: 0.5 * 2**-123 and 6 * 2**125
    scales[0] = [4, 252, 127, 128, 126, 100, 150, 120, 130, 127, 127, 60, 200, 127, 5, 251]
    scales[1] = 127
    scales[1, 0] = 130                                  # first group x8
    w = np.asarray(mxfp4_dequantize(jnp.asarray(packed), jnp.asarray(scales), jnp.float32))
    assert _same_bits(w, transformers_decode(packed, scales, jnp.float32)).all()
    # low nibble = even column: 0x21 -> (0.5, 1.0); 0x8F -> (-6, -0); 0x7A -> (-1, 6); x 2**3
    assert w[1, :6].tolist() == [4.0, 8.0, -48.0, 0.0, -8.0, 48.0]
    assert np.signbit(w[1, 3]) and not np.signbit(w[1, 6])       # code 8 is -0, code 0 is +0
    assert np.signbit(w[1, 7]) and w[1, 7] == 0                  # 0x80: high nibble 8 -> -0
    assert w[0, 0x77 * 2] == 6.0 * 2.0 ** (int(scales[0, (0x77 * 2) // 32]) - 127)
    assert w[0, 64] == 0 and w[0, 65] == 1.0 * 2.0 ** (127 - 127)     # byte 32 = 0x20, group 2
    # decode is exact in bf16 as well (E2M1 x power of two), and bf16 extremes survive
    wb = np.asarray(mxfp4_dequantize(jnp.asarray(packed), jnp.asarray(scales), jnp.bfloat16))
    np.testing.assert_array_equal(wb.astype(np.float32), w)
    assert np.isfinite(w).all() and np.abs(w).max() == 6.0 * 2.0 ** 125


def test_mxfp4_quantize_round_trip():
    rng = np.random.default_rng(6)
    packed = rng.integers(0, 256, (3, 4, 48), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 4, 3), dtype=np.uint8)
    w = mxfp4_dequantize(jnp.asarray(packed), jnp.asarray(scales), jnp.float32)
    p2, s2 = mxfp4_quantize(w)
    assert p2.shape == packed.shape and s2.shape == scales.shape and p2.dtype == s2.dtype == jnp.uint8
    w2 = np.asarray(mxfp4_dequantize(p2, s2, jnp.float32))
    np.testing.assert_array_equal(w2, np.asarray(w))
    np.testing.assert_array_equal(np.signbit(w2), np.signbit(np.asarray(w)))   # -0 kept
    # arbitrary floats: error within half the widest E2M1 step (1.0) of the group's scale
    x = rng.standard_normal((5, 64)).astype(np.float32) * 3
    xp, xs = mxfp4_quantize(jnp.asarray(x))
    xq = np.asarray(mxfp4_dequantize(xp, xs, jnp.float32))
    step = np.repeat(2.0 ** (np.asarray(xs, np.float64) - 127), 32, -1)
    assert np.all(np.abs(xq - x) <= step)


# max |packed - dequantised| over max |output|: the packed layer multiplies the even and the odd
# input columns separately (layers/mxfp4.py `mxfp4_planes`) and adds the halves, a different
# summation order with the same rounding points; float64 is tests/float64.py's tolerance
PACKED_TOL = {jnp.float64: None, jnp.float32: 1e-6, jnp.bfloat16: 2.0 ** -7}


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_packed_moe_equals_dequantised_moe(dtype):
    if dtype == jnp.float64:
        with x64():
            _packed_moe_check(dtype)
    else:
        _packed_moe_check(dtype)


def _packed_moe_check(dtype):
    cfg_q = k3_cfg(quantization_config=MXFP4)
    cfg_f = k3_cfg()
    assert cfg_q.quantization == "mxfp4"
    moe_q = MoE(cfg_q, dtype=dtype, rngs=nnx.Rngs(0))
    moe_f = MoE(cfg_f, dtype=dtype, rngs=nnx.Rngs(1))
    pq, pf = flat_params(moe_q), flat_params(moe_f)
    e, i, din = cfg_q.num_experts, cfg_q.moe_intermediate_size, cfg_q.moe_expert_in
    assert pq["experts.w1.weight_packed"].get_value().shape == (e, i, din // 2)
    assert pq["experts.w1.weight_scale"].get_value().shape == (e, i, din // 32)
    assert pq["experts.w2.weight_packed"].get_value().shape == (e, din, i // 2)
    assert pq["experts.w2.weight_scale"].get_value().dtype == jnp.uint8
    assert "experts.w1.weight" not in pq
    rng = np.random.default_rng(7)
    for name in ("w1", "w2", "w3"):
        s = pq[f"experts.{name}.weight_scale"]
        # the default init is one constant scale; vary it so group boundaries matter
        s.set_value(jnp.asarray(rng.integers(118, 126, s.get_value().shape), jnp.uint8))
        pf[f"experts.{name}.weight"].set_value(mxfp4_dequantize(
            pq[f"experts.{name}.weight_packed"].get_value(), s.get_value(), dtype))
    randomize(moe_q, seed=8)
    for name, p in pq.items():
        if not name.startswith("experts."):
            pf[name].set_value(p.get_value())
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 10, D)), dtype)
    y_q, y_f = np.asarray(apply(moe_q, x), np.float64), np.asarray(apply(moe_f, x), np.float64)
    assert np.isfinite(y_q).all() and np.abs(y_q).max() > 1e-2
    if PACKED_TOL[dtype] is None:
        assert_close(y_q, y_f, "packed vs dequantised MoE")
    else:
        err = np.abs(y_q - y_f).max() / np.abs(y_f).max()
        assert err <= PACKED_TOL[dtype], err


# ------------------------------------------------------------------------------------------------
# 4. SiTU and the GLU MLP


def test_situ_matches_numpy():
    g = np.concatenate([np.linspace(-60, 60, 241), [-1e4, 1e4, 0.0]]).astype(np.float32)
    u = np.concatenate([np.linspace(-200, 200, 241), [3.0, -3.0, 5.0]]).astype(np.float32)
    got = np.asarray(situ(jnp.asarray(g), jnp.asarray(u)))
    assert got.dtype == np.float32
    # fp32 tanh/sigmoid vs float64: a few ulp of O(100) values
    np.testing.assert_allclose(got, np_situ(g.astype(np.float64), u.astype(np.float64)), rtol=3e-6, atol=1e-6)
    # both branches are soft-clipped: |out| <= 4 * 25 (reached in fp32 at |g|, |u| ~ 1e4)
    assert np.abs(got).max() <= 100.0 and np.isfinite(got).all()
    got_b = np.asarray(situ(jnp.asarray(g), jnp.asarray(u), beta=2.0, linear_beta=10.0))
    np.testing.assert_allclose(got_b, np_situ(g.astype(np.float64), u.astype(np.float64), 2.0, 10.0),
                               rtol=3e-6, atol=1e-6)


def test_glu_mlp_silu_matches_transformers_and_situ_matches_numpy():
    """Float64 on both sides (tests/float64.py)."""
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMLP

    cfg = kimi_cfg()
    hf = KimiLinearMLP(hf_kimi_config(cfg), intermediate_size=48).double()
    with x64():
        mlp = GLUMLP(D, 48, act="silu", dtype=jnp.float64, rngs=nnx.Rngs(0))
        w = randomize(mlp, seed=10)
        with torch.no_grad():
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(hf, n).weight.copy_(torch.tensor(w[f"{n}.weight"], dtype=torch.float64))
        x = np.random.default_rng(11).standard_normal((3, 5, D))
        with torch.no_grad(), TorchFloat64():
            y_hf = hf(torch.tensor(x))
        assert_close(np.asarray(apply(mlp, jnp.asarray(x))), y_hf, "SwiGLU MLP vs transformers")

        mlp_s = GLUMLP(D, 48, act="situ", situ_beta=4.0, situ_linear_beta=25.0, dtype=jnp.float64,
                       rngs=nnx.Rngs(0))
        w = randomize(mlp_s, seed=12, std=1.0)                   # gate values well past +-4: SiTU saturates
        ref = np_situ(x @ w["gate_proj.weight"].T, x @ w["up_proj.weight"].T) @ w["down_proj.weight"].T
        assert_close(np.asarray(apply(mlp_s, jnp.asarray(x))), ref, "SiTU MLP vs numpy")


# ------------------------------------------------------------------------------------------------
# 5. AttnRes


def np_attn_res(prefix, blocks, proj_w, norm_w, eps):
    """docs/architecture.md §1.5.2 in float64 (no overflow at bf16-range values)."""
    v = np.concatenate([blocks, prefix[..., None, :]], -2).astype(np.float64)
    k = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
    s = np.sum(k * (norm_w.astype(np.float64) * proj_w[0].astype(np.float64)), -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.sum(p[..., None] * v, -2)


def attn_res_inputs(nb: int, seed: int, h: int = 64):
    rng = np.random.default_rng(seed)
    prefix = rng.standard_normal((2, 5, h)) * 3
    blocks = rng.standard_normal((2, 5, nb, h)) * rng.uniform(0.1, 20, (2, 5, nb, 1))
    proj = rng.standard_normal((1, h)) * 0.5
    norm = 1 + 0.3 * rng.standard_normal(h)
    return prefix, blocks, proj, norm


@pytest.mark.parametrize("nb", [1, 2, 5, 9])
def test_attn_res_matches_numpy(nb):
    prefix, blocks, proj, norm = attn_res_inputs(nb, seed=nb)
    with x64():                                  # float64 both sides (tests/float64.py)
        out = jit_attn_res(*(jnp.asarray(a, jnp.float64) for a in (prefix, blocks, proj, norm)), 1e-5)
        assert out.shape == prefix.shape
        assert_close(np.asarray(out), np_attn_res(prefix, blocks, proj, norm, 1e-5), "AttnRes mix")

    # bf16 in (the real model): fp32 inside, bf16 out -> one bf16 rounding of the fp32 result
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    out_b = jit_attn_res(bf(prefix), bf(blocks), bf(proj), bf(norm), 1e-5)
    assert out_b.dtype == jnp.bfloat16
    ref_b = np_attn_res(*(np.asarray(bf(a), np.float64) for a in (prefix, blocks, proj, norm)), 1e-5)
    np.testing.assert_allclose(np.asarray(out_b, np.float64), ref_b, rtol=2 ** -8, atol=1e-6)


def test_attn_res_without_blocks_returns_prefix():
    prefix, _, proj, norm = attn_res_inputs(1, seed=0)
    p = jnp.asarray(prefix, jnp.bfloat16)
    out = attn_res(p, jnp.zeros((2, 5, 0, 64), jnp.bfloat16), jnp.asarray(proj), jnp.asarray(norm))
    assert out is p


def test_attn_res_prescaled_rms_does_not_overflow():
    """Block sums near the bf16 maximum: a naive fp32 sum of squares overflows to inf."""
    h = 64
    rng = np.random.default_rng(13)
    big = (rng.uniform(0.5, 1.0, (2, 3, h)) * rng.choice([-1, 1], (2, 3, h)) * 3.0e38)
    prefix = np.asarray(jnp.asarray(big, jnp.bfloat16), np.float64)          # bf16-representable
    blocks = np.stack([rng.standard_normal((2, 3, h)) * 1e3,
                       np.asarray(jnp.asarray(big[::-1] * 0.9, jnp.bfloat16), np.float64),
                       np.zeros((2, 3, h)),                                    # an all-zero candidate
                       rng.standard_normal((2, 3, h)) * 1e-30], axis=-2)      # eps dominates
    proj = rng.standard_normal((1, h)) * 0.3
    norm = 1 + 0.2 * rng.standard_normal(h)
    f32 = lambda a: jnp.asarray(a, jnp.float32)

    v = f32(prefix)
    mean_sq = jnp.mean(v * v, -1, keepdims=True)
    assert np.isinf(np.asarray(mean_sq)).all()                      # the case is real: v*v overflows,
    assert not np.asarray(v * jax.lax.rsqrt(mean_sq + 1e-5)).any()  # and the naive RMSNorm reads 0

    ref = np_attn_res(prefix, blocks, proj, norm, 1e-5)
    out = np.asarray(jit_attn_res(f32(prefix), f32(blocks), f32(proj), f32(norm), 1e-5), np.float64)
    assert np.isfinite(out).all()
    # a convex mix of values up to 3e38: fp32 relative error on the largest terms
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    out_b = jit_attn_res(jnp.asarray(prefix, jnp.bfloat16), jnp.asarray(blocks, jnp.bfloat16),
                     f32(proj), f32(norm), 1e-5)
    assert out_b.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out_b, np.float32)).all()


# ------------------------------------------------------------------------------------------------
# 6. Expert parallelism on 8 fake devices


def _ep_check():
    """EP over "tensor" (8, and 4 with a data axis of 2) == the single-device dense path."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dspark_jax import sharding

    assert jax.device_count() >= 8
    # float experts on tensor=8; MXFP4 experts on tensor=4 x data=2 (tokens split over "data")
    for quantized, tensor, data in ((False, 8, 1), (True, 4, 2)):
        over = dict(num_experts=16, num_experts_per_token=4)
        if quantized:
            over["quantization_config"] = MXFP4
        cfg = k3_cfg(**over)
        ref_moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        randomize(ref_moe, seed=15)
        x = jnp.asarray(np.random.default_rng(14).standard_normal((4, 6, D)), jnp.float32)
        graphdef, ref_state = nnx.split(ref_moe)
        fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
        y_ref = np.asarray(fwd(ref_state, x))

        mesh = sharding.make_mesh(tensor=tensor, data=data)
        moe = sharding.shard_module(nnx.merge(graphdef, ref_state), mesh)
        params = flat_params(moe)
        for name in ("experts.w1", "experts.w2"):
            name += ".weight_packed" if quantized else ".weight"
            assert params[name].get_value().sharding.spec[0] == "tensor", name
        state = nnx.state(moe)
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        assert "shard_map" in str(jax.make_jaxpr(fwd)(state, xs))     # the EP path, not the dense one
        # fp32 both; the summation order (per-device partials + psum) differs, outputs are O(10)
        np.testing.assert_allclose(np.asarray(fwd(state, xs)), y_ref, rtol=1e-5, atol=1e-5)
        with jax.set_mesh(mesh):                                      # context mesh, replicated x
            np.testing.assert_allclose(np.asarray(fwd(state, x)), y_ref, rtol=1e-5, atol=1e-5)


def test_expert_parallel_matches_single_device():
    on_eight_devices(_ep_check, "test_moe_attnres")
