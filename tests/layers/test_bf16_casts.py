"""The rounding points that exist only in a bf16 model (docs/architecture.md §1.5.3-§1.5.6), each against a torch
computation of the published formula (docs/architecture.md) written here (not our code):

- KDA: q, k, v = silu(causal_conv(raw, conv_w)) computed in fp32, rounded to bf16 once;
- SiTU: the fp32 product of both soft-clipped branches, rounded to bf16 once;
- MLA output gate: o * sigmoid(x @ Wg.T) in bf16 (the gate rounded to bf16, then the product);
- routed experts: the fp32 sum of the weighted bf16 expert outputs, rounded to bf16 before
  `routed_expert_norm`;
- the Llama MLP (the demo target in bf16): silu in fp32 rounded once, then the bf16 product.

Method (independent of the CPU): torch evaluates the formula in float64 (`exact`) and bounds how
far any fp32 implementation can be from it (`err`, derived per check from fp32 rounding and
<= 8 ulp per fp32 transcendental; XLA's tanh/sigmoid/silu measured <= 4.3 ulp, torch's <= 2.3). Any
such fp32 value rounds (round-to-nearest is monotonic) into [bf16(exact - err), bf16(exact + err)],
so our bf16 tensor must lie in that bracket elementwise. The bracket is one bf16 value except where
exact is within err of a rounding boundary (a few per mille of the elements, asserted), so
rounding at another place (before the activation, twice instead of once, or not at all) fails.
torch's own fp32->bf16 evaluation of the formula must land in the same bracket (a check of the
bound). Inputs at each point are taken from our layer's run (recorded by wrapping the function
that consumes them), so only the point under test is compared. The layers run op by op here so
the wrappers see concrete values; jitted, XLA:CPU keeps the same bf16 conversions (it does not
fold a convert(convert(x, bf16), f32) pair; GPU compilers may, under xla_allow_excess_precision).

Found by these checks and fixed in dspark_jax/layers/mla.py: `jax.nn.sigmoid` on a bf16 tensor is
expanded by XLA as 1 / (1 + exp(-x)) with a bf16 rounding after every step (up to 2 bf16 ulps off
on ~35% of inputs), where torch evaluates a bf16 sigmoid in fp32 and rounds once. The same held
for `jax.nn.silu` in dspark_jax/models/llama.py (fixed: it now uses `layers.mlp.glu`).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from flax import nnx

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.kernels import dispatch
from dspark_jax.layers import kda as kda_lib
from dspark_jax.layers import mlp as mlp_lib
from dspark_jax.layers import moe as moe_lib
from dspark_jax.layers import norms as norms_lib
from dspark_jax.layers.kda import KimiDeltaAttention
from dspark_jax.layers.mla import MLAttention
from dspark_jax.layers.mlp import GLUMLP, glu
from dspark_jax.layers.moe import MoE
from dspark_jax.params import flat_params

BF16 = jnp.bfloat16
# relative size of one fp32 ulp, at most
U32 = 2.0 ** -23
# an fp32 transcendental (tanh, sigmoid, silu, exp) is within 8 ulp of the exact value
TRANS = 8 * U32


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float64 values to bf16 with torch (nearest-even) and return them as float64."""
    return torch.from_numpy(np.asarray(a, np.float64)).to(torch.bfloat16).double().numpy()


def bracket(exact: np.ndarray, err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return to_bf16(exact - err), to_bf16(exact + err)


def assert_in_bracket(got, lo, hi, what: str, *, bf16: bool = True, decisive: float = 0.99) -> None:
    if bf16:
        assert got.dtype == BF16 if not isinstance(got, torch.Tensor) else got.dtype == torch.bfloat16, \
            f"{what}: {got.dtype}, not bf16 (no rounding at this point)"
    g = got.double().numpy() if isinstance(got, torch.Tensor) else f64(got)
    bad = ~((lo <= g) & (g <= hi))
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} values outside their bf16 bracket, e.g. "
                           f"{g[bad][:3]} not in [{lo[bad][:3]}, {hi[bad][:3]}]")
    # the check is exact on almost every element (else it could not see a misplaced rounding)
    assert np.mean(lo == hi) >= decisive, f"{what}: bracket undecided on {np.mean(lo != hi):.2%}"


class Recorder:
    """Wraps `module.name` (a function looked up at call time) to keep its arguments and result."""

    def __init__(self, monkeypatch, module, name: str):
        self.calls = []
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            self.calls.append((args, kwargs, out))
            return out

        monkeypatch.setattr(module, name, wrapper)


