"""The DSpark distillation objective (docs/architecture.md §4), multi-anchor and pure.

Per sequence (B sequences of S tokens, A anchors, block width T, vocabulary V):
1. anchors: positions a in [0, S-2] with loss_mask[a] & loss_mask[a+1]; up to A of them drawn
   uniformly without replacement, sorted, padded with keep=False (anchor 0);
2. block input `[x_a, M x (T-1)]` at positions a..a+T-1 (all M when dropped); the block sees the
   context rows at positions < a (strictly) and its own T rows, nothing of other blocks (the
   draft's own layers, attention through `kernels.dispatch.block_sparse_attention`);
3. labels: row k predicts x_{a+k+1}; eval_mask[k] = keep & (a+k+1 < S) & loss_mask[a+k+1],
   cumulative product over k; teacher-forced Markov previous tokens prev[k] = x_{a+k};
4. target distribution of row k: softmax(lm_head(target final hidden[a+k])), frozen;
5. weights w[k] = eval_mask[k] * exp(-k / gamma);
6. loss = (ce_w * sum w CE + l1_w * sum w L1 + conf_w * sum w BCE) / sum w, one pooled
   denominator over everything that is summed (micro-batches, devices).

Reduced draft vocabulary (K kept target ids, `draft.draft_token_ids()`): the draft's logits are
over the K kept tokens; the target's distribution is folded into K + 1 classes, the kept tokens
plus ONE bucket holding the target's mass outside the kept set. The draft's bucket logit is -inf:
served drafts never fall outside the kept set, so the draft's distribution over target ids has
zero mass there, and L1 = sum_kept |q - p| + p_bucket is exactly the L1 (2 x total variation)
between the distribution the draft samples from and the target's, and 1 - L1/2 the exact
acceptance probability. A label in the bucket has CE +inf under that draft; its CE term is
dropped (0, its weight stays in the pooled denominator), its L1 and BCE terms count as usual.

All reductions are returned as sums (`LossSums`) so gradient accumulation and sharding only add.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.kernels import dispatch
from dspark_jax.layers.mla import split_kv_b
from dspark_jax.models.dspark import block_input_ids
from dspark_jax.numerics import argmax, linear_acc


@dataclasses.dataclass(frozen=True)
class LossConfig:
    block_size: int = 7
    num_anchors: int = 512
    gamma: float = 4.0
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0


class Anchors(NamedTuple):
    positions_BA: jax.Array   # int32, sorted ascending among kept; 0 where dropped
    keep_BA: jax.Array        # bool


class Blocks(NamedTuple):
    """Everything about the B*A blocks that does not depend on the draft."""
    anchors: Anchors
    input_ids_BAT: jax.Array    # [x_a, M, ..., M] (all M when dropped)
    positions_BAT: jax.Array    # a + k
    labels_BAT: jax.Array       # x_{a+k+1}
    prev_BAT: jax.Array         # x_{a+k}: teacher-forced Markov previous token
    eval_mask_BAT: jax.Array    # bool, contiguous supervised prefix
    weights_BAT: jax.Array      # fp32 eval_mask * exp(-k/gamma)


class TokenTerms(NamedTuple):
    """Per-token fp32 terms [B,A,T] (unweighted)."""
    ce: jax.Array
    l1: jax.Array
    accept: jax.Array       # clamp(1 - L1/2, 0, 1)
    bce: jax.Array
    draft_top1: jax.Array   # argmax of the Markov-biased draft logits
    target_top1: jax.Array  # argmax of the target logits


class LossSums(NamedTuple):
    """Additive statistics of a batch; `numerator / weight` is the loss."""
    numerator: jax.Array        # ce_w*ce + l1_w*l1 + conf_w*bce, weighted sums
    weight: jax.Array           # sum w (the pooled denominator)
    ce: jax.Array               # sum w*CE
    l1: jax.Array               # sum w*L1
    bce: jax.Array              # sum w*BCE
    count_T: jax.Array          # per position: sum eval_mask
    accept_T: jax.Array         # per position: sum eval*accept
    top1_T: jax.Array           # per position: sum eval*(draft argmax == label)
    agree_T: jax.Array          # per position: sum eval*(draft argmax == target argmax)
    ce_T: jax.Array             # per position: sum eval*CE
    tau: jax.Array              # sum over kept blocks of 1 + sum_k prod_{j<=k} acc_j*eval_j
    blocks: jax.Array           # number of kept blocks


def sample_anchors(loss_mask_BS: jax.Array, num_anchors: int, key: jax.Array) -> Anchors:
    """Up to `num_anchors` valid anchors per row, uniformly without replacement, sorted."""
    b, s = loss_mask_BS.shape
    m = loss_mask_BS.astype(bool)
    valid_BC = m[:, :-1] & m[:, 1:]                       # candidate a = 0..S-2
    c = valid_BC.shape[1]
    if c < num_anchors:                                   # fewer candidates than anchors: pad
        valid_BC = jnp.pad(valid_BC, ((0, 0), (0, num_anchors - c)))
        c = num_anchors
    # random keys in [0,1) for valid candidates, 2 for invalid; the A smallest are a uniform
    # sample without replacement of the valid ones (all of them when fewer than A)
    score_BC = jnp.where(valid_BC, jax.random.uniform(key, (b, c)), 2.0)
    _, pick_BA = jax.lax.top_k(-score_BC, num_anchors)
    keep_BA = jnp.take_along_axis(valid_BC, pick_BA, axis=1)
    big = jnp.iinfo(jnp.int32).max
    sorted_BA = jnp.sort(jnp.where(keep_BA, pick_BA.astype(jnp.int32), big), axis=1)
    keep_BA = sorted_BA < big
    return Anchors(jnp.where(keep_BA, sorted_BA, 0), keep_BA)


def make_blocks(input_ids_BS: jax.Array, loss_mask_BS: jax.Array, anchors: Anchors,
                cfg: LossConfig, mask_token_id: int) -> Blocks:
    """Block inputs, labels, Markov previous tokens and weights for the sampled anchors."""
    b, s = input_ids_BS.shape
    t = cfg.block_size
    a_BA, keep_BA = anchors
    k_T = jnp.arange(t, dtype=jnp.int32)
    pos_BAT = a_BA[..., None] + k_T
    lab_pos_BAT = pos_BAT + 1

    def gather(x_BS, idx_BAT):
        idx = jnp.clip(idx_BAT, 0, s - 1).reshape(b, -1)
        return jnp.take_along_axis(x_BS, idx, axis=1).reshape(idx_BAT.shape)

    x0_BA = jnp.take_along_axis(input_ids_BS, a_BA, axis=1)
    ids_BAT = block_input_ids(jnp.where(keep_BA, x0_BA, mask_token_id), t, mask_token_id)
    labels_BAT = gather(input_ids_BS, lab_pos_BAT)
    prev_BAT = gather(input_ids_BS, pos_BAT)
    supervised_BAT = keep_BA[..., None] & (lab_pos_BAT < s) & gather(loss_mask_BS.astype(bool), lab_pos_BAT)
    eval_BAT = jnp.cumprod(supervised_BAT.astype(jnp.int32), axis=-1).astype(bool)
    decay_T = jnp.exp(-k_T.astype(jnp.float32) / cfg.gamma)
    weights_BAT = eval_BAT.astype(jnp.float32) * decay_T
    return Blocks(anchors, ids_BAT, pos_BAT, labels_BAT, prev_BAT, eval_BAT, weights_BAT)


def multi_anchor_hidden(draft, block_embeds_BATD: jax.Array, block_positions_BAT: jax.Array,
                        kv_ctx_LBSW: jax.Array, anchors: Anchors) -> jax.Array:
    """Final-normed draft hidden states [B,A,T,D] of every anchor's block: the draft's layers
    (`block_hidden_with`, the serving code) on the B*A blocks, each layer's attention through the
    kernel dispatch (`dispatch.block_sparse_attention`): block a sees context positions < its
    anchor (nothing when dropped) and its own block (bidirectional), so no block sees another."""
    b, a, t, d = block_embeds_BATD.shape
    a_BA, keep_BA = anchors
    ctx_len_BA = jnp.where(keep_BA, a_BA, 0)
    pos_XT = block_positions_BAT.reshape(b * a, t)      # X = B*A blocks

    def attend(l: int, attn, x_XTD: jax.Array) -> jax.Array:
        q_nope_XTNH, q_rope_XTNR = attn.queries(x_XTD, pos_XT)
        kv_blk_XTL = attn.latent_kv(x_XTD, pos_XT)
        w_uk_NHC, w_uv_NVC = split_kv_b(attn.kv_b_proj.weight.get_value(), attn.num_heads, attn.qk_nope_head_dim)
        per_block = lambda x: x.reshape(b, a, *x.shape[1:])
        o_BATNV = dispatch.block_sparse_attention(per_block(q_nope_XTNH), per_block(q_rope_XTNR), kv_ctx_LBSW[l],
                                                  per_block(kv_blk_XTL), w_uk_NHC, w_uv_NVC, ctx_len_BA,
                                                  attn.softmax_scale)
        return attn.output(x_XTD, o_BATNV.reshape(b * a, *o_BATNV.shape[2:]))

    h_XTD = draft.block_hidden_with(block_embeds_BATD.reshape(b * a, t, d), attend)
    return h_XTD.reshape(b, a, t, d)


class TeacherProbs(NamedTuple):
    """The target's side of the per-token terms, row by row (a row's values depend on that row's
    logits alone, so they can be computed per position and gathered for the blocks afterwards)."""
    p_K: jax.Array         # [..., K] target probabilities of the draft's tokens (K = V unless reduced)
    bucket: jax.Array      # [...] target mass outside the kept set (0 for a full-vocabulary draft)
    top1: jax.Array        # [...] the target's argmax (a target id)


def teacher_probs(target_logits_XV: jax.Array, draft_ids_K: jax.Array | None = None) -> TeacherProbs:
    """Softmax of the target's logits over all V, cut to the draft vocabulary `draft_ids_K`
    (ascending target ids; None: all of V) plus the bucket of the rest, in fp32 (float64 for
    float64 inputs)."""
    f32 = jnp.promote_types(target_logits_XV.dtype, jnp.float32)
    p_XV = jax.nn.softmax(target_logits_XV.astype(f32), axis=-1)
    top1 = argmax(p_XV)
    if draft_ids_K is None:
        return TeacherProbs(p_XV, jnp.zeros(p_XV.shape[:-1], f32), top1)
    kept_V = jnp.zeros(p_XV.shape[-1], bool).at[draft_ids_K].set(True)
    bucket = jnp.sum(jnp.where(kept_V, 0.0, p_XV), axis=-1)      # summed directly, not 1 - sum
    return TeacherProbs(jnp.take(p_XV, draft_ids_K, axis=-1), bucket, top1)


def token_terms(draft_logits_BATV: jax.Array, target_logits_BATV: jax.Array, conf_logit_BAT: jax.Array | None,
                labels_BAT: jax.Array, draft_ids_K: jax.Array | None = None) -> TokenTerms:
    """CE (hard labels, Markov-biased logits), L1 between the full probability vectors,
    acceptance 1 - L1/2 and BCE(confidence logit -> stopgrad(acceptance)), all fp32 (float64
    for float64 inputs).

    `draft_ids_K` (ascending target ids of a reduced draft vocabulary): `draft_logits` are over
    those K tokens, `target_logits` over the full vocabulary; the target mass outside the kept set
    goes into one bucket where the draft has probability 0 (module docstring). The argmaxes are
    returned as target ids either way."""
    return terms_from_teacher(draft_logits_BATV, teacher_probs(target_logits_BATV, draft_ids_K), conf_logit_BAT,
                              labels_BAT, draft_ids_K)


def terms_from_teacher(draft_logits_BATV: jax.Array, teacher: TeacherProbs, conf_logit_BAT: jax.Array | None,
                       labels_BAT: jax.Array, draft_ids_K: jax.Array | None = None) -> TokenTerms:
    """`token_terms` with the target's side already reduced to `teacher_probs` rows."""
    f32 = jnp.promote_types(draft_logits_BATV.dtype, jnp.float32)
    logp_BATV = jax.nn.log_softmax(draft_logits_BATV.astype(f32), axis=-1)
    l1 = jnp.sum(jnp.abs(jnp.exp(logp_BATV) - teacher.p_K.astype(f32)), axis=-1) + teacher.bucket.astype(f32)
    if draft_ids_K is None:
        ce = -jnp.take_along_axis(logp_BATV, labels_BAT[..., None], axis=-1)[..., 0]
        draft_top1 = argmax(logp_BATV)
    else:
        k = draft_ids_K.shape[0]
        lab_idx = jnp.clip(jnp.searchsorted(draft_ids_K, labels_BAT), 0, k - 1)
        in_set = jnp.take(draft_ids_K, lab_idx) == labels_BAT             # else: the bucket
        ce_kept = -jnp.take_along_axis(logp_BATV, lab_idx[..., None], axis=-1)[..., 0]
        ce = jnp.where(in_set, ce_kept, 0.0)
        draft_top1 = jnp.take(draft_ids_K, argmax(logp_BATV))
    accept = jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0)
    if conf_logit_BAT is None:
        bce = jnp.zeros_like(ce)
    else:
        x, y = conf_logit_BAT.astype(f32), jax.lax.stop_gradient(accept)
        bce = jnp.maximum(x, 0.0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))
    return TokenTerms(ce, l1, accept, bce, draft_top1, teacher.top1)


