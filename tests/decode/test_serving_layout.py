"""The engine's serving layout (fused [in, out] projections, `LlamaModel.serving_weights`) and the
prefill's last-row-only logits change no greedy output: every program (prefill, one-token step,
verify, the draft's block pass that follows) gives the tokens the declared-layout engine and the
target's own cacheless greedy decoding give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.scheduler import Request, Scheduler
from tests.gen_utils import prompts, tiny_draft, tiny_llama


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, 1)


def _run(engine, ps, max_new_tokens=16, max_len=96):
    scheduler = Scheduler(engine, SchedulerConfig(len(ps), max_len))
    reqs = scheduler.run([Request(list(p), max_new_tokens, index=i) for i, p in enumerate(ps)])
    return [r.tokens for r in reqs]


def _greedy_reference(target, prompt, n):
    """The target's own greedy continuation, cacheless: one compiled forward at the final width
    (a causal model's rows before the right padding cannot see it), not an eager forward whose
    every op compiles again at each new length (minutes on CPU)."""
    width = len(prompt) + n
    logits_fn = jax.jit(lambda ids_BS: target.forward(ids_BS).logits)
    toks = list(prompt)
    for _ in range(n):
        ids = jnp.asarray([toks + [0] * (width - len(toks))], jnp.int32)
        toks.append(int(jnp.argmax(logits_fn(ids)[0, len(toks) - 1])))
    return toks[len(prompt):]


@pytest.mark.parametrize("t", [0, 7])
def test_serving_layout_greedy_equal(pair, t):
    target, draft = pair
    cfg = EngineConfig(num_speculative_tokens=t, page_size=8)
    d = draft if t else None
    fast = Engine(target, d, cfg, serving_layout=True)
    slow = Engine(target, d, cfg, serving_layout=False)
    assert fast.serving is not None and slow.serving is None
    ps = prompts(6, target.cfg.vocab_size, seed=3)
    out_fast, out_slow = _run(fast, ps), _run(slow, ps)
    assert out_fast == out_slow
    for p, o in zip(ps[:2], out_fast[:2]):
        assert o == _greedy_reference(target, p, len(o))


def test_serving_layout_step_logits_close(pair):
    """The verify program's logits with and without the serving layout (same math, other GEMMs)."""
    target, draft = pair
    cfg = EngineConfig(num_speculative_tokens=7, page_size=8)
    b, ctx, max_len = 2, 20, 64
    x0, lens = jnp.ones((b,), jnp.int32), jnp.full((b,), ctx, jnp.int32)
    drafts = jnp.arange(1, 8, dtype=jnp.int32)[None].repeat(b, 0)
    outs = []
    for flag in (True, False):
        eng = Engine(target, draft, cfg, serving_layout=flag)
        caches = eng.new_caches(b, max_len)
        tokens = jnp.asarray(np.arange(1, ctx + 1) % 90 + 1, jnp.int32)[None].repeat(b, 0)
        _, caches = eng.prefill(tokens, lens, jnp.arange(b), caches, jax.random.PRNGKey(0))
        n, emitted, _ = eng.step(x0, lens, jnp.ones((b,), bool), jnp.int32(max_len), caches,
                                 jax.random.PRNGKey(0), drafts_BT=drafts)
        outs.append((np.asarray(n), np.asarray(emitted)))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_serving_weights_layout(pair):
    target, _ = pair
    w = target.serving_weights()
    a, m = target.model.layers[0].self_attn, target.model.layers[0].mlp
    np.testing.assert_array_equal(np.asarray(w["layers"][0]["qkv"]).T[:a.q_proj.weight.get_value().shape[0]],
                                  np.asarray(a.q_proj.weight.get_value()))
    np.testing.assert_array_equal(np.asarray(w["layers"][0]["down"]).T, np.asarray(m.down_proj.weight.get_value()))
    np.testing.assert_array_equal(np.asarray(w["head"]).T, np.asarray(target.model.embed_tokens.weight.get_value()))


def test_prefill_logits_rows_equal_full(pair):
    """The prefill computes the lm_head on the last prompt row only: same first token as the full
    logits' row, for the declared and the serving layout."""
    target, draft = pair
    cfg = EngineConfig(num_speculative_tokens=7, page_size=8)
    ps = prompts(4, target.cfg.vocab_size, seed=5, hi=20)
    s = max(len(p) for p in ps)
    tokens = jnp.asarray([p + [0] * (s - len(p)) for p in ps], jnp.int32)
    lens = jnp.asarray([len(p) for p in ps], jnp.int32)
    want = [int(jnp.argmax(target.forward(jnp.asarray([p], jnp.int32)).logits[0, -1])) for p in ps]
    for flag in (False, True):
        eng = Engine(target, draft, cfg, serving_layout=flag)
        first, _ = eng.prefill(tokens, lens, jnp.arange(4), eng.new_caches(4, 64), jax.random.PRNGKey(0))
        assert [int(x) for x in first] == want