def _bf16_normal(rng, shape, std=1.0):
    return jnp.asarray(rng.standard_normal(shape) * std, BF16)


def _randomize_bf16(module, rng, std_of=lambda name, shape: 1.0 / np.sqrt(shape[-1])):
    """Float params ~ N(0, std) rounded to their own dtype; norm weights 1 +- 0.3."""
    for name, p in flat_params(module).items():
        v = p.get_value()
        if not jnp.issubdtype(v.dtype, jnp.floating):
            continue
        if name.endswith("norm.weight"):
            new = 1.0 + 0.3 * rng.standard_normal(v.shape)
        else:
            new = rng.standard_normal(v.shape) * std_of(name, v.shape)
        p.set_value(jnp.asarray(new, v.dtype))


# ------------------------------------------------------------------------------------------------
# KDA: silu(conv) rounded once to bf16


def test_kda_conv_silu_rounds_to_bf16(monkeypatch):
    cfg = KimiConfig.from_dict(dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rms_norm_eps=1e-5,
        linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=[1], full_attn_layers=[])))
    layer = KimiDeltaAttention(cfg, dtype=BF16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    _randomize_bf16(layer, rng, std_of=lambda name, shape: (0.6 if "conv1d" in name else 1.0) / np.sqrt(shape[-1]))
    conv = Recorder(monkeypatch, kda_lib, "causal_conv")            # (window of raw q|k|v, weight)
    l2 = Recorder(monkeypatch, kda_lib, "l2_normalize")             # q, k after conv + silu + cast
    prefill = Recorder(monkeypatch, dispatch, "kda_prefill")        # v after conv + silu + cast
    x = _bf16_normal(rng, (2, 40, 32))
    out, _ = layer(x)
    assert out.dtype == BF16 and len(conv.calls) == 3 and len(l2.calls) == 2 and len(prefill.calls) == 1
    b, t, p = 2, 40, 32
    after = {"q": l2.calls[0][0][0], "k": l2.calls[1][0][0], "v": prefill.calls[0][0][2]}
    for (args, _, _), name in zip(conv.calls, "qkv"):
        window, weight = args                                       # [B, K-1+T, P] bf16, [P, K] fp32
        assert window.dtype == BF16 and weight.dtype == jnp.float32
        u, w = torch.from_numpy(f64(window)), torch.from_numpy(f64(weight))
        k = w.shape[1]
        terms = torch.stack([w[:, j] * u[:, j:j + t, :] for j in range(k)])
        z = terms.sum(0)
        exact = F.silu(z).numpy()
        # fp32 sum of K products: <= K * 2^-24 * sum|w u| (Higham); silu' in [-0.1, 1.1]; silu itself
        err = 1.1 * k * U32 / 2 * terms.abs().sum(0).numpy() + TRANS * np.abs(exact) + 1e-30
        lo, hi = bracket(exact, err)
        assert_in_bracket(after[name].reshape(b, t, p), lo, hi, f"KDA {name} = silu(conv)")
        # torch in the published precision: conv in fp32 (F32 conv weight), silu, one cast to bf16
        spec = F.silu(F.conv1d(u.float().transpose(1, 2), w.float()[:, None, :], groups=p)).transpose(1, 2)
        assert_in_bracket(spec.to(torch.bfloat16), lo, hi, f"torch reference {name}")


# ------------------------------------------------------------------------------------------------
# SiTU: fp32 inside, rounded once


def _situ_exact(g: np.ndarray, u: np.ndarray, beta: float, lbeta: float):
    """float64 value and the fp32 error bound: 3 transcendentals (<= 8 ulp each), 2 divisions and
    4 products (<= 1/2 ulp each): < 2^-18 relative."""
    g, u = torch.from_numpy(g), torch.from_numpy(u)
    exact = (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lbeta * torch.tanh(u / lbeta))).numpy()
    return exact, 2.0 ** -18 * np.abs(exact) + 1e-30


