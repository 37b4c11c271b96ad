"""The DSpark block drafter `K3DSparkModel` (docs/architecture.md §3).

Sizes come from the draft's config.json, so the same code builds the 68-tensor Kimi-K3 draft and
small drafts for small targets. The token embedding table and `lm_head` are the TARGET's and are
passed in by the caller; they are not parameters of this module.

Data flow (batch-first; B batch, N context tokens, T block width, D hidden, A = n_aux * D_target,
L = kv_lora_rank + qk_rope_head_dim latent row width, V vocab, r markov rank):
- `context_rows`: aux [B,N,A] -> ctx = rms(aux @ context_proj.T) -> every layer's latent rows
  `[rms(c_kv) | RoPE(k_pe)]` at the rows' absolute positions, skipping input_layernorm -> [n_layers,B,N,L].
- `block_hidden`: block embeddings [B,T,D] -> 5 pre-norm MLA + SwiGLU layers whose queries see the
  visible context rows and the whole block (non-causal) -> final_norm -> [B,T,D].
- `markov_bias` / `markov_sample_greedy`: low-rank bigram bias W1[prev] W2^T (fp32) added to the
  target-lm_head logits, drafted left to right.
- `confidence`: sigmoid(proj([h_k | W1[prev_k]]) + b), the predicted acceptance of draft k+1.

Reduced draft vocabulary (config `draft_vocab_size` K < `vocab_size` V; EAGLE-3 / FR-Spec style):
the draft's logits cover K kept target tokens only, the lm_head rows gathered by the map
(`base_logits` -> [..., K]); `markov_w2` is [K, r] (output side), `markov_w1` stays [V, r] (input
side, indexed by the previous TARGET id, which may be any token). The map travels with the draft as
EAGLE-3 checkpoints carry it (vLLM / SpecForge names): `d2t` int64 [K] offsets, target id =
draft index + d2t[index], and `t2d` bool [V], True for kept target ids. Kept ids are stored in
ascending order (as EAGLE-3 / SpecForge build them). Drafts leave `markov_draft` as target ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config.draft import DraftConfig
from dspark_jax.layers.linear import Linear
from dspark_jax.layers.mla import MLAttention
from dspark_jax.layers.mlp import GLUMLP
from dspark_jax.layers.norms import RMSNorm, rms_norm
from dspark_jax.numerics import einsum_acc, linear_acc
from dspark_jax.sampling import markov_draft


def block_input_ids(anchor_X: jax.Array, num_tokens: int, mask_token_id: int) -> jax.Array:
    """The block's input ids `[x0, M x (T-1)]` [..., T] for anchors x0 [...] (docs/architecture.md §3.3): one
    definition for serving (`steps.draft_block`), the cacheless reference and training."""
    mask = jnp.full(anchor_X.shape + (num_tokens - 1,), mask_token_id, anchor_X.dtype)
    return jnp.concatenate([anchor_X[..., None], mask], axis=-1)


class K3DSparkLayer(nnx.Module):
    """Pre-norm MLA (YaRN, interleaved, non-causal block) + SwiGLU."""

    def __init__(self, cfg: DraftConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = MLAttention.for_draft(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = GLUMLP(h, cfg.intermediate_size, act="silu", dtype=dtype, rngs=rngs)

    def forward_with(self, h_BTD: jax.Array, attend) -> jax.Array:
        """The layer with its attention supplied: `attend(layer_idx, self_attn, normed_input) -> out`
        (the models' one callback signature). Generation attends over the paged pool, training
        through the multi-anchor block-sparse attention (`kernels.dispatch.block_sparse_attention`)."""
        h_BTD = h_BTD + attend(self.layer_idx, self.self_attn, self.input_layernorm(h_BTD))
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))

    def __call__(self, h_BTD: jax.Array, positions_BT: jax.Array, kv_ctx_BSL: jax.Array,
                 ctx_mask_BTS: jax.Array, *, absorbed: bool = False) -> jax.Array:
        def attend(idx: int, attn: MLAttention, a_BTD: jax.Array) -> jax.Array:
            kv_blk_BTL = attn.latent_kv(a_BTD, positions_BT)
            kv_BSL = jnp.concatenate([kv_ctx_BSL.astype(kv_blk_BTL.dtype), kv_blk_BTL], axis=1)
            b, t = positions_BT.shape
            # every block row sees the whole block (non-causal, docs/architecture.md §3.3) plus its
            # visible context rows
            mask_BTS = jnp.concatenate([ctx_mask_BTS, jnp.ones((b, t, t), bool)], axis=2)
            return attn.attend(a_BTD, positions_BT, kv_BSL, mask_BTS, absorbed=absorbed)

        return self.forward_with(h_BTD, attend)


class VocabMap(nnx.Variable):
    """The reduced draft vocabulary's map (`d2t`, `t2d`): integer/bool state, not trained, saved
    with the draft at fixed dtypes (int64 / bool in the file; int32 / bool in the model)."""


# file dtypes of the map tensors (EAGLE-3 / SpecForge buffers: d2t torch.long, t2d torch.bool)
VOCAB_MAP_DTYPES = {"d2t": "I64", "t2d": "BOOL"}


def default_vocab_map(cfg: DraftConfig) -> tuple[jax.Array, jax.Array]:
    """(d2t int32 [K], t2d bool [V]) keeping the first K target ids (replaced by a chosen map)."""
    k, v = cfg.draft_vocab, cfg.vocab_size
    return jnp.zeros((k,), jnp.int32), jnp.arange(v) < k


class MarkovHead(nnx.Module):
    """Low-rank bigram bias: bias(prev) = W1[prev] @ W2^T, W1 [V, r] indexed by the previous target
    id, W2 [K, r] over the draft vocabulary (K = V unless reduced), computed in fp32 (float64 for
    float64 weights)."""

    def __init__(self, vocab_size: int, rank: int, *, dtype, rngs: nnx.Rngs, draft_vocab_size: int | None = None):
        self.markov_w1 = Linear(rank, vocab_size, axes=("vocab", "markov"), dtype=dtype, rngs=rngs)
        self.markov_w2 = Linear(rank, draft_vocab_size or vocab_size, axes=("vocab", "markov"), dtype=dtype,
                                rngs=rngs)

    def prev_features(self, prev_ids: jax.Array) -> jax.Array:
        """W1[prev] [..., r] in the param dtype (also the confidence head's Markov input)."""
        return jnp.take(self.markov_w1.weight.get_value(), prev_ids, axis=0)

    def __call__(self, prev_ids: jax.Array) -> jax.Array:
        # a projection of W1[prev] by W2 (bf16 weights: the native GEMM, no f32 copy of W2 per call)
        return linear_acc(self.prev_features(prev_ids), self.markov_w2.weight.get_value())


class ConfidenceHead(nnx.Module):
    """`proj`: Linear(D [+ r] -> 1) with bias on `[h_k | W1[prev_k]]`."""

    def __init__(self, in_features: int, *, dtype, rngs: nnx.Rngs):
        self.proj = Linear(in_features, 1, axes=("scalar", None), dtype=dtype, rngs=rngs, bias=True)


class K3DSparkModel(nnx.Module):
    """The DSpark draft. Param paths are the torch tensor names of docs/architecture.md §3.2 (minus `embed_tokens`,
    which is the target's table and only travels through the converters)."""

    def __init__(self, cfg: DraftConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.context_proj = Linear(cfg.num_aux * cfg.target_hidden_size, h, axes=("embed", "aux"),
                                   dtype=dtype, rngs=rngs)
        self.context_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([K3DSparkLayer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.markov_rank, dtype=dtype, rngs=rngs,
                                       draft_vocab_size=cfg.draft_vocab)
                            if cfg.markov_rank > 0 else None)
        if cfg.reduced_vocab:
            d2t, t2d = default_vocab_map(cfg)
            self.d2t, self.t2d = VocabMap(d2t), VocabMap(t2d)
        else:
            self.d2t = self.t2d = None
        with_markov = cfg.confidence_head_with_markov and self.markov_head is not None
        self.confidence_with_markov = with_markov
        self.confidence_head = (ConfidenceHead(h + (cfg.markov_rank if with_markov else 0),
                                               dtype=dtype, rngs=rngs)
                                if cfg.enable_confidence_head else None)

    # -- context ------------------------------------------------------------------------------

    def context_rows(self, aux_BNA: jax.Array, positions_BN: jax.Array) -> jax.Array:
        """Latent rows [n_layers, B, N, L] that every draft layer attends to, from the target's
        concatenated aux hidden states at absolute positions (no input_layernorm, no queries)."""
        w_DA = self.context_proj.weight.get_value()
        # the 35840-wide contraction accumulates in fp32 and rounds once, like a bf16 GEMM
        proj_BND = linear_acc(aux_BNA, w_DA).astype(w_DA.dtype)
        ctx_BND = rms_norm(proj_BND, self.context_norm.weight.get_value(), self.context_norm.eps)
        return jnp.stack([layer.self_attn.latent_kv(ctx_BND, positions_BN) for layer in self.layers])

    # -- block --------------------------------------------------------------------------------

    def block_hidden(self, block_embeds_BTD: jax.Array, block_positions_BT: jax.Array,
                     kv_ctx_LBSL: jax.Array, ctx_mask_BTS: jax.Array, *, absorbed: bool = False) -> jax.Array:
        """Final-normed hidden states [B,T,D] of the block. Layer l's queries see the context rows
        `kv_ctx_LBSL[l]` where `ctx_mask_BTS` is True, and every row of the block."""
        h_BTD = block_embeds_BTD
        for l, layer in enumerate(self.layers):
            h_BTD = layer(h_BTD, block_positions_BT, kv_ctx_LBSL[l], ctx_mask_BTS, absorbed=absorbed)
        return self.final_norm(h_BTD)

    def block_hidden_with(self, block_embeds_BTD: jax.Array, attend) -> jax.Array:
        """`block_hidden` with the attention supplied per layer: `attend(l, self_attn, a)`."""
        h_BTD = block_embeds_BTD
        for layer in self.layers:
            h_BTD = layer.forward_with(h_BTD, attend)
        return self.final_norm(h_BTD)

    # -- draft vocabulary ---------------------------------------------------------------------

    def draft_token_ids(self) -> jax.Array | None:
        """Target id of every draft index, int32 [K] (`arange(K) + d2t`); None at full vocab."""
        if self.d2t is None:
            return None
        d2t = self.d2t.get_value()
        return jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t.astype(jnp.int32)

    def to_target_ids(self, draft_idx: jax.Array) -> jax.Array:
        """Draft indices -> target ids (identity at full vocab)."""
        ids = self.draft_token_ids()
        return draft_idx if ids is None else jnp.take(ids, draft_idx, axis=0).astype(draft_idx.dtype)

    def to_draft_index(self, target_ids: jax.Array) -> jax.Array:
        """Target ids -> draft indices, K (the bucket) for ids outside the kept set."""
        ids = self.draft_token_ids()
        if ids is None:
            return target_ids
        idx = jnp.clip(jnp.searchsorted(ids, target_ids), 0, ids.shape[0] - 1)
        return jnp.where(jnp.take(ids, idx) == target_ids, idx, ids.shape[0]).astype(target_ids.dtype)

    def head_rows(self, lm_head_VD: jax.Array) -> jax.Array:
        """The lm_head rows of the draft vocabulary [K, D] (the target's head itself at full vocab,
        or a head already gathered to K rows)."""
        ids = self.draft_token_ids()
        if ids is None or lm_head_VD.shape[0] == ids.shape[0]:
            return lm_head_VD
        return jnp.take(lm_head_VD, ids, axis=0)

    def gather_to_target(self, logits_XK: jax.Array) -> jax.Array:
        """Draft-vocab logits [..., K] -> [..., V] with -inf outside the kept set (zero probability:
        the distribution that produced the drafts, over target ids, for rejection sampling)."""
        if self.d2t is None:
            return logits_XK
        # a gather from [..., K+1] (the last column -inf): XLA:CPU runs the scatter `.at[..., ids].set`
        # element by element (39 ms of a 62 ms block pass at 16 rows x 7 drafts)
        index_V = self.to_draft_index(jnp.arange(self.cfg.vocab_size, dtype=jnp.int32))
        outside = jnp.full(logits_XK.shape[:-1] + (1,), -jnp.inf, logits_XK.dtype)
        return jnp.take(jnp.concatenate([logits_XK, outside], -1), index_V, axis=-1)

    def base_logits(self, h_XD: jax.Array, lm_head_VD: jax.Array) -> jax.Array:
        """The target's lm_head on the draft's hidden states [..., D] -> [..., K] (K = V unless the
        draft vocabulary is reduced: then only the kept rows, `head_rows`), accumulated and
        returned in float32 (float64 under x64): the one precision of draft logits, in serving and
        in training alike (a bf16 draft rounds nothing here)."""
        head_KD = self.head_rows(lm_head_VD)
        return linear_acc(h_XD, head_KD)

    # -- Markov head --------------------------------------------------------------------------

    def markov_bias(self, prev_ids: jax.Array) -> jax.Array:
        """fp32 [..., K] bias for the token after the target ids `prev_ids` (zeros without a
        Markov head)."""
        if self.markov_head is None:
            return jnp.zeros(prev_ids.shape + (self.cfg.draft_vocab,), jnp.float32)
        return self.markov_head(prev_ids)

    def markov_sample_greedy(self, base_logits_BTV: jax.Array, x0_B: jax.Array) -> jax.Array:
        """Drafts [B,T] (target ids) left to right: d_{k+1} = argmax(base_k + bias(prev_k)),
        prev_0 = x0, prev_{k+1} = d_{k+1} (ATOM's greedy Markov sampling; the generation code path)."""
        return markov_draft(self, base_logits_BTV, x0_B)[0]

    # -- confidence head ----------------------------------------------------------------------

    def confidence_logit(self, h_BTD: jax.Array, prev_ids_BT: jax.Array) -> jax.Array:
        """fp32 logit [B,T] of P(draft k+1 accepted | prefix accepted) (the training BCE input)."""
        if self.confidence_head is None:
            raise ValueError("this draft has no confidence head (enable_confidence_head is false)")
        proj = self.confidence_head.proj
        w_1F = proj.weight.get_value()
        feats = [h_BTD.astype(w_1F.dtype)]
        if self.confidence_with_markov:
            feats.append(self.markov_head.prev_features(prev_ids_BT).astype(w_1F.dtype))
        x_BTF = jnp.concatenate(feats, axis=-1)
        logit_BT1 = einsum_acc("btf,of->bto", x_BTF, w_1F)
        return (logit_BT1 + proj.bias.get_value().astype(logit_BT1.dtype))[..., 0]

    def confidence(self, h_BTD: jax.Array, prev_ids_BT: jax.Array) -> jax.Array:
        """sigmoid(confidence_logit) in fp32, [B,T]."""
        return jax.nn.sigmoid(self.confidence_logit(h_BTD, prev_ids_BT))

    # -- cacheless reference entry --------------------------------------------------------------

    def block_forward(self, aux_hidden, anchor_token, embed, lm_head, num_speculative_tokens: int = 7
                      ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """One draft step without caches, for tests and parity checks.

        aux_hidden [N, n_aux * D_target]: the target's aux rows at positions 0..N-1; the block
        `[anchor, M x (T-1)]` sits at positions N..N+T-1 and sees all N context rows and itself.
        `embed`, `lm_head`: the target's [V, D] tables (lm_head in torch layout). Returns
        (base_logits [T,K] fp32 over the draft vocabulary (K = V unless reduced), greedy
        Markov-biased draft_tokens [T] as target ids, confidence [T] or None).
        """
        return _block_forward(self, jnp.asarray(aux_hidden)[None], jnp.asarray(anchor_token, jnp.int32).reshape(1),
                              jnp.asarray(embed), jnp.asarray(lm_head), int(num_speculative_tokens))


@nnx.jit(static_argnums=5)
def _block_forward(draft: K3DSparkModel, aux_BNA: jax.Array, x0_B: jax.Array, embed_VD: jax.Array,
                   lm_head_VD: jax.Array, t: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`K3DSparkModel.block_forward` for one sequence, compiled once per (N, T)."""
    dtype = draft.context_proj.weight.get_value().dtype
    n = aux_BNA.shape[1]
    kv_ctx_LBNL = draft.context_rows(aux_BNA, jnp.arange(n, dtype=jnp.int32)[None])
    ids_BT = block_input_ids(x0_B, t, draft.cfg.mask_token_id)
    pos_BT = (n + jnp.arange(t, dtype=jnp.int32))[None]
    h_BTD = draft.block_hidden(jnp.take(embed_VD, ids_BT, axis=0).astype(dtype), pos_BT, kv_ctx_LBNL,
                               jnp.ones((1, t, n), bool))
    base_BTV = draft.base_logits(h_BTD, lm_head_VD)
    drafts_BT = draft.markov_sample_greedy(base_BTV, x0_B)
    conf_BT = None
    if draft.confidence_head is not None:
        prev_BT = jnp.concatenate([x0_B[:, None], drafts_BT[:, :-1]], axis=1)
        conf_BT = draft.confidence(h_BTD, prev_BT)[0]
    return base_BTV[0], drafts_BT[0], conf_BT


def vocab_map_arrays(target_ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [K], t2d bool [V]) for ascending kept target ids (the file form)."""
    ids = np.asarray(target_ids, np.int64)
    if ids.ndim != 1 or (ids.size > 1 and not np.all(np.diff(ids) > 0)):
        raise ValueError("kept target ids must be a strictly increasing 1-D list")
    if ids.size and (ids[0] < 0 or ids[-1] >= vocab_size):
        raise ValueError(f"kept target ids must lie in 0..{vocab_size - 1}")
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(ids.size, dtype=np.int64), t2d