def reduce_terms(terms: TokenTerms, blocks: Blocks, cfg: LossConfig) -> LossSums:
    w = blocks.weights_BAT.astype(terms.l1.dtype)        # summed in the terms' precision
    ev = blocks.eval_mask_BAT.astype(jnp.float32)
    ce, l1, bce = jnp.sum(w * terms.ce), jnp.sum(w * terms.l1), jnp.sum(w * terms.bce)
    numerator = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.confidence_weight * bce
    per_pos = lambda x: jnp.sum(x * ev, axis=(0, 1))
    keep = blocks.anchors.keep_BA.astype(jnp.float32)
    survive_BAT = jnp.cumprod(jax.lax.stop_gradient(terms.accept) * ev, axis=-1)
    tau = jnp.sum(keep * (1.0 + jnp.sum(survive_BAT, axis=-1)))
    sg = jax.lax.stop_gradient
    sums = (numerator, jnp.sum(w), sg(ce), sg(l1), sg(bce), jnp.sum(ev, axis=(0, 1)),
            per_pos(sg(terms.accept)), per_pos((terms.draft_top1 == blocks.labels_BAT).astype(jnp.float32)),
            per_pos((terms.draft_top1 == terms.target_top1).astype(jnp.float32)), per_pos(sg(terms.ce)),
            tau, jnp.sum(keep))
    # one dtype for every sum (float64 when the terms are): what zero_sums(cfg, dtype) starts from
    return LossSums(*(x.astype(terms.l1.dtype) for x in sums))


