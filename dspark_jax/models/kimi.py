"""The `kimi_linear` family target: Kimi-Linear and Kimi-K3 (docs/architecture.md §1).

Layers are KDA (linear attention) or MLA (full attention, NoPE), each followed by a dense GLU MLP
(layers < first_k_dense_replace) or the MoE. With `attn_res_block_size` set (K3) the residual
stream is Block Attention Residuals (docs/architecture.md §1.5.2); otherwise a plain pre-norm residual.

Every decoder layer returns what docs/architecture.md §2 calls the layer's output: the running residual for
Kimi-Linear (HF `hidden_states[L+1]`), the within-block partial sum `prefix` for K3. That value is
what the DSpark draft captures as aux hidden state.

The layer body takes the attention as a callable, so the cacheless forward and the cached
prefill/verify (`forward_cached`) run the same residual/FFN code.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.cache import KDAStates, TargetCaches
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.attn_res import attn_res
from dspark_jax.layers.kda import KDASnapshots, KDAState, KimiDeltaAttention
from dspark_jax.layers.linear import Embed, Linear
from dspark_jax.layers.mla import MLAttention
from dspark_jax.layers.mlp import GLUMLP
from dspark_jax.layers.moe import MoE
from dspark_jax.layers.norms import RMSNorm
from dspark_jax.models.target import ForwardOutput, TargetLM


class Residual(NamedTuple):
    """Residual-stream state between layers. Plain residual: `prefix` is the hidden state and
    `blocks` is empty. AttnRes: `prefix` is the partial sum of the current block (None right after
    banking) and `blocks` the banked block sums, embeddings first."""
    prefix: jax.Array | None
    blocks: tuple[jax.Array, ...]


# (layer index, its attention module, normed input [B,S,D]) -> attention output [B,S,D]: the one
# callback signature of every model (llama's and the draft's take the same)
AttentionFn = Callable[[int, nnx.Module, jax.Array], jax.Array]


class KimiDecoderLayer(nnx.Module):
    def __init__(self, cfg: KimiConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.is_mla = cfg.is_mla(layer_idx)
        self.is_moe = cfg.is_moe(layer_idx)
        self.block_size = cfg.attn_res_block_size
        self.eps = cfg.rms_norm_eps
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if self.is_mla:
            self.self_attn = MLAttention.for_target(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = GLUMLP(d, cfg.intermediate_size, act=cfg.hidden_act, situ_beta=cfg.situ_beta,
                              situ_linear_beta=cfg.situ_linear_beta, dtype=dtype, rngs=rngs)
        if self.block_size is not None:
            # AttnRes mixers: a per-candidate score from a [1, D] projection of the RMS-normed candidate
            self.self_attention_res_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.self_attention_res_proj = Linear(d, 1, axes=(None, "embed"), dtype=dtype, rngs=rngs)
            self.mlp_res_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.mlp_res_proj = Linear(d, 1, axes=(None, "embed"), dtype=dtype, rngs=rngs)

    def ffn(self, x: jax.Array) -> jax.Array:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    def _mix(self, prefix, blocks, norm: RMSNorm, proj: Linear) -> jax.Array:
        if not blocks:
            return prefix
        return attn_res(prefix, jnp.stack(blocks, axis=-2), proj.weight.get_value(),
                        norm.weight.get_value(), self.eps)

    def __call__(self, res: Residual, attention: AttentionFn) -> Residual:
        if self.block_size is None:
            h = res.prefix
            h = h + attention(self.layer_idx, self.self_attn, self.input_layernorm(h))
            h = h + self.ffn(self.post_attention_layernorm(h))
            return Residual(h, ())
        prefix, blocks = res
        h = self._mix(prefix, blocks, self.self_attention_res_norm, self.self_attention_res_proj)
        if self.layer_idx % self.block_size == 0:
            # bank the running sum BEFORE this layer's attention (layer 0 banks the embeddings)
            blocks, prefix = blocks + (prefix,), None
        a = attention(self.layer_idx, self.self_attn, self.input_layernorm(h))
        prefix = a if prefix is None else prefix + a
        h = self._mix(prefix, blocks, self.mlp_res_norm, self.mlp_res_proj)
        prefix = prefix + self.ffn(self.post_attention_layernorm(h))
        return Residual(prefix, blocks)


class KimiBackbone(nnx.Module):
    """`model.*` of the checkpoint: embeddings, layers, final AttnRes mix and norm."""

    def __init__(self, cfg: KimiConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = Embed(cfg.vocab_size, d, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([KimiDecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.output_attn_res_proj = Linear(d, 1, axes=(None, "embed"), dtype=dtype, rngs=rngs)

    def final_hidden(self, res: Residual) -> jax.Array:
        """The post-final-norm hidden state: the tensor fed to lm_head."""
        h = res.prefix
        if self.cfg.attn_res_block_size is not None:
            h = attn_res(res.prefix, jnp.stack(res.blocks, axis=-2),
                         self.output_attn_res_proj.weight.get_value(),
                         self.output_attn_res_norm.weight.get_value(), self.cfg.rms_norm_eps)
        return self.norm(h)


class KimiLinearModel(TargetLM):
    """Kimi-Linear / Kimi-K3 causal LM. Param paths are the checkpoint names without the
    `language_model.` prefix of the K3 wrapper (`cfg.tensor_prefix`)."""

    def __init__(self, cfg: KimiConfig, *, dtype=None, rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype or cfg.dtype)
        super().__init__(cfg, KimiBackbone(cfg, dtype=dtype, rngs=rngs), dtype=dtype, rngs=rngs)

    def run_layers(self, h_BSD: jax.Array, attention: AttentionFn,
                   aux_layer_ids: Sequence[int] = ()) -> tuple[Residual, jax.Array | None]:
        """Embeddings -> all decoder layers; returns the final residual state and the aux capture
        (the listed layers' outputs concatenated in id order, or None)."""
        res = Residual(h_BSD, ())
        captured = {}
        wanted = set(aux_layer_ids)
        for layer in self.model.layers:
            res = layer(res, attention)
            if layer.layer_idx in wanted:
                captured[layer.layer_idx] = res.prefix
        aux = jnp.concatenate([captured[i] for i in aux_layer_ids], axis=-1) if aux_layer_ids else None
        return res, aux

    def run(self, token_ids_BT: jax.Array, attention: AttentionFn, aux_layer_ids: Sequence[int] = (), *,
            weights: dict | None = None, logits_rows_BR: jax.Array | None = None) -> ForwardOutput:
        """Embeddings -> decoder layers (attention supplied by the caller) -> final AttnRes mix and
        norm -> lm_head (of rows `logits_rows_BR` only, when given). The family has no serving
        layout: `weights` is None."""
        del weights
        res, aux = self.run_layers(self.model.embed_tokens(token_ids_BT), attention, aux_layer_ids)
        final = self.model.final_hidden(res)
        return ForwardOutput(self.head(final, logits_rows_BR), aux, final)

    def forward(self, token_ids_BS: jax.Array, aux_layer_ids: Sequence[int] = (), *,
                positions_BS: jax.Array | None = None, valid_BS: jax.Array | None = None) -> ForwardOutput:
        """Cacheless causal forward (`TargetLM.forward`). `valid_BS` marks real tokens of
        right-padded rows (KDA state must not absorb padding); `positions_BS` go to the MLA layers."""
        _check_aux_ids(aux_layer_ids, self.cfg.num_hidden_layers)
        b, s = token_ids_BS.shape
        positions = positions_BS if positions_BS is not None else \
            jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        causal = jnp.tril(jnp.ones((s, s), bool))[None]
        mask = causal if valid_BS is None else causal & valid_BS[:, None, :]

        def attention(idx: int, attn: nnx.Module, x: jax.Array) -> jax.Array:
            if self.cfg.is_mla(idx):
                return attn(x, positions, mask)
            out, _ = attn(x, None, mode="chunked", valid_BT=valid_BS)
            return out

        return self.run(token_ids_BS, attention, aux_layer_ids)

    # -- cached (generation) ------------------------------------------------------------------

    @property
    def attention_rows(self) -> int:
        return len(self.cfg.full_attn_layers)

    @property
    def row_width(self) -> int:
        return self.cfg.kv_latent_dim

    def new_kda_states(self, batch: int, dtype) -> KDAStates | None:
        cfg = self.cfg
        if not cfg.kda_layers:
            return None
        return KDAStates.create(len(cfg.kda_layers), batch, 3 * cfg.kda_num_heads * cfg.kda_head_dim,
                                cfg.short_conv_kernel_size, cfg.kda_num_heads, cfg.kda_head_dim, dtype)

    def forward_cached(self, tokens_BT: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                       caches: TargetCaches, aux_layer_ids: tuple[int, ...] = (), *, verify: bool,
                       weights: dict | None = None, logits_rows_BR: jax.Array | None = None
                       ) -> tuple[ForwardOutput, TargetCaches, KDASnapshots | None]:
        """MLA layers write their latent rows into the pool and attend over it; KDA layers run
        chunked from their states (prefill) or recurrent with one snapshot per token (verify)."""
        cfg = self.cfg
        pool, kda = caches
        mla_row, kda_row = cfg.mla_layer_index, cfg.kda_layer_index
        new_conv, new_ssm, snap_conv, snap_ssm = {}, {}, {}, {}

        def attention(idx: int, attn: nnx.Module, x: jax.Array) -> jax.Array:
            nonlocal pool
            if cfg.is_mla(idx):
                row = mla_row[idx]
                pool = pool.write(row, positions_BT, attn.latent_kv(x, positions_BT), valid_BT)
                return attn.attend_paged(x, positions_BT, pool, row, causal=True)
            i = kda_row[idx]
            state = KDAState(kda.conv[i], kda.ssm[i])
            if verify:
                out, st, snaps = attn(x, state, mode="recurrent", valid_BT=valid_BT, return_snapshots=True)
                snap_conv[i], snap_ssm[i] = snaps.conv, snaps.ssm
            else:
                out, st = attn(x, state, mode="chunked", valid_BT=valid_BT)
            new_conv[i], new_ssm[i] = st.conv, st.ssm
            return out

        out = self.run(tokens_BT, attention, aux_layer_ids, weights=weights, logits_rows_BR=logits_rows_BR)
        n_kda = len(cfg.kda_layers)
        if n_kda:
            kda = KDAStates(jnp.stack([new_conv[i] for i in range(n_kda)]),
                            jnp.stack([new_ssm[i] for i in range(n_kda)]))
        snaps = None
        if verify and n_kda:
            snaps = KDASnapshots(jnp.stack([snap_conv[i] for i in range(n_kda)]),
                                 jnp.stack([snap_ssm[i] for i in range(n_kda)]))
        return out, TargetCaches(pool, kda), snaps


def _check_aux_ids(ids: Sequence[int], n_layers: int) -> None:
    bad = [i for i in ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} outside 0..{n_layers - 1} (0-based decoder layer ids)")


def hf_rename(ckpt_keys: set[str], prefix: str) -> Callable[[str], str]:
    """transformers' `save_pretrained` for Kimi-Linear writes the dense layer-0 MLP under
    `block_sparse_moe.` (its reverse rename maps every `.mlp.`); the released checkpoints use
    `.mlp.`. Accept whichever the checkpoint holds."""

    def rename(path: str) -> str:
        if ".mlp." in path and prefix + path not in ckpt_keys:
            alt = path.replace(".mlp.", ".block_sparse_moe.")
            if prefix + alt in ckpt_keys:
                return alt
        return path

    return rename
