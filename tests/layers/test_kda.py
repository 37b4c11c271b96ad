"""KDA layer (docs/architecture.md §1.5.3): parity with transformers' Kimi-Linear and, for the K3 bounded "safe"
forget gate, with transformers' Glm5Next KDA layer (the same gate; float64 on both sides),
chunked == recurrent, state continuation, per-token snapshots, the K3 layer against a numpy
transcription of docs/architecture.md §1.5.3, right-padded batches and head sharding."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.kda import KDAState, KimiDeltaAttention, kda_gate
from dspark_jax.params import flat_params
from tests.float64 import TorchFloat64, assert_close, x64

D = 32


def tiny_cfg(k3: bool, heads: int = 2, head_dim: int = 16, *, bounded: bool | None = None) -> KimiConfig:
    """`k3`: the K3 bounded gate (lower bound -5) and full-rank output gate; `bounded` overrides
    the gate alone (the bounded gate with Kimi-Linear's low-rank output gate is GLM-5-Next's KDA)."""
    bounded = k3 if bounded is None else bounded
    return KimiConfig.from_dict(dict(
        vocab_size=64, hidden_size=D, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        rms_norm_eps=1e-5,
        linear_attn_config=dict(num_heads=heads, head_dim=head_dim, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0 if bounded else None, use_full_rank_gate=k3,
                                kda_layers=[1], full_attn_layers=[])))


def make_layer(k3: bool, seed: int = 0, dtype=jnp.float32, **kw) -> KimiDeltaAttention:
    """A layer with O(1) activations: projections ~ N(0, 1/fan_in) instead of the 0.02 init (so the
    q/k/v/gate paths all matter numerically) and a non-trivial o_norm weight."""
    layer = KimiDeltaAttention(tiny_cfg(k3, **kw), dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 100)
    for name, p in flat_params(layer).items():
        key, sub = jax.random.split(key)
        v = p.get_value()
        if name.endswith("proj.weight"):
            p.set_value(jax.random.normal(sub, v.shape) * v.shape[1] ** -0.5)
        elif name == "o_norm.weight":
            p.set_value(1.0 + 0.3 * jax.random.normal(sub, v.shape))
    return layer


@functools.lru_cache(maxsize=None)
def _jitted(graphdef, mode, chunk_size, snaps):
    def apply(params, x, state, valid):
        layer = nnx.merge(graphdef, params)
        return layer(x, state, mode=mode, valid_BT=valid, return_snapshots=snaps, chunk_size=chunk_size)
    return jax.jit(apply)


def run(layer, x, state=None, *, mode="chunked", chunk_size=16, valid=None, snaps=False):
    graphdef, params = nnx.split(layer)
    if state is None:
        state = layer.init_state(x.shape[0])
    return _jitted(graphdef, mode, chunk_size, snaps)(params, x, state, valid)


def inputs(b, t, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32).astype(dtype)


def random_state(layer, b, seed=2):
    """A non-zero starting state (as after some earlier prompt)."""
    s = layer.init_state(b)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return KDAState(conv=jax.random.normal(k1, s.conv.shape), ssm=0.3 * jax.random.normal(k2, s.ssm.shape))


def close(a, b, tol, what):
    a, b = np.asarray(a), np.asarray(b)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
    assert err < tol, f"{what}: max|diff|/max|ref| = {err:.2e} >= {tol:.0e}"
    return err


# fp32 throughout; the chunked form reassociates sums within a chunk and inverts a unit lower
# triangular matrix. Observed chunked-vs-recurrent differences <= 1e-6 relative (with K3's strong
# decays too, as the decay exponents are summed directly, never as differences of cumsums).
TOL_FORMS = 5e-6
# Conv windows are copies of the raw q|k|v projections; only the matmul's rounding differs between
# differently shaped calls (XLA picks other dot kernels).
TOL_CONV = 1e-6


def _load_into_transformers(layer: KimiDeltaAttention, ref, a_log: str) -> None:
    """Our weights into a transformers KDA layer: q|k|v convs stacked into one `conv1d`, the gate
    projections under `forget_gate.`; `a_log="hf"` keeps A_log as stored, `"unpadded"` passes
    only the H real entries of K3's zero-padded vector (GLM-5-Next stores A_log as [H])."""
    import torch

    ours = {k: np.asarray(v.get_value()) for k, v in flat_params(layer).items()}
    theirs = dict(ours)
    theirs["conv1d.weight"] = np.concatenate([theirs.pop(f"{c}_conv1d.weight") for c in "qkv"])
    if a_log == "unpadded":
        theirs["A_log"] = theirs["A_log"][:layer.num_heads]
    for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        theirs[f"forget_gate.{n}"] = theirs.pop(n)
    missing, unexpected = ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in theirs.items()})
    assert not missing and not unexpected