class DistillOutputs(NamedTuple):
    blocks: Blocks
    terms: TokenTerms
    sums: LossSums


def distill_outputs(draft, embed_VD: jax.Array, lm_head_VD: jax.Array, input_ids_BS: jax.Array,
                    loss_mask_BS: jax.Array, aux_BSA: jax.Array, final_hidden_BSH: jax.Array,
                    key: jax.Array, cfg: LossConfig) -> DistillOutputs:
    """The whole objective for one batch: anchors, the draft's multi-anchor pass, per-token terms
    and their sums. `embed_VD`/`lm_head_VD` are the target's frozen tables (already in the compute
    dtype); `aux_BSA`/`final_hidden_BSH` are the teacher's outputs for the same tokens."""
    b, s = input_ids_BS.shape
    dcfg = draft.cfg
    anchors = sample_anchors(loss_mask_BS, cfg.num_anchors, key)
    blocks = make_blocks(input_ids_BS, loss_mask_BS, anchors, cfg, dcfg.mask_token_id)
    embed_VD, lm_head_VD = jax.lax.stop_gradient(embed_VD), jax.lax.stop_gradient(lm_head_VD)
    aux_BSA, final_hidden_BSH = jax.lax.stop_gradient(aux_BSA), jax.lax.stop_gradient(final_hidden_BSH)

    positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_LBSW = draft.context_rows(aux_BSA, positions_BS)
    embeds_BATD = jnp.take(embed_VD, blocks.input_ids_BAT, axis=0)
    h_BATD = multi_anchor_hidden(draft, embeds_BATD, blocks.positions_BAT, kv_LBSW, anchors)

    # [B,A,T,K]: over the draft vocabulary (K = V unless reduced: only the kept tokens' lm_head
    # rows, the training-time saving); the teacher's logits below stay over all V
    draft_logits_BATV = draft.base_logits(h_BATD, lm_head_VD) + draft.markov_bias(blocks.prev_BAT)
    # the target state at a+k is the one that predicted x_{a+k+1}. Its lm_head and softmax over V
    # run on whichever is fewer, the S positions or the A*T gathered rows (same values, row by
    # row); only the rows cut to the draft vocabulary are gathered for the blocks
    t_idx = jnp.clip(blocks.positions_BAT, 0, s - 1).reshape(b, -1)
    ids_K = draft.draft_token_ids()
    rows = lambda x: jnp.take_along_axis(x, t_idx.reshape(t_idx.shape + (1,) * (x.ndim - 2)), axis=1)
    if s < t_idx.shape[1]:
        teacher_BX = jax.tree.map(rows, teacher_probs(linear_acc(final_hidden_BSH, lm_head_VD), ids_K))
    else:
        teacher_BX = teacher_probs(linear_acc(rows(final_hidden_BSH), lm_head_VD), ids_K)
    teacher_BAT = jax.tree.map(lambda x: x.reshape(blocks.positions_BAT.shape + x.shape[2:]), teacher_BX)
    conf = None
    if dcfg.enable_confidence_head:
        a, t = blocks.prev_BAT.shape[1:]
        conf = draft.confidence_logit(h_BATD.reshape(b * a, t, -1), blocks.prev_BAT.reshape(b * a, t))
        conf = conf.reshape(b, a, t)
    terms = terms_from_teacher(draft_logits_BATV, teacher_BAT, conf, blocks.labels_BAT, ids_K)
    return DistillOutputs(blocks, terms, reduce_terms(terms, blocks, cfg))


