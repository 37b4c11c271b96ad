"""The shared step functions: pure, static-shaped, jit-compiled by their callers.

- `target_forward`: prefill and verify through the paged caches; logits, aux, final hidden,
  updated caches (+ KDA snapshots when verifying).
- `draft_context`: aux rows -> the draft's context latent rows, written into the draft's rows
  of the shared pool at the tokens' positions.
- `draft_block`: the draft's block pass from the pool + Markov-head drafting + confidence.
- `accept`: greedy verification, and lossless rejection sampling for temperature > 0.

Generation (`dspark_jax.decode.generate`) calls them on caches; distillation calls `target_forward`'s
cacheless sibling (`target.forward`) as the teacher and the draft's `block_hidden` in its
multi-anchor form.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.cache import KDAStates, PagedPool, TargetCaches
from dspark_jax.layers.kda import KDASnapshots
from dspark_jax.models.dspark import block_input_ids
from dspark_jax.models.target import ForwardOutput
from dspark_jax.numerics import argmax
from dspark_jax.sampling import GREEDY, SamplingParams, filter_logits, markov_draft


def target_forward(target, tokens_BT: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                   caches: TargetCaches, aux_layer_ids: tuple[int, ...] = (), *, verify: bool,
                   weights: dict | None = None, logits_rows_BR: jax.Array | None = None
                   ) -> tuple[ForwardOutput, TargetCaches, KDASnapshots | None]:
    """Run T tokens per sequence at their positions through the target with caches (every target
    family's `forward_cached`, models/target.py `TargetLM`).

    Prefill (`verify=False`): KDA in chunked form, states advance past the valid tokens.
    Verify (`verify=True`): KDA in recurrent form returning one snapshot per token (stacked over
    KDA layers: conv [n_kda,B,T,K-1,3P], ssm [n_kda,B,T,H,K,V]); the caller commits the snapshot of
    the last accepted token with `commit_kda`. Attention layers write their rows for valid tokens
    and attend over the logical cache up to each query's position. `weights`: the target's
    `serving_weights()` (None: its declared params); `logits_rows_BR`: the logits of these rows
    only ([B,R,V]; a prefill needs its last prompt row's)."""
    return target.forward_cached(tokens_BT, positions_BT, valid_BT, caches, tuple(aux_layer_ids), verify=verify,
                                 weights=weights, logits_rows_BR=logits_rows_BR)


def commit_kda(kda: KDAStates, snaps: KDASnapshots, keep_B: jax.Array) -> KDAStates:
    """Keep, per sequence, the snapshot after its last accepted token (index `keep_B`)."""
    def pick(x):   # [n_kda, B, T, ...] -> [n_kda, B, ...]
        idx = keep_B.reshape((1, -1, 1) + (1,) * (x.ndim - 3))
        return jnp.take_along_axis(x, idx, axis=2)[:, :, 0]
    return KDAStates(pick(snaps.conv).astype(kda.conv.dtype), pick(snaps.ssm))


# ---------------------------------------------------------------------------------------------
# draft


def draft_context(draft, aux_BTA: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                  pool: PagedPool, first_row: int) -> PagedPool:
    """Project the target's aux rows into every draft layer's latent rows at their positions
    (docs/architecture.md §3.3 "context KV rows"; rows later rejected sit at future positions and get rewritten)."""
    rows_LBTW = draft.context_rows(aux_BTA, positions_BT)
    for layer in range(rows_LBTW.shape[0]):
        pool = pool.write(first_row + layer, positions_BT, rows_LBTW[layer], valid_BT)
    return pool


class DraftProposal(NamedTuple):
    tokens_BT: jax.Array         # drafts d_1..d_T (target ids)
    logits_BTV: jax.Array        # Markov-biased draft logits that produced them (fp32), over the
                                 # target vocabulary (-inf outside a reduced draft vocabulary)
    confidence_BT: jax.Array | None
    pool: PagedPool              # with the block's rows written (overwritten by draft_context later)


def draft_block(draft, embed_VD: jax.Array, lm_head_VD: jax.Array, anchor_B: jax.Array,
                anchor_pos_B: jax.Array, pool: PagedPool, first_row: int, num_tokens: int, *,
                sampling: SamplingParams = GREEDY, key: jax.Array | None = None,
                active_B: jax.Array | None = None, width: int | None = None) -> DraftProposal:
    """One block pass: block `[x0, M x (T-1)]` at positions p..p+T-1 (x0 = anchor at p) attends to
    the context rows at positions < p and to the whole block; then the Markov head drafts left to
    right (greedy at temperature 0, sampled from the biased distribution otherwise). `active_B`: rows whose
    block rows are written (None: every row); the others read their own block but store nothing.
    `width`: drafts wanted (None: all T), from a block of that many rows `[x0, M x (width-1)]`,
    what a draft run at T = width drafts: the block's attention is bidirectional, so these are
    not the T-row block's first drafts, but they are accepted as often (demo pair, GSM8K: P(first
    draft accepted) 0.683 from one row, 0.658 from seven; docs/profile.md) and the rows left
    out cost a pass through the draft's layers each."""
    cfg = draft.cfg
    num_tokens = num_tokens if width is None else width
    ids_BT = block_input_ids(anchor_B, num_tokens, cfg.mask_token_id)
    pos_BT = anchor_pos_B[:, None] + jnp.arange(num_tokens)[None]
    dtype = embed_VD.dtype

    def attend(layer: int, attn, a_BTD):
        # the block's latent rows go into the draft's pool rows at p..p+T-1 (they sit at future
        # positions; draft_context overwrites them after verification), then every row attends
        # to the context before p and the whole block
        nonlocal pool
        row = first_row + layer
        pool = pool.write(row, pos_BT, attn.latent_kv(a_BTD, pos_BT),
                          None if active_B is None else jnp.broadcast_to(active_B[:, None], pos_BT.shape))
        return attn.attend_paged(a_BTD, pos_BT, pool, row, causal=False)

    h_BTD = draft.block_hidden_with(jnp.take(embed_VD, ids_BT, axis=0).astype(dtype), attend)
    base_BTV = draft.base_logits(h_BTD, lm_head_VD)
    tokens, logits = markov_draft(draft, base_BTV, anchor_B, sampling, key)
    # over target ids: a reduced draft vocabulary gives zero probability outside the kept set, so
    # rejection sampling's residual max(p - q, 0) is p there and verification stays lossless
    logits = draft.gather_to_target(logits)
    conf = None
    if cfg.enable_confidence_head:
        prev = jnp.concatenate([anchor_B[:, None], tokens[:, :-1]], 1)
        conf = draft.confidence(h_BTD, prev)
    return DraftProposal(tokens, logits, conf, pool)


# ---------------------------------------------------------------------------------------------
# verification


class Acceptance(NamedTuple):
    num_accepted_B: jax.Array    # n in 0..T: accepted drafts
    emitted_BT1: jax.Array       # tokens to emit: first n+1 entries are valid


def accept_greedy(target_logits_BT1V: jax.Array, drafts_BT: jax.Array,
                  limit_B: jax.Array | None = None) -> Acceptance:
    """Target argmax per row; accept the drafts that equal it, up to the first mismatch (ATOM's
    rejection sampler at temperature 0). `limit_B` caps n (room left before max length)."""
    t_BT1 = argmax(target_logits_BT1V).astype(drafts_BT.dtype)
    n = _leading_true(drafts_BT == t_BT1[:, :-1])
    if limit_B is not None:
        n = jnp.minimum(n, limit_B)
    return Acceptance(n, t_BT1)


def _leading_true(match_BT: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(match_BT.astype(jnp.int32), axis=1), axis=1)


def accept_sampling(target_logits_BT1V: jax.Array, draft_logits_BTV: jax.Array, drafts_BT: jax.Array,
                    sampling: SamplingParams, key: jax.Array, limit_B: jax.Array | None = None) -> Acceptance:
    """Lossless speculative sampling: accept d_k with prob min(1, p(d_k)/q(d_k)); at the first
    rejection emit a sample of the residual norm(max(p - q, 0)); if all accepted, a bonus sample
    from p at the last row. p, q are the target's and the draft's (Markov-biased) distributions
    after the same temperature/top-p; q may be zero (-inf logits) outside a reduced draft
    vocabulary (drafts never fall there). `limit_B` caps the drafts each row verifies (room left,
    or the confidence schedule): a cut made without looking at the target keeps this lossless.
    `sampling`: numbers, or per-row arrays [B]; rows at temperature 0 are verified
    greedily (`accept_greedy`), so one program serves a batch of mixed settings."""
    b, t = drafts_BT.shape
    logp = filter_logits(target_logits_BT1V, sampling)       # [B,T+1,V]
    logq = filter_logits(draft_logits_BTV, sampling)          # [B,T,V]
    k_u, k_res = jax.random.split(key)
    p_d = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts_BT[..., None], -1)[..., 0])
    q_d = jnp.exp(jnp.take_along_axis(logq, drafts_BT[..., None], -1)[..., 0])
    u = jax.random.uniform(k_u, (b, t))
    ok = u * q_d < p_d                                   # u < p/q without dividing by 0
    n = _leading_true(ok)
    # every draft verified was accepted: the next token is a bonus sample from p, whether the
    # row ran out of drafts (n = T) or was cut at its limit (the drafts past it were never tested)
    bonus = n == t
    if limit_B is not None:
        bonus = bonus | (n >= limit_B)
        n = jnp.minimum(n, limit_B)
    p = jnp.exp(logp)
    q = jnp.concatenate([jnp.exp(logq), jnp.zeros_like(p[:, :1])], 1)
    resid = jnp.maximum(p - q, 0.0)
    resid_n = jnp.take_along_axis(resid, n[:, None, None], 1)[:, 0]    # [B,V]
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
    # degenerate residual (p == q exactly) -> fall back to p
    resid_n = jnp.where(bonus[:, None] | (resid_n.sum(-1, keepdims=True) <= 0), p_n, resid_n)
    fix = jax.random.categorical(k_res, jnp.log(resid_n), axis=-1).astype(drafts_BT.dtype)
    emitted = jnp.concatenate([drafts_BT, jnp.zeros_like(drafts_BT[:, :1])], 1)
    emitted = emitted.at[jnp.arange(b), n].set(fix)
    if isinstance(sampling.temperature, (int, float)):
        return Acceptance(n, emitted)
    greedy = accept_greedy(target_logits_BT1V, drafts_BT, limit_B)
    drawn_B = jnp.asarray(sampling.temperature) > 0
    return Acceptance(jnp.where(drawn_B, n, greedy.num_accepted_B),
                      jnp.where(drawn_B[:, None], emitted, greedy.emitted_BT1))