def test_matches_transformers_kimi_linear():
    """Float64 on both sides (tests/float64.py): transformers' chunk recurrence casts to float32
    internally, TorchFloat64 makes those casts float64. Measured <= 1e-14 relative."""
    import torch
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    hf_cfg = KimiLinearConfig(hidden_size=D, num_hidden_layers=1, layer_types=["linear_attention"],
                              linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
                              rms_norm_eps=1e-5, hidden_act="silu")
    ref = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).double().eval()
    with x64():
        layer = make_layer(k3=False, dtype=jnp.float64)
        _load_into_transformers(layer, ref, a_log="hf")
        x = inputs(2, 150, dtype=jnp.float64)   # > 2 chunks of the default 64, T not a multiple of it
        with torch.no_grad(), TorchFloat64():
            want = ref(torch.from_numpy(np.array(x)))
        assert_close(run(layer, x, chunk_size=64)[0], want, "chunked(64) vs transformers")
        assert_close(run(layer, x, mode="recurrent")[0], want, "recurrent vs transformers")


def _glm5_next_layer():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    hf_cfg = Glm5NextTextConfig(hidden_size=D, num_hidden_layers=1, layer_types=["linear_attention"],
                                linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
                                linear_lower_bound=-5.0, rms_norm_eps=1e-5, hidden_act="silu")
    return Glm5NextTextLinearAttention(hf_cfg, layer_idx=0).double().eval()


def test_bounded_gate_matches_transformers_glm5_next():
    """The K3 "safe" forget gate g = lb * sigmoid(exp(A_log) * (f + dt_bias)) (lb = -5) against an
    independent implementation of it: transformers' Glm5NextTextForgetGate, alone and inside
    Glm5Next's whole KDA layer (which is ours with the bounded gate and the low-rank output gate;
    GLM-5-Next stores A_log unpadded, [H]). Float64 on both sides; measured <= 1e-14 relative."""
    import torch

    ref = _glm5_next_layer()
    with x64():
        layer = make_layer(k3=False, bounded=True, dtype=jnp.float64)
        assert layer.lower_bound == -5.0 and not layer.full_rank_gate
        assert layer.A_log.get_value().shape == (128,)           # K3 layout: zero-padded to 128
        _load_into_transformers(layer, ref, a_log="unpadded")
        x = inputs(2, 150, dtype=jnp.float64)
        xt = torch.from_numpy(np.array(x))
        with torch.no_grad(), TorchFloat64():
            g_ref = ref.forget_gate(xt)
            want = ref(xt)
        graw = layer.f_b_proj(layer.f_a_proj(x)).reshape(2, 150, 2, 16)
        g = kda_gate(graw, layer.A_log.get_value()[:2], layer.dt_bias.get_value().reshape(2, 16), -5.0)
        assert_close(g, g_ref, "bounded forget gate vs Glm5NextTextForgetGate")
        # the bound matters: some channels decay almost as fast as allowed, others barely
        assert float(jnp.min(g)) < -4.0 and float(jnp.max(g)) > -0.1
        assert_close(run(layer, x, chunk_size=64)[0], want, "chunked(64) vs Glm5Next KDA layer")
        assert_close(run(layer, x, mode="recurrent")[0], want, "recurrent vs Glm5Next KDA layer")


