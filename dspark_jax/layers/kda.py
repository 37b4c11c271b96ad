"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear and Kimi-K3 (docs/architecture.md §1.5.3).

Per head the layer keeps a state S [K, V] (K-first, fp32) updated by a gated delta rule with a
per-channel decay:  S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S.
Two numerically equal forms are provided as pure functions so Pallas kernels can sit beside them:
`kda_recurrent` (a scan over tokens: decode / verify) and `kda_chunked` (the WY-form chunkwise
parallel algorithm: prefill). `causal_conv` is the depthwise short convolution both share.

Precision: everything said to be fp32 below is float64 instead when the layer's params (or the
inputs of a pure function) are float64 (parity tests under x64); bf16 and float32 are unchanged.

Config switches (KimiConfig):
- `gate_lower_bound` None: Kimi-Linear forget gate g = -exp(A_log) * softplus(f + dt_bias),
  A_log stored [1, 1, H, 1]. A float lb: K3 "safe gate" g = lb * sigmoid(exp(A_log) * (f + dt_bias)),
  A_log stored as a vector zero-padded to a multiple of 128 (only [0:H] is read).
- `use_full_rank_gate` True: K3 output gate `g_proj` [P, D]; False: Kimi-Linear `g_a_proj`/`g_b_proj`.
The output norm is the same in both families: rms(o) * w * sigmoid(gate) (fla FusedRMSNormGated with
activation="sigmoid"; transformers' KimiLinearRMSNormGated and ATOM's K3 layer agree).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.linear import Linear
from dspark_jax.numerics import acc_dtype
from dspark_jax.params import param

# K3 stores A_log zero-padded to a multiple of this (docs/architecture.md §1.3: [128] for 96 heads).
K3_A_LOG_PAD = 128