def _situ_spec_bf16(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    """docs/architecture.md §1.5.5 in torch: fp32 inside, cast back to the input dtype."""
    gf, uf = g.float(), u.float()
    return (beta * torch.tanh(gf / beta) * torch.sigmoid(gf) * (lbeta * torch.tanh(uf / lbeta))).to(g.dtype)


def test_situ_rounds_to_bf16_once(monkeypatch):
    rng = np.random.default_rng(1)
    # both branches from linear to saturated (|gate| >> 4, |up| >> 25), and exact zeros
    g = np.concatenate([rng.uniform(-40, 40, 6000), rng.standard_normal(2000), [0.0, -0.0, 1e-3]])
    u = np.concatenate([rng.uniform(-200, 200, 6000), rng.standard_normal(2000) * 5, [3.0, 0.0, -7.0]])
    g16, u16 = jnp.asarray(g, BF16), jnp.asarray(u, BF16)
    for beta, lbeta in ((4.0, 25.0), (2.0, 10.0)):
        lo, hi = bracket(*_situ_exact(f64(g16), f64(u16), beta, lbeta))
        got = glu(g16, u16, "situ", beta, lbeta)
        assert_in_bracket(got, lo, hi, f"glu situ({beta}, {lbeta})")
        jitted = jax.jit(glu, static_argnums=(2, 3, 4))(g16, u16, "situ", beta, lbeta)
        np.testing.assert_array_equal(np.asarray(jitted, np.float32), np.asarray(got, np.float32))
        spec = _situ_spec_bf16(torch.from_numpy(f64(g16)).bfloat16(), torch.from_numpy(f64(u16)).bfloat16(),
                               beta, lbeta)
        assert_in_bracket(spec, lo, hi, "torch reference SiTU")

    # inside the bf16 GLU MLP (dense layer 0, shared experts): what down_proj receives
    mlp = GLUMLP(32, 64, act="situ", situ_beta=4.0, situ_linear_beta=25.0, dtype=BF16, rngs=nnx.Rngs(2))
    _randomize_bf16(mlp, rng, std_of=lambda name, shape: 3.0 / np.sqrt(shape[-1]))
    calls = Recorder(monkeypatch, mlp_lib, "glu")                   # (gate_proj(x), up_proj(x)) -> h
    x = _bf16_normal(rng, (3, 7, 32), std=2.0)
    mlp(x)
    (gate, up, *_), _, h = calls.calls[0]
    assert float(jnp.max(jnp.abs(gate))) > 8.0                      # SiTU saturates on part of the inputs
    lo, hi = bracket(*_situ_exact(f64(gate), f64(up), 4.0, 25.0))
    assert_in_bracket(h, lo, hi, "GLUMLP situ -> down_proj")


# ------------------------------------------------------------------------------------------------
# MLA output gate: sigmoid in bf16, product in bf16


def test_mla_output_gate_rounds_like_the_bf16_reference():
    """`output(x, o)` = o_proj(o * sigmoid(g_proj(x))) with o_proj = identity (exact in bf16), so
    the layer output is the gated value itself. Three roundings chain: g_proj's bf16 output (fp32
    sum of 32 products: <= 33 * 2^-24 * sum|x w|), the sigmoid (<= 8 ulp, then bf16) and the
    bf16 x bf16 product (exact in float64, then bf16): brackets are carried through each (sigmoid
    increases; the product is monotonic in the gate with the sign of o)."""
    cfg = KimiConfig.from_dict(dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, mla_use_output_gate=True,
        linear_attn_config=dict(num_heads=2, head_dim=8, kda_layers=[1], full_attn_layers=[2])))
    mla = MLAttention.for_target(cfg, dtype=BF16, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    wg = rng.standard_normal((32, 32)) * 2.0 / np.sqrt(32)          # gates spread over (0, 1)
    mla.g_proj.weight.set_value(jnp.asarray(wg, BF16))
    mla.o_proj.weight.set_value(jnp.eye(32, dtype=BF16))
    x = _bf16_normal(rng, (2, 5, 32))
    o = _bf16_normal(rng, (2, 5, 4, 8), std=3.0)
    got = mla.output(x, o)
    # compiled as one program the gate rounds the same way (XLA keeps the bf16 conversions)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x, o: m.output(x, o))(mla, x, o), np.float32),
                                  np.asarray(got, np.float32))

    xw = f64(x)[..., None, :] * f64(mla.g_proj.weight.get_value())             # [2,5,32 out,32 in]
    g_lo, g_hi = bracket(xw.sum(-1), 33 * U32 / 2 * np.abs(xw).sum(-1) + 1e-30)
    sig = lambda a: torch.sigmoid(torch.from_numpy(a)).numpy()
    s_lo = to_bf16(sig(g_lo) * (1 - TRANS))
    s_hi = to_bf16(sig(g_hi) * (1 + TRANS))
    o64 = f64(o).reshape(2, 5, 32)
    lo = to_bf16(np.minimum(o64 * s_lo, o64 * s_hi))
    hi = to_bf16(np.maximum(o64 * s_lo, o64 * s_hi))
    assert_in_bracket(got, lo, hi, "MLA gated output")
    # the published bf16 computation in torch (the sigmoid and the product in bf16)
    xt, ot = torch.from_numpy(f64(x)).bfloat16(), torch.from_numpy(o64).bfloat16()
    spec = ot * torch.sigmoid(xt @ torch.from_numpy(f64(mla.g_proj.weight.get_value())).bfloat16().T)
    assert_in_bracket(spec, lo, hi, "torch reference gate")