def test_chunked_equals_token_by_token_and_continuation():
    # Kimi-Linear gate here; the K3 gate's chunked == recurrent is covered by the snapshot test.
    layer = make_layer(k3=False)
    x = inputs(2, 40)                                # 40 = 2.5 chunks of 16
    s0 = random_state(layer, 2)
    out, state = run(layer, x, s0)

    step_out, s = [], s0
    for t in range(x.shape[1]):
        o, s = run(layer, x[:, t:t + 1], s, mode="recurrent")
        step_out.append(o)
    close(out, jnp.concatenate(step_out, 1), TOL_FORMS, "chunked prefill vs single-token steps")
    close(state.ssm, s.ssm, TOL_FORMS, "ssm state")
    close(state.conv, s.conv, TOL_CONV, "conv window")

    out_a, s_a = run(layer, x[:, :20], s0)        # both halves cross a chunk boundary
    out_b, s_b = run(layer, x[:, 20:], s_a)
    close(jnp.concatenate([out_a, out_b], 1), out, TOL_FORMS, "prefill split in two calls")
    close(s_b.ssm, state.ssm, TOL_FORMS, "ssm after split prefill")
    close(s_b.conv, state.conv, TOL_CONV, "conv window")

    # the conv window really is the last K-1 raw q|k|v projections
    w_q = layer.q_proj.weight.get_value()
    np.testing.assert_allclose(state.conv[:, :, :w_q.shape[0]], x[:, -3:] @ w_q.T, rtol=1e-6, atol=1e-6)


def test_snapshots_are_states_after_each_token():
    layer = make_layer(k3=True)
    x = inputs(2, 20)
    s0 = random_state(layer, 2)
    _, final_c, snap_c = run(layer, x, s0, chunk_size=8, snaps=True)
    _, final_r, snap_r = run(layer, x, s0, mode="recurrent", snaps=True)
    assert snap_c.ssm.shape == (2, 20, 2, 16, 16) and snap_c.conv.shape == (2, 20, 3, 96)
    s = s0
    for t in range(x.shape[1]):
        _, s = run(layer, x[:, t:t + 1], s, mode="recurrent")
        for snap, form in ((snap_c, "chunked"), (snap_r, "recurrent")):
            close(snap.ssm[:, t], s.ssm, TOL_FORMS, f"{form} ssm snapshot {t}")
            close(snap.conv[:, t], s.conv, TOL_CONV, "conv window")
    close(snap_c.ssm[:, -1], final_c.ssm, 1e-6, "last snapshot == final state")
    close(final_r.ssm, s.ssm, TOL_FORMS, "final recurrent state")


def _numpy_k3_reference(p: dict, x: np.ndarray, h: int, hd: int, lb: float, eps: float) -> np.ndarray:
    """docs/architecture.md §1.5.3 written out literally: token loop, one head at a time, float64."""
    x = x.astype(np.float64)
    b, t, _ = x.shape
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))
    silu = lambda z: z * sig(z)
    out = np.zeros((b, t, D))
    for bi in range(b):
        raw = {c: x[bi] @ p[f"{c}_proj.weight"].T for c in "qkv"}
        conv = {}
        for c in "qkv":
            w = p[f"{c}_conv1d.weight"][:, 0, :]               # [P, 4]
            u = np.concatenate([np.zeros((3, raw[c].shape[1])), raw[c]])
            conv[c] = silu(sum(w[:, j] * u[j:j + t] for j in range(4))).reshape(t, h, hd)
        graw = (x[bi] @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T).reshape(t, h, hd)
        a = np.exp(p["A_log"][:h])
        beta = sig(x[bi] @ p["b_proj.weight"].T)
        gate = (x[bi] @ p["g_proj.weight"].T).reshape(t, h, hd)
        y = np.zeros((t, h, hd))
        for hh in range(h):
            g = lb * sig(a[hh] * (graw[:, hh] + p["dt_bias"].reshape(h, hd)[hh]))
            S = np.zeros((hd, hd))
            for tt in range(t):
                q = conv["q"][tt, hh] / np.sqrt(np.sum(conv["q"][tt, hh] ** 2) + 1e-6) * hd ** -0.5
                k = conv["k"][tt, hh] / np.sqrt(np.sum(conv["k"][tt, hh] ** 2) + 1e-6)
                S = S * np.exp(g[tt])[:, None]
                u = beta[tt, hh] * (conv["v"][tt, hh] - k @ S)
                S = S + np.outer(k, u)
                o = q @ S
                y[tt, hh] = o / np.sqrt(np.mean(o ** 2) + eps) * p["o_norm.weight"] * sig(gate[tt, hh])
        out[bi] = y.reshape(t, h * hd) @ p["o_proj.weight"].T
    return out