class KDAState(NamedTuple):
    """Recurrent state of one KDA layer.

    conv: [B, K-1, 3P] the last K-1 raw (pre-conv, pre-silu) q|k|v projections, param dtype.
    ssm:  [B, H, Kdim, Vdim] delta-rule state, float32, K-first.
    """
    conv: jnp.ndarray
    ssm: jnp.ndarray

    @classmethod
    def zeros(cls, cfg: KimiConfig, batch: int, dtype) -> "KDAState":
        p = cfg.kda_num_heads * cfg.kda_head_dim
        return cls(
            conv=jnp.zeros((batch, cfg.short_conv_kernel_size - 1, 3 * p), dtype),
            ssm=jnp.zeros((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32))


class KDASnapshots(NamedTuple):
    """The state AFTER every token t (docs/architecture.md §5.2: speculative rollback is picking an index).

    conv: [B, T, K-1, 3P];  ssm: [B, T, H, Kdim, Vdim] float32.
    """
    conv: jnp.ndarray
    ssm: jnp.ndarray


# ---------------------------------------------------------------------------------------------
# Pure functions (references for the kernels)


def causal_conv(window_BWC: jnp.ndarray, weight_CK: jnp.ndarray) -> jnp.ndarray:
    """Depthwise causal conv over a window that already holds the K-1 past inputs in front.

    window_BWC: [B, K-1+T, C]; weight_CK: [C, K]. Returns the pre-activation [B, T, C] in float32:
    out[t, c] = sum_j w[c, j] * window[t + j, c].
    """
    k = weight_CK.shape[-1]
    t = window_BWC.shape[1] - (k - 1)
    acc = acc_dtype(window_BWC, weight_CK)
    w = weight_CK.astype(acc)
    win = window_BWC.astype(acc)
    return sum(win[:, j:j + t, :] * w[:, j] for j in range(k))


def l2_normalize(x: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    """x / sqrt(sum(x^2) + eps), fp32 (fla's l2norm: eps inside the sqrt, not a max)."""
    xf = x.astype(acc_dtype(x))
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def kda_gate(graw_BTHK: jnp.ndarray, a_log_H: jnp.ndarray, dt_bias_HK: jnp.ndarray,
             lower_bound: float | None) -> jnp.ndarray:
    """Per-channel log-decay g <= 0 (fp32). `lower_bound` None = Kimi-Linear softplus gate."""
    acc = acc_dtype(graw_BTHK, dt_bias_HK, a_log_H)
    x = graw_BTHK.astype(acc) + dt_bias_HK.astype(acc)
    rate_H1 = jnp.exp(a_log_H.astype(acc))[:, None]
    if lower_bound is None:
        return -rate_H1 * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(rate_H1 * x)


def gated_rms_norm(o: jnp.ndarray, weight: jnp.ndarray, gate: jnp.ndarray, eps: float) -> jnp.ndarray:
    """rms(o) * w * sigmoid(gate) over the last axis, all in fp32 (fla FusedRMSNormGated)."""
    acc = acc_dtype(o, gate)
    of = o.astype(acc)
    normed = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    return normed * weight.astype(acc) * jax.nn.sigmoid(gate.astype(acc))


class _Conv(nnx.Module):
    """Holds one depthwise conv weight [P, 1, K] (F32 in the checkpoint) as `<name>.weight`."""

    def __init__(self, channels: int, kernel_size: int, rngs: nnx.Rngs):
        # ~ torch Conv1d's fan-in scale (fan-in = K for a depthwise conv)
        self.weight = param((channels, 1, kernel_size), jnp.float32, ("heads", None, "conv"), rngs,
                            scale=kernel_size ** -0.5)


class _NormWeight(nnx.Module):
    """`o_norm.weight` [head_dim] F32; the gated norm itself is `gated_rms_norm`."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.weight = param((dim,), jnp.float32, ("norm",), rngs, init="ones")


class KimiDeltaAttention(nnx.Module):
    """`self_attn` of a KDA decoder layer; attribute paths are the checkpoint tensor names."""

    def __init__(self, cfg: KimiConfig, *, dtype, rngs: nnx.Rngs):
        d, h, hd = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        p, kc = h * hd, cfg.short_conv_kernel_size
        self.num_heads, self.head_dim, self.conv_size = h, hd, kc
        self.lower_bound = cfg.gate_lower_bound
        self.full_rank_gate = cfg.use_full_rank_gate
        self.eps = cfg.rms_norm_eps
        self.dtype = jnp.dtype(dtype)

        self.q_proj = Linear(d, p, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, p, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, p, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        # separate depthwise convs (transformers stacks them into one `conv1d`)
        self.q_conv1d = _Conv(p, kc, rngs)
        self.k_conv1d = _Conv(p, kc, rngs)
        self.v_conv1d = _Conv(p, kc, rngs)

        # Decay rates A = exp(A_log) ~ U(1, 16) (fla init). A_log is tiny: replicated.
        if self.lower_bound is None:
            a_shape = (1, 1, h, 1)
        else:
            a_shape = (math.ceil(h / K3_A_LOG_PAD) * K3_A_LOG_PAD,)
        self.A_log = param(a_shape, jnp.float32, (None,) * len(a_shape), rngs, init="uniform_pm1")
        a_log = jnp.log(1.0 + 7.5 * (self.A_log.get_value() + 1.0))
        if self.lower_bound is not None:  # K3 zero-pads past the H real entries
            a_log = jnp.where(jnp.arange(a_shape[0]) < h, a_log, 0.0)
        self.A_log.set_value(a_log)

        # dt_bias: Kimi-Linear uses inverse-softplus of dt ~ logU(1e-3, 1e-1) (fla init), giving
        # per-token decays exp(-A*dt) spanning ~0.2..1. The K3 sigmoid gate needs dt_bias near 0
        # for the same spread inside (lb, 0).
        self.dt_bias = param((p,), jnp.float32, ("heads",), rngs, init="uniform_pm1")
        u = self.dt_bias.get_value()
        if self.lower_bound is None:
            dt = jnp.exp(math.log(1e-3) + (u + 1.0) * 0.5 * (math.log(1e-1) - math.log(1e-3)))
            self.dt_bias.set_value(dt + jnp.log(-jnp.expm1(-dt)))
        else:
            self.dt_bias.set_value(0.5 * u)

        self.f_a_proj = Linear(d, hd, axes=(None, "embed"), dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(hd, p, axes=("heads", None), dtype=dtype, rngs=rngs)
        self.b_proj = Linear(d, h, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        if self.full_rank_gate:
            self.g_proj = Linear(d, p, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.g_a_proj = Linear(d, hd, axes=(None, "embed"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(hd, p, axes=("heads", None), dtype=dtype, rngs=rngs)
        self.o_norm = _NormWeight(hd, rngs)
        self.o_proj = Linear(p, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs)

    def init_state(self, batch: int) -> KDAState:
        p = self.num_heads * self.head_dim
        ssm_dtype = jnp.float64 if self.dtype == jnp.float64 else jnp.float32
        return KDAState(
            conv=jnp.zeros((batch, self.conv_size - 1, 3 * p), self.dtype),
            ssm=jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), ssm_dtype))

    def __call__(self, x_BTD: jnp.ndarray, state: KDAState | None = None, *, mode: str = "chunked",
                 valid_BT: jnp.ndarray | None = None, return_snapshots: bool = False,
                 chunk_size: int = 64):
        """Run T tokens from `state` (zeros if None).

        mode: "chunked" (parallel prefill form) or "recurrent" (scan over tokens); equal results.
        valid_BT: bool, True for real tokens of a RIGHT-padded batch (each row a valid prefix).
          Padded tokens leave the state untouched: the returned state (and every snapshot past the
          last valid token) is the state after the row's last valid token; their outputs are junk.
        Returns (out_BTD, new_state) or, with return_snapshots, (out_BTD, new_state, KDASnapshots).
        """
        from dspark_jax.kernels import dispatch  # Pallas kernel on GPU, these references on CPU

        b, t, _ = x_BTD.shape
        h, hd, kc = self.num_heads, self.head_dim, self.conv_size
        if state is None:
            state = self.init_state(b)
        if valid_BT is not None:
            x_BTD = jnp.where(valid_BT[..., None], x_BTD, 0).astype(x_BTD.dtype)

        # q, k, v stay separate (each head-sharded) rather than one concatenated 3P activation,
        # which under tensor parallelism would need a reshuffle; only the small window is joined.
        p = h * hd
        windows = []
        for i, (proj, conv) in enumerate(((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                          (self.v_proj, self.v_conv1d))):
            raw_BTP = proj(x_BTD)
            windows.append(jnp.concatenate([state.conv[..., i * p:(i + 1) * p].astype(raw_BTP.dtype),
                                            raw_BTP], axis=1))             # [B, K-1+T, P]
        q, k, v = (jax.nn.silu(causal_conv(win, conv.weight.get_value()[:, 0, :]))
                   .astype(win.dtype).reshape(b, t, h, hd)
                   for win, conv in zip(windows, (self.q_conv1d, self.k_conv1d, self.v_conv1d)))
        q = l2_normalize(q) * hd ** -0.5
        k = l2_normalize(k)

        graw = self.f_b_proj(self.f_a_proj(x_BTD)).reshape(b, t, h, hd)
        a_log_H = self.A_log.get_value().reshape(-1)[:h]
        g = kda_gate(graw, a_log_H, self.dt_bias.get_value().reshape(h, hd), self.lower_bound)
        b_BTH = self.b_proj(x_BTD)
        beta = jax.nn.sigmoid(b_BTH.astype(acc_dtype(b_BTH)))          # fp32 beta (docs/architecture.md §1.5.3)
        if valid_BT is not None:  # g = beta = 0 makes a token the identity on the state
            g = jnp.where(valid_BT[..., None, None], g, 0.0)
            beta = jnp.where(valid_BT[..., None], beta, 0.0)

        if mode == "chunked":
            o, ssm, ssm_snaps = dispatch.kda_prefill(q, k, v, g, beta, state.ssm, chunk_size=chunk_size,
                                            return_snapshots=return_snapshots)
        elif mode == "recurrent":
            o, ssm, ssm_snaps = dispatch.kda_verify(q, k, v, g, beta, state.ssm,
                                              return_snapshots=return_snapshots)
        else:
            raise ValueError(f"KDA mode must be 'chunked' or 'recurrent', got {mode!r}")

        if self.full_rank_gate:
            gate = self.g_proj(x_BTD)
        else:
            gate = self.g_b_proj(self.g_a_proj(x_BTD))
        y = gated_rms_norm(o, self.o_norm.weight.get_value(), gate.reshape(b, t, h, hd), self.eps)
        out_BTD = self.o_proj(y.astype(self.dtype).reshape(b, t, h * hd))

        # Conv window after n tokens = window rows n .. n+K-2 (row K-2+n is raw token n-1).
        n_B = jnp.full((b,), t) if valid_BT is None else jnp.sum(valid_BT, axis=1)
        offs = jnp.arange(kc - 1)

        def rows(idx_BR):   # the q|k|v window rows idx -> [B, R, 3P] in the state dtype
            return jnp.concatenate([jnp.take_along_axis(w, idx_BR[..., None], axis=1) for w in windows],
                                   -1).astype(state.conv.dtype)

        new_state = KDAState(conv=rows(n_B[:, None] + offs), ssm=ssm)
        if not return_snapshots:
            return out_BTD, new_state
        after_BT = jnp.minimum(jnp.arange(1, t + 1)[None, :], n_B[:, None])   # tokens consumed
        conv_snaps = rows((after_BT[..., None] + offs).reshape(b, -1)).reshape(b, t, kc - 1, -1)
        return out_BTD, new_state, KDASnapshots(conv=conv_snaps, ssm=ssm_snaps)

