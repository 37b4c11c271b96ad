"""Multi-head Latent Attention (docs/architecture.md §1.5.4 target, §3.3 draft, §5.4 cache rows).

Per token the layer keeps one latent row `kv_L = [rms(c_kv) (kv_lora) | k_pe (rope)]` (576 wide
in K3 and the draft); `k_pe` is rotated when the layer has RoPE (draft) and raw otherwise (NoPE
target). Queries attend over any set of such rows under a boolean mask, in one of two
mathematically identical forms:
- expanded: kv_b_proj lifts every row to per-head k_nope / v (prefill, training);
- absorbed: W_UK is folded into q and W_UV applied after the weighted sum, so scores and the
  weighted sum run directly on the latent rows (decode over the paged cache).

Shapes: B batch, T query tokens, S key rows, N heads, H qk_nope_head_dim, R qk_rope_head_dim,
V v_head_dim, C kv_lora_rank, L = C + R, D hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.kernels.mla_reference import mla_attend_absorbed, mla_attend_expanded
from dspark_jax.layers.linear import Linear
from dspark_jax.layers.norms import RMSNorm
from dspark_jax.layers.rope import RotaryEmbedding, softmax_scale
from dspark_jax.numerics import acc_dtype


def split_kv_b(kv_b_weight: jnp.ndarray, num_heads: int, nope_dim: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """kv_b_proj.weight [N*(H+V), C] -> (W_UK [N,H,C], W_UV [N,V,C])."""
    w_NXC = kv_b_weight.reshape(num_heads, -1, kv_b_weight.shape[-1])
    return w_NXC[:, :nope_dim], w_NXC[:, nope_dim:]


def causal_mask(batch: int, length: int) -> jnp.ndarray:
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


class MLAttention(nnx.Module):
    """MLA with optional q LoRA, optional RoPE (None = NoPE) and optional sigmoid output gate."""

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, norm_eps: float,
                 use_output_gate: bool, rope: RotaryEmbedding | None, softmax_scale: float,
                 dtype, rngs: nnx.Rngs):
        if rope is not None and rope.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"rope rotary_dim {rope.rotary_dim} != qk_rope_head_dim {qk_rope_head_dim}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope = rope
        self.softmax_scale = float(softmax_scale)
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, axes=("q_lora", "embed"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps, dtype=dtype, rngs=rngs, axis="q_lora")
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk, axes=("heads", "q_lora"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                         axes=("kv_lora", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps, dtype=dtype, rngs=rngs, axis="kv_lora")
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                axes=("heads", "kv_lora"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        if use_output_gate:
            self.g_proj = Linear(hidden_size, num_heads * v_head_dim, axes=("heads", "embed"), dtype=dtype,
                                 rngs=rngs)
        self.use_output_gate = use_output_gate
        self.q_lora_rank = q_lora_rank

    @classmethod
    def for_target(cls, cfg: KimiConfig, *, dtype, rngs: nnx.Rngs) -> "MLAttention":
        """Kimi target MLA: q/kv LoRA norms at the hard-coded 1e-6, NoPE, optional output gate."""
        rope = (None if cfg.mla_use_nope
                else RotaryEmbedding.plain(cfg.qk_rope_head_dim, cfg.rope_theta, interleaved=True))
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, norm_eps=cfg.mla_norm_eps,
                   use_output_gate=cfg.mla_use_output_gate, rope=rope, softmax_scale=cfg.qk_head_dim ** -0.5,
                   dtype=dtype, rngs=rngs)

    @classmethod
    def for_draft(cls, cfg: DraftConfig, *, dtype, rngs: nnx.Rngs) -> "MLAttention":
        """DSpark draft MLA: YaRN rope on interleaved pairs, config eps, no gate, mscale² scale."""
        rope = RotaryEmbedding.from_scaling(cfg.rope, cfg.qk_rope_head_dim, interleaved=True)
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, norm_eps=cfg.rms_norm_eps,
                   use_output_gate=cfg.mla_use_output_gate, rope=rope,
                   softmax_scale=softmax_scale(cfg.qk_head_dim, cfg.rope), dtype=dtype, rngs=rngs)

    # -- pieces ---------------------------------------------------------------------------------

    def latent_kv(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray) -> jnp.ndarray:
        """The cache row per token: [rms(c_kv) | k_pe] [B,T,C+R] (k_pe rotated iff RoPE)."""
        kv_BTL = self.kv_a_proj_with_mqa(x_BTD)
        c_kv_BTC = self.kv_a_layernorm(kv_BTL[..., :self.kv_lora_rank])
        k_pe_BTR = kv_BTL[..., self.kv_lora_rank:]
        if self.rope is not None:
            k_pe_BTR = self.rope(k_pe_BTR, positions_BT)
        return jnp.concatenate([c_kv_BTC, k_pe_BTR.astype(c_kv_BTC.dtype)], axis=-1)

    def queries(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(q_nope [B,T,N,H], q_rope [B,T,N,R]); q_rope rotated iff RoPE."""
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BTNK = q.reshape(*q.shape[:-1], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope_BTNH = q_BTNK[..., :self.qk_nope_head_dim]
        q_rope_BTNR = q_BTNK[..., self.qk_nope_head_dim:]
        if self.rope is not None:
            q_rope_BTNR = self.rope(q_rope_BTNR, positions_BT)
        return q_nope_BTNH, q_rope_BTNR

    def attend(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray, kv_BSL: jnp.ndarray,
               mask_BTS: jnp.ndarray, *, absorbed: bool) -> jnp.ndarray:
        """Queries from x over the latent rows kv (mask True = visible) -> [B,T,D]."""
        q_nope_BTNH, q_rope_BTNR = self.queries(x_BTD, positions_BT)
        w_uk_NHC, w_uv_NVC = split_kv_b(self.kv_b_proj.weight.get_value(), self.num_heads,
                                        self.qk_nope_head_dim)
        attend_fn = mla_attend_absorbed if absorbed else mla_attend_expanded
        o_BTNV = attend_fn(q_nope_BTNH, q_rope_BTNR, kv_BSL.astype(q_nope_BTNH.dtype), mask_BTS,
                           w_uk_NHC, w_uv_NVC, self.softmax_scale)
        return self.output(x_BTD, o_BTNV)

    def attend_paged(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray, pool, row: int, *,
                     causal: bool) -> jnp.ndarray:
        """Absorbed attention straight over the paged latent pool (`cache.PagedPool`), through the
        kernel dispatch. causal: keys at positions <= each query's; else (draft block) keys at
        positions < the block's last position + 1, i.e. context rows before the block and the
        whole block, whose rows the caller wrote into the pool first."""
        from dspark_jax.kernels import dispatch

        q_nope_BTNH, q_rope_BTNR = self.queries(x_BTD, positions_BT)
        w_uk_NHC, w_uv_NVC = split_kv_b(self.kv_b_proj.weight.get_value(), self.num_heads,
                                        self.qk_nope_head_dim)
        q_lat_BTNC = jnp.einsum("btnh,nhc->btnc", q_nope_BTNH, w_uk_NHC)
        ctx_BTNC = dispatch.mla_paged_attention(q_lat_BTNC, q_rope_BTNR, pool.pages, pool.block_table,
                                                positions_BT, self.softmax_scale, causal=causal, row=row)
        o_BTNV = jnp.einsum("btnc,nvc->btnv", ctx_BTNC.astype(w_uv_NVC.dtype), w_uv_NVC)
        return self.output(x_BTD, o_BTNV)

    def output(self, x_BTD: jnp.ndarray, o_BTNV: jnp.ndarray) -> jnp.ndarray:
        """Per-head attention outputs -> the layer output (output gate, then o_proj)."""
        o_BTX = o_BTNV.reshape(*o_BTNV.shape[:-2], self.num_heads * self.v_head_dim)
        if self.use_output_gate:
            # gate from the layer input, sigmoid rounded to the param dtype, product in that dtype: the
            # reference's bf16 `o * sigmoid(g)` (docs/architecture.md §1.5.4). torch evaluates a bf16 sigmoid in fp32
            # and rounds once; XLA's bf16 logistic rounds after every step (up to 2 bf16 ulps off),
            # so it is evaluated in fp32 here (tests/layers/test_bf16_casts.py)
            g_BTX = self.g_proj(x_BTD)
            o_BTX = o_BTX * jax.nn.sigmoid(g_BTX.astype(acc_dtype(g_BTX))).astype(o_BTX.dtype)
        return self.o_proj(o_BTX)

    def __call__(self, x_BTD: jnp.ndarray, positions_BT: jnp.ndarray,
                 mask_BTT: jnp.ndarray | None = None, *, absorbed: bool = False) -> jnp.ndarray:
        """Cacheless self-attention over x's own latent rows (causal unless a mask is given)."""
        if mask_BTT is None:
            mask_BTT = causal_mask(x_BTD.shape[0], x_BTD.shape[1])
        return self.attend(x_BTD, positions_BT, self.latent_kv(x_BTD, positions_BT), mask_BTT,
                           absorbed=absorbed)
