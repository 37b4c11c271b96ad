"""The `llama` family target: dense GQA decoders, the math of transformers' `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` and `MistralForCausalLM`.

Pre-norm layers `h = x + attn(norm(x)); out = h + mlp(norm(h))` with RMSNorm, NeoX (half-split)
RoPE on q and k (plain, linear, Llama 3 or YaRN frequencies), grouped-query attention and a SwiGLU
MLP; tied or untied lm_head. What the configs switch (`LlamaConfig`): q/k/v biases (Qwen2, Llama
`attention_bias`), an o_proj bias (`attention_bias`), Qwen3's per-head RMSNorm of q and k before
RoPE, and a sliding window on some or all layers (Mistral, Qwen `use_sliding_window`). Param paths
are the HF tensor names (`model.layers.3.self_attn.q_proj.weight`, `...q_proj.bias`,
`...self_attn.q_norm.weight`, `lm_head.weight`).

The layer body takes the attention as a callable (`AttentionFn`), so the cacheless `forward`
(tests, parity, the teacher) and `steps.py`'s paged-pool step run the same residual/MLP code. All
attention math is in `gqa_attention`; the cache only decides where keys/values are written and read.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.cache import TargetCaches
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.layers.linear import Embed, Linear, linear_io
from dspark_jax.layers.mlp import glu
from dspark_jax.layers.norms import RMSNorm
from dspark_jax.kernels.paged_attention import paged_attention
from dspark_jax.layers.rope import RotaryEmbedding
from dspark_jax.models.target import ForwardOutput, TargetLM
from dspark_jax.numerics import acc_dtype, einsum_acc, on_cpu


def gqa_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                  mask_BTS: jax.Array) -> jax.Array:
    """Grouped-query softmax attention; query head n reads kv head n // (N/K) (HF `repeat_kv`).

    Scores and softmax in fp32, probabilities cast to v's dtype before the value matmul (as HF
    eager attention). Fully masked rows (padding) give finite garbage, never NaN.
    """
    b, t, n, h = q_BTNH.shape
    k = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
    scores_BKGTS = einsum_acc("btkgh,bskh->bkgts", q_BTKGH, k_BSKH) * (h ** -0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(b, t, n, h)


def gqa_paged_attention(q_BTNH: jax.Array, pool, row: int, num_kv_heads: int,
                        positions_BT: jax.Array, valid_BT: jax.Array | None = None, *,
                        window: int | None = None) -> jax.Array:
    """`gqa_attention` of each query over the pool rows `[k | v]` of `row` at positions up to its
    own (the last `window` of them, with a window), in query tiles and key chunks
    (`paged_attention`) -> [B,T,N,H] in q's dtype. Rows not `valid_BT` (padding) read nothing and
    give zeros."""
    b, t, n, h = q_BTNH.shape
    k, dtype = num_kv_heads, q_BTNH.dtype
    q_BKGTH = q_BTNH.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    scale = h ** -0.5
    if on_cpu():
        # einsum_acc would upcast the queries for every key chunk: once here, the scale folded in
        q_BKGTH, scale = q_BKGTH.astype(acc_dtype(q_BKGTH)) * scale, None

    def scores(qs, kv_BCW):
        k_BCKH = kv_BCW.reshape(b, -1, k, 2 * h)[..., :h]
        s_BKGTC = einsum_acc("bkgth,bckh->bkgtc", qs[0], k_BCKH)
        return s_BKGTC if scale is None else s_BKGTC * scale

    def values(p_BKGTC, kv_BCW):
        return einsum_acc("bkgtc,bckh->bkgth", p_BKGTC, kv_BCW.reshape(b, -1, k, 2 * h)[..., h:])

    limits_BT = positions_BT + 1
    if valid_BT is not None:
        limits_BT = jnp.where(valid_BT, limits_BT, 0)
    starts_BT = None if window is None else positions_BT - (window - 1)
    out_BKGTH = paged_attention(pool, row, dtype, 2 * k * h, limits_BT, (q_BKGTH,), scores, values,
                                starts_BT=starts_BT)
    return out_BKGTH.astype(dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


# attention(layer_idx, attn_module, normed_x_BTD) -> attention output [B,T,D]: how a layer's
# attention gets its keys/values (this call's tokens, or the paged pool of `forward_cached`)
AttentionFn = Callable[[int, "LlamaAttention", jax.Array], jax.Array]


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(d, n * h, axes=("heads", "embed"), dtype=dtype, rngs=rngs, bias=cfg.qkv_bias)
        self.k_proj = Linear(d, k * h, axes=("kv_heads", "embed"), dtype=dtype, rngs=rngs, bias=cfg.qkv_bias)
        self.v_proj = Linear(d, k * h, axes=("kv_heads", "embed"), dtype=dtype, rngs=rngs, bias=cfg.qkv_bias)
        self.o_proj = Linear(n * h, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.rope = RotaryEmbedding.for_llama(cfg.rope, h)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.qk_norm, self.window = cfg.qk_norm, cfg.window(layer_idx)

    def project(self, x_BTD: jax.Array, positions_BT: jax.Array, weights: dict | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,T,N,H] and k [B,T,K,H] (normed per head for Qwen3) rotated at their positions,
        v [B,T,K,H]. `weights` (`LlamaModel.serving_weights`): the three projections as one
        [in, out] matrix (and one bias), one GEMM instead of three."""
        b, t, _ = x_BTD.shape
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        if weights is None:
            q, kk, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        else:
            qkv = linear_io(x_BTD, weights["qkv"])
            if "qkv_bias" in weights:
                qkv = qkv + weights["qkv_bias"]
            q, kk, v = qkv[..., :n * h], qkv[..., n * h:(n + k) * h], qkv[..., (n + k) * h:]
        q_BTNH, k_BTKH = q.reshape(b, t, n, h), kk.reshape(b, t, k, h)
        if self.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        return self.rope(q_BTNH, positions_BT), self.rope(k_BTKH, positions_BT), v.reshape(b, t, k, h)

    def output(self, out_BTF: jax.Array, weights: dict | None = None) -> jax.Array:
        """o_proj (through its [in, out] copy in `weights`, when given)."""
        if weights is None:
            return self.o_proj(out_BTF)
        y = linear_io(out_BTF, weights["o"])
        return y + weights["o_bias"] if "o_bias" in weights else y

    def attend(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
               mask_BTS: jax.Array) -> jax.Array:
        """Attention over any key set (cache dtype may differ from the params'), then o_proj."""
        b, t = q_BTNH.shape[:2]
        out_BTNH = gqa_attention(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask_BTS)
        return self.output(out_BTNH.reshape(b, t, self.num_heads * self.head_dim))


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, i, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, i, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, d, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, weights: dict | None = None) -> jax.Array:
        """`weights` (`LlamaModel.serving_weights`): gate|up as one [in, 2I] matrix and down as
        [I, out]: two GEMMs instead of three."""
        if weights is None:
            return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), "silu"))
        gu = linear_io(x, weights["gate_up"])
        i = gu.shape[-1] // 2
        return linear_io(glu(gu[..., :i], gu[..., i:], "silu"), weights["down"])


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.self_attn = LlamaAttention(cfg, layer_idx, dtype=dtype, rngs=rngs)
        self.mlp = LlamaMLP(cfg, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, attention: AttentionFn, weights: dict | None = None) -> jax.Array:
        h_BTD = x_BTD + attention(self.layer_idx, self.self_attn, self.input_layernorm(x_BTD))
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD), weights)