# ------------------------------------------------------------------------------------------------
# routed experts: fp32 sum of bf16 expert outputs, rounded to bf16 before routed_expert_norm


def _selection(rng, e: int, rows: int, cols: int) -> np.ndarray:
    """[e, rows, cols] with one entry +-2^{-1,0,1} per row: a bf16 matmul against it is exact on
    every backend (one nonzero product, then zeros), so the experts' matmuls cannot differ between
    implementations and only the SiTU rounding and the sum are compared."""
    w = np.zeros((e, rows, cols))
    idx = rng.integers(0, cols, (e, rows))
    val = rng.choice([-1.0, 1.0], (e, rows)) * 2.0 ** rng.integers(-1, 2, (e, rows))
    np.put_along_axis(w, idx[..., None], val[..., None], axis=-1)
    return w


def test_routed_expert_sum_rounds_to_bf16_before_norm(monkeypatch):
    d, n_exp, top_k, inter = 32, 8, 3, 32
    cfg = KimiConfig.from_dict(dict(
        vocab_size=64, hidden_size=d, num_hidden_layers=2, intermediate_size=48, num_attention_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=n_exp,
        num_experts_per_token=top_k, num_shared_experts=0, moe_intermediate_size=inter, moe_renormalize=True,
        routed_scaling_factor=1.0, num_expert_group=1, topk_group=1, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, routed_expert_hidden_size=d,
        latent_moe_use_norm=True, rms_norm_eps=1e-5,
        linear_attn_config=dict(num_heads=2, head_dim=8, kda_layers=[1], full_attn_layers=[2])))
    moe = MoE(cfg, dtype=BF16, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(4)
    _randomize_bf16(moe, rng, std_of=lambda name, shape: (3.0 if "down_proj" in name else 1.0) / np.sqrt(shape[-1]))
    moe.gate.e_score_correction_bias.set_value(jnp.asarray(rng.uniform(-0.2, 0.2, n_exp), jnp.float32))
    w1, w3, w2 = (_selection(rng, n_exp, inter, d), _selection(rng, n_exp, inter, d), _selection(rng, n_exp, d, inter))
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        getattr(moe.experts, name).weight.set_value(jnp.asarray(w, BF16))
    mix = Recorder(monkeypatch, moe_lib, "expert_mixture")          # z, expert ids, weights -> fp32 sum
    norm = Recorder(monkeypatch, norms_lib, "rms_norm")             # what routed_expert_norm receives
    x = _bf16_normal(rng, (2, 12, d))
    moe(x)
    z, routed_idx = mix.calls[0][0][:2]
    y32 = mix.calls[0][2]
    norm_in = norm.calls[0][0][0]

    # (1) the cast itself: the norm reads bf16(our fp32 sum), rounded by torch
    assert y32.dtype == jnp.float32 and norm_in.dtype == BF16
    want = torch.from_numpy(np.array(y32)).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(norm_in).view(np.int16), want)

    # (2) the fp32 sum is the sum of the weighted bf16 expert outputs: routing from docs/architecture.md §1.5.5 in
    # float64 (sigmoid scores, biased top-k, renormalised), experts exact but for SiTU's bracket
    x64 = f64(x).reshape(-1, d)
    scores = 1 / (1 + np.exp(-(x64 @ f64(moe.gate.weight.get_value()).T)))
    choice = scores + f64(moe.gate.e_score_correction_bias.get_value())
    order = np.argsort(-choice, -1)
    gaps = np.take_along_axis(choice, order[:, top_k - 1:top_k], -1) - np.take_along_axis(choice, order[:, top_k:top_k + 1], -1)
    assert gaps.min() > 1e-4                                         # no near-tie in the selection
    idx = order[:, :top_k]
    wts = np.take_along_axis(scores, idx, -1)
    wts = wts / wts.sum(-1, keepdims=True)
    assert np.array_equal(np.sort(idx, -1), np.sort(np.asarray(routed_idx), -1))
    z64 = f64(z)
    y_lo = np.zeros_like(z64)
    y_hi = np.zeros_like(z64)
    scale = np.zeros_like(z64)
    for n in range(z64.shape[0]):
        for e, we in zip(idx[n], wts[n]):
            h_lo, h_hi = bracket(*_situ_exact(w1[e] @ z64[n], w3[e] @ z64[n], 4.0, 25.0))
            a, b = we * (w2[e] @ h_lo), we * (w2[e] @ h_hi)             # w2: one +-2^k per row
            y_lo[n] += np.minimum(a, b)
            y_hi[n] += np.maximum(a, b)
            scale[n] += np.maximum(np.abs(a), np.abs(b))
    # our fp32 combine weights (sigmoid of fp32 logits of width 32, renormalised) are within 2^-17
    # relative of the float64 ones; summing 3 terms in fp32 adds <= 3 * 2^-24: 2^-16 covers both
    err = 2.0 ** -16 * scale + 1e-30
    y = f64(y32)
    bad = (y < y_lo - err) | (y > y_hi + err)
    assert not bad.any(), f"{bad.sum()} expert sums outside their fp32 bound"
    assert np.median((y_hi - y_lo + 2 * err) / np.maximum(np.abs(y), 1e-30)) < 2.0 ** -12   # a tight check
    # and the norm's bf16 input lies in the bracket of the exact sum
    assert_in_bracket(norm_in, to_bf16(y_lo - err), to_bf16(y_hi + err), "routed_expert_norm input",
                      decisive=0.95)


