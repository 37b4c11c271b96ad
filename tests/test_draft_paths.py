"""Training runs the same draft functions as serving.

The distillation loss builds its blocks, hidden states and draft logits through
`models.dspark.block_input_ids`, `K3DSparkModel.block_hidden_with` and `K3DSparkModel.base_logits`,
the functions `steps.draft_block` uses on the paged pool. Here one anchor's block goes both ways on
the same inputs, in float64 (tests/float64.py), so the comparison is exact up to float64 rounding
of two attention layouts (multi-anchor block-sparse vs paged)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import steps
from dspark_jax.cache import PagedPool
from dspark_jax.engine import cast_floating, embed_and_head
from dspark_jax.train import loss as loss_lib
from tests.float64 import assert_close, x64
from tests.gen_utils import tiny_draft, tiny_llama

T = 4


def _as_float64(model):
    nnx.update(model, cast_floating(nnx.state(model), jnp.float64))
    return model


def test_training_block_equals_serving_block():
    with x64():
        target = _as_float64(tiny_llama(seed=3))
        draft = _as_float64(tiny_draft(target, seed=4, layer_ids=(0, 2)))
        s, anchor = 14, 9
        ids_BS = jnp.asarray(np.random.default_rng(5).integers(0, target.cfg.vocab_size - 1, (1, s)), jnp.int32)
        out = target.forward(ids_BS, draft.cfg.target_layer_ids)
        embed, head = embed_and_head(target)

        # training: one kept anchor, teacher-forced Markov previous tokens
        anchors = loss_lib.Anchors(jnp.asarray([[anchor]], jnp.int32), jnp.asarray([[True]]))
        cfg = loss_lib.LossConfig(block_size=T, num_anchors=1)
        blocks = loss_lib.make_blocks(ids_BS, jnp.ones((1, s), bool), anchors, cfg, draft.cfg.mask_token_id)
        positions_BS = jnp.arange(s, dtype=jnp.int32)[None]
        kv_LBSW = draft.context_rows(out.aux_hidden, positions_BS)
        embeds = jnp.take(embed, blocks.input_ids_BAT, axis=0)
        h_train = loss_lib.multi_anchor_hidden(draft, embeds, blocks.positions_BAT, kv_LBSW, anchors)[:, 0]
        base_train = draft.base_logits(h_train, head)

        # serving: the context rows before the anchor in the pool, then the block pass
        rows = target.attention_rows
        pool = PagedPool.create(rows + draft.cfg.num_hidden_layers, 1, 32, 4, draft.cfg.kv_latent_dim,
                                jnp.float64)
        pool = steps.draft_context(draft, out.aux_hidden[:, :anchor], positions_BS[:, :anchor],
                                   jnp.ones((1, anchor), bool), pool, rows)
        prop = steps.draft_block(draft, embed, head, ids_BS[:, anchor], jnp.asarray([anchor], jnp.int32), pool,
                                 rows, T)

        assert blocks.input_ids_BAT[0, 0, 0] == ids_BS[0, anchor]
        assert np.all(np.asarray(blocks.input_ids_BAT[0, 0, 1:]) == draft.cfg.mask_token_id)
        # serving's logits are base + Markov bias of the drafted previous tokens: take the bias off
        prev = jnp.concatenate([ids_BS[:, anchor:anchor + 1], prop.tokens_BT[:, :-1]], axis=1)
        base_serve = prop.logits_BTV - draft.markov_bias(prev)
        assert base_serve.dtype == base_train.dtype == jnp.float64
        assert_close(np.asarray(base_train), np.asarray(base_serve), "draft base logits, training vs serving")
        # and the training logits with the same previous tokens equal the serving logits
        assert_close(np.asarray(base_train + draft.markov_bias(prev)), np.asarray(prop.logits_BTV),
                     "Markov-biased draft logits")


def test_draft_logit_precision_is_float32_for_a_bf16_draft():
    """A bf16 draft's logits come back in float32 (accumulated in float32) from the one function
    both paths call; nothing rounds them to bf16."""
    target = tiny_llama(seed=3)
    draft = tiny_draft(target, seed=4)
    nnx.update(draft, cast_floating(nnx.state(draft), jnp.bfloat16))
    h = jax.random.normal(jax.random.PRNGKey(0), (1, T, target.cfg.hidden_size), jnp.bfloat16)
    head = embed_and_head(target)[1].astype(jnp.bfloat16)
    got = draft.base_logits(h, head)
    assert got.dtype == jnp.float32
    want = np.asarray(h, np.float64) @ np.asarray(head, np.float64).T
    # float32 accumulation of exact bf16 products over 32 terms: far below one bf16 ulp (2^-8)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_narrower_draft_width_gives_the_whole_blocks_first_drafts():
    """`draft_block(width=w)` runs the lm_head and Markov head on the first w rows only: its drafts
    and pool are the whole block's first w, its logits and confidence equal up to float64
    rounding, greedy and sampled (same key)."""
    with x64():
        target = _as_float64(tiny_llama(seed=3))
        draft = _as_float64(tiny_draft(target, seed=4, layer_ids=(0, 2)))
        s = 11
        ids_BS = jnp.asarray(np.random.default_rng(6).integers(0, target.cfg.vocab_size - 1, (2, s)), jnp.int32)
        out = target.forward(ids_BS, draft.cfg.target_layer_ids)
        embed, head = embed_and_head(target)
        rows = target.attention_rows
        pool = PagedPool.create(rows + draft.cfg.num_hidden_layers, 2, 32, 4, draft.cfg.kv_latent_dim, jnp.float64)
        positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
        pool = steps.draft_context(draft, out.aux_hidden, positions_BS, jnp.ones((2, s), bool), pool, rows)
        anchor_B, pos_B = ids_BS[:, -1], jnp.asarray([s - 1, s - 1], jnp.int32)
        for kw in ({}, {"temperature": jnp.asarray([3.0, 8.0]), "top_p": jnp.asarray([0.9, 1.0]),
                        "key": jax.random.PRNGKey(1)}):
            whole = steps.draft_block(draft, embed, head, anchor_B, pos_B, pool, rows, T, **kw)
            for width in (1, 2, T):
                part = steps.draft_block(draft, embed, head, anchor_B, pos_B, pool, rows, T, width=width, **kw)
                assert part.tokens_BT.shape == (2, width)
                np.testing.assert_array_equal(np.asarray(part.tokens_BT), np.asarray(whole.tokens_BT[:, :width]))
                # the same rows in a product of another shape: equal up to float64 rounding
                assert_close(np.asarray(part.logits_BTV), np.asarray(whole.logits_BTV[:, :width]), "draft logits")
                assert_close(np.asarray(part.confidence_BT), np.asarray(whole.confidence_BT[:, :width]),
                             "confidence")
                np.testing.assert_array_equal(np.asarray(part.pool.pages), np.asarray(whole.pool.pages))