class LlamaBackbone(nnx.Module):
    """HF `LlamaModel` (the `model.` prefix of every tensor but lm_head)."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)


class LlamaModel(TargetLM):
    """HF `LlamaForCausalLM`: `model.*` + `lm_head` (absent when embeddings are tied)."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, LlamaBackbone(cfg, dtype=dtype, rngs=rngs), dtype=dtype, rngs=rngs)

    def run(self, token_ids_BT: jax.Array, attention: AttentionFn, aux_layer_ids: Sequence[int] = (), *,
            weights: dict | None = None, logits_rows_BR: jax.Array | None = None) -> ForwardOutput:
        """Embeddings -> decoder layers (attention supplied by the caller) -> norm -> lm_head,
        capturing the outputs of `aux_layer_ids` (concatenated in the order given). `weights`:
        `serving_weights()` (the MLPs' fused [in, out] copies and the lm_head's [in, out] copy).
        `logits_rows_BR`: only these rows' logits ([B,R,V]; a prefill needs the last prompt row's)."""
        bad = [i for i in aux_layer_ids if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} outside 0..{self.cfg.num_hidden_layers - 1} "
                             "(0-based decoder layer ids)")
        x_BTD = self.model.embed_tokens(token_ids_BT)
        captured = {}
        for layer in self.model.layers:
            x_BTD = layer(x_BTD, attention, None if weights is None else weights["layers"][layer.layer_idx])
            captured[layer.layer_idx] = x_BTD
        aux = jnp.concatenate([captured[i] for i in aux_layer_ids], axis=-1) if aux_layer_ids else None
        final_BTD = self.model.norm(x_BTD)
        logits = self.head(final_BTD, logits_rows_BR, None if weights is None else weights.get("head"))
        return ForwardOutput(logits, aux, final_BTD)

    def forward(self, token_ids_BS: jax.Array, aux_layer_ids: Sequence[int] = (), *,
                positions_BS: jax.Array | None = None, valid_BS: jax.Array | None = None) -> ForwardOutput:
        """Cacheless causal forward (`TargetLM.forward`). `positions_BS` only feeds RoPE, so
        left-padded rows work with positions counted from their first real token."""
        b, s = token_ids_BS.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask_BSS = jnp.tril(jnp.ones((s, s), bool))[None]
        if valid_BS is not None:
            mask_BSS = mask_BSS & valid_BS[:, None, :].astype(bool)
        mask_BSS = jnp.broadcast_to(mask_BSS, (b, s, s))
        # a sliding window: a query at position p sees keys at positions > p - window
        behind_BSS = positions_BS[:, :, None] - positions_BS[:, None, :]

        def attention(layer_idx: int, attn: LlamaAttention, x_BSD: jax.Array) -> jax.Array:
            mask = mask_BSS if attn.window is None else mask_BSS & (behind_BSS < attn.window)
            return attn.attend(*attn.project(x_BSD, positions_BS), mask)

        return self.run(token_ids_BS, attention, aux_layer_ids)

    # -- cached (generation): one pool row per layer holds `[k | v]` -------------------------------

    @property
    def attention_rows(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def row_width(self) -> int:
        return 2 * self.cfg.num_key_value_heads * self.cfg.head_dim

    def serving_weights(self, head: bool = True) -> dict:
        """Copies of the weights in the layout XLA:CPU's GEMMs run best, built once per engine
        (outside any program; the checkpoint layout and the declared params are untouched):
        per layer q|k|v as one [D, (N+2K)H] matrix (and one bias), gate|up as one [D, 2I], o and down as
        [in, out]; with `head`, the lm_head as [D, V]. Concatenating inside a program instead
        costs a copy of every weight per call. Each output column is the same dot product as
        the separate [out, in] projection's, so greedy outputs stay identical to the
        separate-GEMM path's up to the GEMM's summation order (see tests/decode/test_serving_layout.py)."""
        def t(w):
            return jnp.asarray(jnp.transpose(w))

        layers = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            w = {
                "qkv": t(jnp.concatenate([p.weight.get_value() for p in qkv], 0)),
                "o": t(a.o_proj.weight.get_value()),
                "gate_up": t(jnp.concatenate([m.gate_proj.weight.get_value(), m.up_proj.weight.get_value()], 0)),
                "down": t(m.down_proj.weight.get_value()),
            }
            if self.cfg.qkv_bias:
                w["qkv_bias"] = jnp.concatenate([p.bias.get_value() for p in qkv])
            if self.cfg.o_bias:
                w["o_bias"] = a.o_proj.bias.get_value()
            layers.append(w)
        out = {"layers": layers}
        if head:
            w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
            out["head"] = t(w.get_value())
        return out

    def forward_cached(self, tokens_BT: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                       caches: TargetCaches, aux_layer_ids: tuple[int, ...] = (), *, verify: bool,
                       weights: dict | None = None, logits_rows_BR: jax.Array | None = None
                       ) -> tuple[ForwardOutput, TargetCaches, None]:
        """Each layer writes its rotated keys and values at the tokens' positions, then attends
        over the logical cache up to each query's position (its last `window` positions on a
        sliding-window layer), as far as the latest position reaches (`gqa_paged_attention`). `verify` changes nothing here.
        `weights`: `serving_weights()` (fused [in, out] projections), else the declared params.
        `logits_rows_BR`: compute the logits of these rows only (`ForwardOutput.logits` [B,R,V])."""
        del verify
        pool = caches.pool

        def attention(layer_idx: int, attn: LlamaAttention, x: jax.Array) -> jax.Array:
            nonlocal pool
            w = None if weights is None else weights["layers"][layer_idx]
            q, k, v = attn.project(x, positions_BT, w)   # [B,T,Nq,Hd], [B,T,Nkv,Hd] x2
            b, t, nkv, _ = k.shape
            pool = pool.write(layer_idx, positions_BT, jnp.concatenate([k, v], -1).reshape(b, t, -1), valid_BT)
            out_BTF = gqa_paged_attention(q, pool, layer_idx, nkv, positions_BT, valid_BT,
                                          window=attn.window).reshape(b, t, -1)
            return attn.output(out_BTF, w)

        out = self.run(tokens_BT, attention, aux_layer_ids, weights=weights, logits_rows_BR=logits_rows_BR)
        return out, TargetCaches(pool, None), None