def test_k3_gate_against_numpy_spec():
    """The K3 layer (bounded gate, full-rank output gate) vs docs/architecture.md §1.5.3 written out in numpy,
    float64 on both sides (tests/float64.py)."""
    with x64():
        layer = make_layer(k3=True, dtype=jnp.float64)
        p = {k: np.asarray(v.get_value(), np.float64) for k, v in flat_params(layer).items()}
        assert p["A_log"].shape == (128,) and np.all(p["A_log"][2:] == 0) and np.all(p["A_log"][:2] > 0)
        assert "g_proj.weight" in p and "g_a_proj.weight" not in p
        x = inputs(2, 40, dtype=jnp.float64)
        want = _numpy_k3_reference(p, np.asarray(x), 2, 16, -5.0, 1e-5)
        assert_close(run(layer, x)[0], want, "chunked vs numpy spec")
        assert_close(run(layer, x, mode="recurrent")[0], want, "recurrent vs numpy spec")
    # the gate really is bounded: strong decays in some channels, weak in others
    graw = np.asarray(x) @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T
    g = -5.0 / (1 + np.exp(-np.exp(p["A_log"][:2]).repeat(16) * (graw + p["dt_bias"])))
    assert g.min() < -4.0 and g.max() > -0.1


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_right_padded_batch_matches_per_sequence_runs(mode):
    layer = make_layer(k3=False)
    lengths = [37, 20, 2]
    t = 40
    x = inputs(3, t)
    s0 = random_state(layer, 3)
    valid = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]
    out, state, snaps = run(layer, x, s0, mode=mode, valid=valid, snaps=True)
    for i, n in enumerate(lengths):
        # reference: this row alone, unpadded, fed token by token (each step's state = a snapshot)
        s_i = KDAState(conv=s0.conv[i:i + 1], ssm=s0.ssm[i:i + 1])
        for tt in range(n):
            o_i, s_i = run(layer, x[i:i + 1, tt:tt + 1], s_i, mode="recurrent")
            close(out[i, tt], o_i[0, 0], TOL_FORMS, f"row {i} output {tt}")
            close(snaps.ssm[i, tt], s_i.ssm[0], TOL_FORMS, f"row {i} ssm snapshot {tt}")
            close(snaps.conv[i, tt], s_i.conv[0], TOL_CONV, "conv window")
        close(state.ssm[i], s_i.ssm[0], TOL_FORMS, f"row {i} final ssm")
        close(state.conv[i], s_i.conv[0], TOL_CONV, "conv window")
        for tt in range(n, t):   # padded tokens changed nothing
            close(snaps.ssm[i, tt], s_i.ssm[0], TOL_FORMS, f"row {i} ssm snapshot at pad {tt}")
            close(snaps.conv[i, tt], s_i.conv[0], TOL_CONV, "conv window")


def _sharding_check():
    """8 devices, tensor=8, 8 heads: weights sharded on heads; output equals the 1-device run."""
    from jax.sharding import PartitionSpec as P

    from dspark_jax import sharding

    assert jax.device_count() >= 8, jax.devices()
    cfg = tiny_cfg(k3=True, heads=8, head_dim=8)
    ctor = lambda: KimiDeltaAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(tensor=8, devices=jax.devices()[:8])
    sharded = sharding.create_sharded(ctor, mesh)
    graphdef, state = nnx.split(sharded)
    plain = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))   # same weights, one device
    assert sharded.q_proj.weight.get_value().sharding.spec == P("tensor", None)
    assert sharded.o_proj.weight.get_value().sharding.spec == P(None, "tensor")
    assert sharded.q_conv1d.weight.get_value().sharding.spec == P("tensor", None, None)
    x = inputs(2, 40)
    want, s_want = run(plain, x)
    got, s_got = run(sharded, x)
    # partitioned matmuls (o_proj all-reduce) sum in another order: observed 3e-7 relative
    close(got, want, 1e-5, "sharded output")
    close(s_got.ssm, s_want.ssm, 1e-5, "sharded ssm state")


def test_sharded_heads_match_single_device():
    if jax.device_count() >= 8:
        _sharding_check()
        return
    # this process already has one CPU device: run the check where XLA can fake eight
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import test_kda; test_kda._sharding_check()
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
