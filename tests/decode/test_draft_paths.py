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

from dspark_jax.cache import PagedPool
from dspark_jax.decode import steps
from dspark_jax.decode.engine import cast_floating, embed_and_head
from dspark_jax.sampling import SamplingParams
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


def test_a_narrower_width_is_the_step_of_a_draft_run_at_that_t():
    """A step verifying `width` = w < T drafts runs the draft's block at w rows: it emits, accepts
    and writes what a step of an engine at T = w does, greedy and sampled (same key), and its
    block rows are not the T-row block's (the block's attention is bidirectional)."""
    from dspark_jax.decode.config import EngineConfig
    from dspark_jax.decode.engine import Engine

    target = tiny_llama(seed=3)
    draft = tiny_draft(target, seed=4, layer_ids=(0, 2))
    engines = {t: Engine(target, draft, EngineConfig(num_speculative_tokens=t)) for t in (1, 2, T)}
    b, s, max_len = 2, 11, 64
    ids_BS = np.random.default_rng(6).integers(0, target.cfg.vocab_size - 1, (b, s)).astype(np.int32)
    lens_B, active_B, key = np.full(b, s, np.int32), np.ones(b, bool), jax.random.PRNGKey(1)

    def prefilled(eng):
        caches = eng.new_caches(b, max_len)
        first, caches = eng.prefill(ids_BS, lens_B, np.arange(b, dtype=np.int32), caches, key)
        return np.asarray(first), caches

    x0_B, _ = prefilled(engines[T])
    for kw in ({}, {"sampling": SamplingParams(np.asarray([3.0, 8.0], np.float32), np.asarray([0.9, 1.0], np.float32))}):
        whole = engines[T].step(x0_B, lens_B, active_B, np.int32(max_len), prefilled(engines[T])[1], key, **kw)
        for w in (1, 2):
            part = engines[T].step(x0_B, lens_B, active_B, np.int32(max_len), prefilled(engines[T])[1], key,
                                   width=w, **kw)
            alone = engines[w].step(x0_B, lens_B, active_B, np.int32(max_len), prefilled(engines[w])[1], key, **kw)
            assert part[1].shape == alone[1].shape == (b, w + 1)
            for got, want in zip(jax.tree.leaves(part), jax.tree.leaves(alone)):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            # the draft's pool rows of the block differ from the T-row block's
            assert not np.array_equal(np.asarray(part[2].pool.pages), np.asarray(whole[2].pool.pages))