# ------------------------------------------------------------------------------------------------
# Llama MLP (the bf16 demo target): silu(gate) in fp32 rounded to bf16, then the bf16 product


def test_llama_mlp_silu_rounds_like_the_bf16_reference():
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with down_proj = identity (exact in bf16):
    the output is the gated product itself. HF's bf16 LlamaMLP rounds the projections (fp32 sums),
    silu (fp32 inside, one rounding: torch's opmath) and the product; the brackets carry each one
    through (silu is not monotonic below -1.28, so its bracket is the min/max over the gate's
    bracket ends and, where that bracket holds the minimum, the minimum itself)."""
    from dspark_jax.config.llama import LlamaConfig
    from dspark_jax.models.llama import LlamaMLP
    cfg = LlamaConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    mlp = LlamaMLP(cfg, dtype=BF16, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(5)
    # dyadic inputs and weights (k/4, k/16): every projection sum is exact in fp32, so the checks
    # below decide on almost every element and only the silu and product roundings are tested
    for p in (mlp.gate_proj, mlp.up_proj):
        p.weight.set_value(jnp.asarray(rng.integers(-8, 9, (32, 32)) / 16.0, BF16))
    mlp.down_proj.weight.set_value(jnp.eye(32, dtype=BF16))
    x = jnp.asarray(rng.integers(-4, 5, (3, 7, 32)) / 4.0, BF16)
    got = nnx.jit(lambda m, x: m(x))(mlp, x)

    def proj(w):   # the fp32 sum is exact (dyadic terms, |sum| < 2^17), then one bf16 rounding
        xw = f64(x)[..., None, :] * f64(w.get_value())
        return bracket(xw.sum(-1), 0.0)
    g_lo, g_hi = proj(mlp.gate_proj.weight)
    u_lo, u_hi = proj(mlp.up_proj.weight)
    silu = lambda a: a / (1.0 + np.exp(-a))
    x_min = -1.2784645427610737                                        # argmin of silu
    ends = np.stack([silu(g_lo), silu(g_hi)])
    s_min = np.where((g_lo <= x_min) & (x_min <= g_hi), silu(x_min), ends.min(0))
    s_lo = to_bf16(np.minimum(s_min, ends.min(0)) - TRANS * np.abs(ends).max(0))
    s_hi = to_bf16(ends.max(0) + TRANS * np.abs(ends).max(0))
    prods = np.stack([s_lo * u_lo, s_lo * u_hi, s_hi * u_lo, s_hi * u_hi])
    lo, hi = to_bf16(prods.min(0)), to_bf16(prods.max(0))
    assert_in_bracket(got, lo, hi, "Llama MLP gated product")
    # HF's bf16 computation in torch
    xt = torch.from_numpy(f64(x)).bfloat16()
    wt = lambda p: torch.from_numpy(f64(p.weight.get_value())).bfloat16()
    spec = F.silu(xt @ wt(mlp.gate_proj).T) * (xt @ wt(mlp.up_proj).T)
    assert_in_bracket(spec, lo, hi, "torch reference MLP")