def distill_loss(*args, **kwargs) -> jax.Array:
    """The pooled loss of one batch (arguments of `distill_outputs`)."""
    sums = distill_outputs(*args, **kwargs).sums
    return sums.numerator / jnp.maximum(sums.weight, 1e-6)


def add_sums(a: LossSums, b: LossSums) -> LossSums:
    return LossSums(*(x + y for x, y in zip(a, b)))


def metrics_from_sums(sums: LossSums, cfg: LossConfig) -> dict[str, jax.Array]:
    """Loss terms (weighted means), per-position acceptance, tau_probabilistic, top-1 accuracy
    and teacher agreement from accumulated sums."""
    w = jnp.maximum(sums.weight, 1e-6)
    count = jnp.maximum(sums.count_T, 1.0)
    tokens = jnp.maximum(jnp.sum(sums.count_T), 1.0)
    out = {"loss": sums.numerator / w, "ce": sums.ce / w, "l1": sums.l1 / w, "bce": sums.bce / w,
           "tau_probabilistic": sums.tau / jnp.maximum(sums.blocks, 1.0),
           "top1_acc": jnp.sum(sums.top1_T) / tokens, "teacher_agreement": jnp.sum(sums.agree_T) / tokens,
           "accept_rate": jnp.sum(sums.accept_T) / tokens, "supervised_tokens": jnp.sum(sums.count_T),
           "blocks": sums.blocks}
    for k in range(cfg.block_size):
        out[f"accept@{k + 1}"] = sums.accept_T[k] / count[k]
        out[f"top1@{k + 1}"] = sums.top1_T[k] / count[k]
    return out


def zero_sums(cfg: LossConfig, dtype=jnp.float32) -> LossSums:
    """The additive identity (scalars, and [T] vectors for the per-position fields) in the terms'
    dtype (float32; float64 for a float64 draft)."""
    t = cfg.block_size
    return LossSums(*(jnp.zeros((t,) if name.endswith("_T") else (), dtype) for name in LossSums._fields))
