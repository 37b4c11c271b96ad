"""Speculative generation: losslessness, statistics, sampling, KDA rollback."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.cache import as_values
from dspark_jax.decode import steps
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.generate import engine_for, generate
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.errors import RequestError
from dspark_jax.sampling import SamplingParams
from tests.gen_utils import chi2_pvalue, prompts, same_tokens, tiny_draft, tiny_k3, tiny_llama


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, 1)


@pytest.fixture(scope="module")
def k3_pair():
    target = tiny_k3(0)
    return target, tiny_draft(target, 1, layer_ids=(1, 3))


@pytest.mark.parametrize("batch", [1, 4])
def test_lossless_greedy_llama(llama_pair, batch):
    target, draft = llama_pair
    ps = prompts(16, target.cfg.vocab_size, seed=batch)
    for i in range(0, 16, batch):
        chunk = ps[i:i + batch]
        plain = generate(target, None, chunk, max_new_tokens=24)
        spec = generate(target, draft, chunk, max_new_tokens=24, num_speculative_tokens=7)
        same_tokens(plain, spec)
        assert all(len(o.token_ids) == 24 for o in spec.outputs)


@pytest.mark.parametrize("batch", [1, 4])
def test_lossless_greedy_k3(k3_pair, batch):
    target, draft = k3_pair
    # prompt lengths 2..15: one prefill bucket, so the cost is steps, not compiles; half as many
    # prompts as the llama test's (a K3 step costs more), the batch sizes the same
    ps = prompts(8, target.cfg.vocab_size, seed=10 + batch, hi=16)
    for i in range(0, 8, batch):
        chunk = ps[i:i + batch]
        plain = generate(target, None, chunk, max_new_tokens=12)
        spec = generate(target, draft, chunk, max_new_tokens=12, num_speculative_tokens=5)
        same_tokens(plain, spec)


@pytest.mark.parametrize("pair", ["llama_pair", "k3_pair"])
def test_lossless_greedy_fp8_cache(request, pair):
    target, draft = request.getfixturevalue(pair)
    ps = prompts(4, target.cfg.vocab_size, seed=7)
    plain = generate(target, None, ps, max_new_tokens=16, kv_cache_dtype="fp8")
    spec = generate(target, draft, ps, max_new_tokens=16, num_speculative_tokens=7, kv_cache_dtype="fp8")
    same_tokens(plain, spec)
    # fp8 storage really changes the numbers (otherwise this test would prove nothing): the cached
    # rows differ from the full-precision ones in both families, and in K3's the greedy tokens too
    full_rows, fp8_rows = (_cached_rows(target, ps, kv) for kv in ("auto", "fp8"))
    assert fp8_rows.shape == full_rows.shape and np.any(full_rows != 0)
    assert not np.array_equal(fp8_rows, full_rows)
    if target.cfg.family == "kimi_linear":
        full = generate(target, None, ps, max_new_tokens=16)
        assert any(a.token_ids != b.token_ids for a, b in zip(full.outputs, plain.outputs))


def _cached_rows(target, ps, kv_cache_dtype: str) -> np.ndarray:
    """The paged pool's rows, as float32 values, after plain greedy decoding of `ps` (on the
    engine, and so the compiled programs, generate() used for the same setting)."""
    engine = engine_for(target, None, EngineConfig(num_speculative_tokens=0, kv_cache_dtype=kv_cache_dtype))
    scheduler = Scheduler(engine, SchedulerConfig(len(ps), 128))
    scheduler.run([Request(p, 16) for p in ps])
    return np.asarray(as_values(scheduler.caches.pool.pages).astype(jnp.float32))


def _oracle(reference):
    """A proposer that drafts the target's own greedy continuation."""
    def propose(i, so_far, t):
        ref = reference[i]
        start = len(so_far)
        out = ref[start:start + t]
        return out + [0] * (t - len(out))
    return propose


def test_oracle_proposer_gives_eight_tokens_per_forward(llama_pair):
    target, _ = llama_pair
    ps = prompts(3, target.cfg.vocab_size, seed=3)
    ref = generate(target, None, ps, max_new_tokens=60)
    want = [o.token_ids for o in ref.outputs]
    # 1 token from prefill + 7 steps x 8 tokens = 57 tokens: every step accepts all 7 drafts
    spec = generate(target, None, ps, max_new_tokens=57, num_speculative_tokens=7, proposer=_oracle(want))
    for o, w in zip(spec.outputs, want):
        assert o.token_ids == w[:57]
    assert spec.stats["average_tokens_per_forward"] == 8.0
    assert spec.stats["distribution"]["7"] == 3 * 7 and spec.stats["acceptance_rate"] == 1.0


def test_stats_equal_hand_count(llama_pair):
    target, _ = llama_pair
    ps = prompts(2, target.cfg.vocab_size, seed=4)
    ref = [o.token_ids for o in generate(target, None, ps, max_new_tokens=40).outputs]
    pattern = [3, 0, 7, 1, 5, 2]          # drafts correct before the deliberate mistake
    calls = {0: 0, 1: 0}

    def propose(i, so_far, t):
        k = pattern[calls[i] % len(pattern)]
        calls[i] += 1
        good = ref[i][len(so_far):len(so_far) + t]
        out = list(good) + [0] * (t - len(good))
        if k < t:
            out[k] = (out[k] + 1) % target.cfg.vocab_size       # wrong from position k on
        return out

    spec = generate(target, None, ps, max_new_tokens=36, num_speculative_tokens=7, proposer=propose)
    for o, w in zip(spec.outputs, ref):
        assert o.token_ids == w[:36]
    # hand count: replay the pattern until 36 tokens are produced (1 from prefill)
    dist = [0] * 8
    for i in range(2):
        produced, step = 1, 0
        while produced < 36:
            n = pattern[step % len(pattern)]
            dist[n] += 1
            produced += n + 1
            step += 1
        st = spec.outputs[i].stats
        assert st["distribution"] == {str(k): c for k, c in enumerate(dist)}, (i, st["distribution"], dist)
        dist = [0] * 8
    agg = spec.stats
    steps_n = sum(agg["distribution"].values())
    assert agg["average_tokens_per_forward"] == pytest.approx(1 + agg["total_accepted_tokens"] / steps_n)
    assert agg["total_draft_tokens"] == 7 * steps_n


def test_kda_rollback_forced_rejection(k3_pair):
    """Every draft wrong: each step keeps snapshot 0 of the verify pass. All KDA states and the
    MLA pool rows that plain decoding reads must equal plain decoding's."""
    target, _ = k3_pair
    ps = prompts(2, target.cfg.vocab_size, seed=5)
    ref = [o.token_ids for o in generate(target, None, ps, max_new_tokens=12).outputs]
    v = target.cfg.vocab_size

    def wrong(i, so_far, t):
        good = ref[i][len(so_far):len(so_far) + t]
        return [(x + 1) % v for x in good] + [0] * (t - len(good))

    eng_plain, eng_spec = _plain_and_verify_engines(target)
    max_len = 128
    out_p, caches_p = _run(eng_plain, ps, 12, max_len)
    out_s, caches_s = _run(eng_spec, ps, 12, max_len, proposer=wrong)
    assert out_p == out_s == ref
    _assert_same_states(caches_p, caches_s)


def _plain_and_verify_engines(target):
    """Plain decoding, and verification of given drafts at T = 5: generate()'s engines for these
    settings (the plain one decoded the references), so both tests share their compiled programs."""
    return (engine_for(target, None, EngineConfig(num_speculative_tokens=0)),
            engine_for(target, None, EngineConfig(num_speculative_tokens=5)))


def _run(engine, prompts, max_new_tokens, max_len, proposer=None):
    """Every prompt in one batch; the outputs and the final caches."""
    scheduler = Scheduler(engine, SchedulerConfig(len(prompts), max_len), proposer=proposer)
    reqs = scheduler.run([Request(list(p), max_new_tokens, index=i) for i, p in enumerate(prompts)])
    return [r.tokens for r in reqs], scheduler.caches


def _assert_same_states(cp, cs):
    # Not bitwise: XLA rounds the [B,T+1,D] projections of a verify step differently from the
    # [B,1,D] ones of plain decoding (~1e-6). A wrong snapshot choice (one token off) moves the
    # states by O(0.1), far outside this tolerance.
    np.testing.assert_allclose(np.asarray(cs.kda.ssm), np.asarray(cp.kda.ssm), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cs.kda.conv), np.asarray(cp.kda.conv), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(cs.kda.ssm)).max() > 1e-2          # the states are not trivially zero


def test_kda_partial_acceptance_states(k3_pair):
    """Drafts right for the first k tokens (k varying per step): states equal plain decoding."""
    target, _ = k3_pair
    ps = prompts(2, target.cfg.vocab_size, seed=6)
    ref = [o.token_ids for o in generate(target, None, ps, max_new_tokens=30).outputs]
    v = target.cfg.vocab_size
    calls = {0: 0, 1: 0}

    def partial(i, so_far, t):
        k = (calls[i] * 2 + i) % (t + 1)
        calls[i] += 1
        good = ref[i][len(so_far):len(so_far) + t]
        out = list(good) + [0] * (t - len(good))
        if k < t:
            out[k] = (out[k] + 1) % v
        return out

    eng_plain, eng_spec = _plain_and_verify_engines(target)
    out_p, caches_p = _run(eng_plain, ps, 25, 128)
    out_s, caches_s = _run(eng_spec, ps, 25, 128, proposer=partial)
    assert out_p == out_s
    # the spec run produced the same tokens in fewer steps; the states after them must agree
    _assert_same_states(caches_p, caches_s)


# ------------------------------------------------------------------------------------------------
# sampling


def test_accept_sampling_marginals_are_the_targets():
    """Unit check of the rejection sampler with fixed per-position p and q: the token emitted at
    each position is distributed as p (chi-square goodness of fit, N=40000, alpha=1e-3); the same
    samples are far from q (shows the test has power)."""
    v, t, n = 6, 3, 40000
    rng = np.random.default_rng(0)
    tl = jnp.asarray(rng.normal(size=(t + 1, v)) * 1.5, jnp.float32)
    dl = jnp.asarray(rng.normal(size=(t, v)) * 1.5, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, dl, axis=-1)
        acc = steps.accept_sampling(tl[None], dl[None], drafts[None], SamplingParams(1.0, 1.0), ka)
        return acc.num_accepted_B[0], acc.emitted_BT1[0]

    nacc, emitted = jax.jit(jax.vmap(one))(keys)
    nacc, emitted = np.asarray(nacc), np.asarray(emitted)
    p = np.asarray(jax.nn.softmax(tl, -1))
    q = np.asarray(jax.nn.softmax(dl, -1))
    for pos in range(t + 1):
        got = emitted[nacc >= pos][:, pos]
        counts = np.bincount(got, minlength=v)
        assert chi2_pvalue(counts, p[pos]) > 1e-3, pos
        if pos < t:
            assert chi2_pvalue(counts, q[pos]) < 1e-6


def _exact_two_token_marginal(target, prompt):
    """P(2nd generated token = v) under the target's own sampling, by enumeration."""
    v = target.cfg.vocab_size
    ids = jnp.asarray([prompt])
    p1 = np.asarray(jax.nn.softmax(target.forward(ids).logits[0, -1]))
    batch = jnp.asarray([prompt + [t] for t in range(v)])
    p2 = np.asarray(jax.nn.softmax(target.forward(batch).logits[:, -1], -1))
    return p1, p1 @ p2


def test_per_row_sampling_settings_give_each_row_its_own_distribution():
    """One rejection-sampling call over rows of different settings (greedy, temperature 0.7,
    temperature 1.3 with top_p 0.8, top_p 0.5): the greedy row is exactly greedy verification,
    and each other row's emitted tokens follow its own filtered target distribution (chi-square,
    N=40000, alpha=1e-3), with drafts drawn from its own filtered draft distribution."""
    from dspark_jax.sampling import SamplingParams, filter_logits, sample_tokens
    v, t, n = 6, 3, 40000
    temps = jnp.asarray([0.0, 0.7, 1.3, 1.0], jnp.float32)
    tops = jnp.asarray([1.0, 1.0, 0.8, 0.5], jnp.float32)
    rows = SamplingParams(temps, tops)
    rng = np.random.default_rng(1)
    tl = jnp.asarray(rng.normal(size=(4, t + 1, v)) * 1.5, jnp.float32)
    dl = jnp.asarray(rng.normal(size=(4, t, v)) * 1.5, jnp.float32)
    # per row, the filtered distributions are the ones a call with that row's numbers gives
    for i in range(1, 4):
        one = filter_logits(tl[i:i + 1], SamplingParams(float(temps[i]), float(tops[i])))
        np.testing.assert_allclose(np.asarray(filter_logits(tl, rows)[i:i + 1]), np.asarray(one),
                                   rtol=2**-13, atol=2**-13)
    logq = filter_logits(dl, rows)
    keys = jax.random.split(jax.random.PRNGKey(0), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, logq, axis=-1)
        acc = steps.accept_sampling(tl, dl, drafts, rows, ka)
        return acc.num_accepted_B, acc.emitted_BT1, drafts

    nacc, emitted, drafts = (np.asarray(x) for x in jax.jit(jax.vmap(one))(keys))
    greedy = jax.vmap(lambda d: steps.accept_greedy(tl[:1], d[None]))(jnp.asarray(drafts[:, 0]))
    np.testing.assert_array_equal(nacc[:, 0], np.asarray(greedy.num_accepted_B)[:, 0])
    np.testing.assert_array_equal(emitted[:, 0], np.asarray(greedy.emitted_BT1)[:, 0])
    p = np.exp(np.asarray(filter_logits(tl, rows), np.float64))
    tested = 0
    for i in range(1, 4):
        for pos in range(t + 1):
            counts = np.bincount(emitted[nacc[:, i] >= pos][:, i, pos], minlength=v)
            kept = p[i, pos] > 0                # a top-p row never emits a token outside its nucleus
            assert not counts[~kept].any(), (i, pos)
            if kept.sum() > 1 and counts.sum() >= 1000:
                assert chi2_pvalue(counts[kept], p[i, pos][kept] / p[i, pos][kept].sum()) > 1e-3, (i, pos)
                tested += 1
    assert tested >= 8
    assert not (p[2:] > 0).all() and (p[1] > 0).all()      # the nuclei cut something; top_p 1 keeps all
    # and a greedy row among sampled ones takes the argmax
    drawn = jax.vmap(lambda k: sample_tokens(tl[:, 0], rows, k))(keys[:64])
    assert (np.asarray(drawn)[:, 0] == int(jnp.argmax(tl[0, 0]))).all()


def test_speculative_sampling_matches_target_distribution():
    """End to end on a vocab-12 model: 2000 sampled continuations (temperature 1) with the draft;
    the 2nd token (the first one produced by a speculative step) must follow the target's exact
    marginal (chi-square, alpha=1e-3)."""
    target = tiny_llama(3, vocab=12)
    draft = tiny_draft(target, 4)
    prompt = [1, 5, 7, 2]
    p1, p2 = _exact_two_token_marginal(target, prompt)
    n = 2000
    res = generate(target, draft, [prompt] * n, max_new_tokens=3, temperature=1.0,
                   num_speculative_tokens=3, seed=11)
    first = np.array([o.token_ids[0] for o in res.outputs])
    second = np.array([o.token_ids[1] for o in res.outputs])
    assert chi2_pvalue(np.bincount(first, minlength=12), p1) > 1e-3
    assert chi2_pvalue(np.bincount(second, minlength=12), p2) > 1e-3
    assert res.stats["total_accepted_tokens"] > 0          # the draft's tokens were actually used


# ------------------------------------------------------------------------------------------------
# requests and stops


def test_max_num_seqs_decodes_a_few_at_a_time_with_the_same_tokens(llama_pair, monkeypatch):
    """`max_num_seqs`: a cache of that many slots, the prompts after the first ones taking a slot
    as a sequence finishes (speculative rows finish apart: their slots refill one by one)."""
    gen = importlib.import_module("dspark_jax.decode.generate")      # the module (the package exports the function)
    target, draft = llama_pair
    ps = prompts(5, target.cfg.vocab_size, seed=11)
    slots = []

    class Recorded(gen.Scheduler):
        def __init__(self, engine, config, *a, **kw):
            slots.append(config.max_num_seqs)
            super().__init__(engine, config, *a, **kw)

    monkeypatch.setattr(gen, "Scheduler", Recorded)
    whole = generate(target, None, ps, max_new_tokens=20)
    spec = generate(target, draft, ps, max_new_tokens=20, max_num_seqs=2)
    plain = generate(target, None, ps, max_new_tokens=20, max_num_seqs=3)
    assert slots == [5, 2, 3]
    same_tokens(whole, spec)
    same_tokens(whole, plain)
    assert generate(target, None, ps[:1], max_new_tokens=4, max_num_seqs=8).outputs[0].token_ids == \
        whole.outputs[0].token_ids[:4] and slots[-1] == 1
    with pytest.raises(RequestError, match="max_num_seqs"):
        generate(target, draft, ps, max_num_seqs=0)


def test_bad_requests_name_the_field(llama_pair):
    target, draft = llama_pair
    with pytest.raises(RequestError, match="max_new_tokens"):
        generate(target, draft, [[1, 2]], max_new_tokens=0)
    with pytest.raises(RequestError, match="top_p"):
        generate(target, draft, [[1, 2]], top_p=0.0)
    with pytest.raises(RequestError, match=r"prompts\[1\]"):
        generate(target, draft, [[1, 2], [1] * 600], max_model_len=512)
    with pytest.raises(RequestError, match="tokenizer"):
        generate(target, draft, ["hello"])


def test_max_model_len_stops_cleanly(llama_pair):
    target, draft = llama_pair
    p = prompts(1, target.cfg.vocab_size, seed=9, lo=100, hi=101)
    plain = generate(target, None, p, max_new_tokens=400, max_model_len=128)
    spec = generate(target, draft, p, max_new_tokens=400, max_model_len=128)
    assert plain.outputs[0].finish_reason == spec.outputs[0].finish_reason == "length"
    assert plain.outputs[0].token_ids == spec.outputs[0].token_ids
    assert len(p[0]) + len(plain.outputs[0].token_ids) <= 128 + 1


# ------------------------------------------------------------------------------------------------
# the speculation length chosen per step (dspark_jax/decode/spec_length.py, docs/profile.md)


def test_accept_sampling_with_a_limit_emits_the_targets_marginals():
    """Rows cut to one verified draft (limit 1): the token after an accepted draft is a bonus sample
    from p at that row, not a residual sample (chi-square, N=40000, alpha=1e-3)."""
    v, t, n = 6, 3, 40000
    rng = np.random.default_rng(1)
    tl = jnp.asarray(rng.normal(size=(t + 1, v)) * 1.5, jnp.float32)
    dl = jnp.asarray(rng.normal(size=(t, v)) * 1.5, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, dl, axis=-1)
        acc = steps.accept_sampling(tl[None], dl[None], drafts[None], SamplingParams(1.0, 1.0), ka, limit_B=jnp.ones((1,), jnp.int32))
        return acc.num_accepted_B[0], acc.emitted_BT1[0]

    nacc, emitted = jax.jit(jax.vmap(one))(keys)
    nacc, emitted = np.asarray(nacc), np.asarray(emitted)
    assert nacc.max() == 1
    p = np.asarray(jax.nn.softmax(tl, -1))
    for pos in range(2):
        counts = np.bincount(emitted[nacc >= pos][:, pos], minlength=v)
        assert chi2_pvalue(counts, p[pos]) > 1e-3, pos


@pytest.mark.parametrize("family", ["llama", "k3"])
def test_adaptive_length_varies_with_the_batch_and_stays_lossless(request, family):
    """A cost model where a wide verify is dear at 4 rows and free at 1 (a compute-bound CPU):
    alone a sequence verifies all T drafts, in a batch of 4 fewer (down to one-token steps), and
    every output equals plain greedy decoding."""
    from dspark_jax.decode.spec_length import StepCosts
    target, draft = request.getfixturevalue(f"{family}_pair")
    costs = StepCosts.of(lambda rows, n: 1.0 + (0.0 if rows == 1 else 0.5 * n))
    ps = prompts(4, target.cfg.vocab_size, seed=21, hi=16)
    plain = generate(target, None, ps, max_new_tokens=12)
    batch = generate(target, draft, ps, max_new_tokens=12, num_speculative_tokens=5, step_costs=costs)
    alone = [generate(target, draft, [p], max_new_tokens=12, num_speculative_tokens=5, step_costs=costs)
             for p in ps[:2]]
    same_tokens(plain, batch)
    assert [a.outputs[0].token_ids for a in alone] == [o.token_ids for o in plain.outputs[:2]]
    used_batch = {int(k) for k, c in batch.stats["verify_length_counts"].items() if c}
    used_alone = {int(k) for a in alone for k, c in a.stats["verify_length_counts"].items() if c}
    assert used_alone == {5} and min(used_batch) < 5
    # the counts are per sequence and step; one-token steps are the plain steps
    counts = batch.stats["verify_length_counts"]
    assert sum(counts.values()) == batch.stats["num_verify_steps"] + batch.stats["num_plain_steps"]
    assert counts["0"] == batch.stats["num_plain_steps"]
    fixed = generate(target, draft, ps, max_new_tokens=12, num_speculative_tokens=5, step_costs=costs,
                     speculative_length="fixed")
    assert fixed.stats["verify_length_counts"]["5"] == fixed.stats["num_verify_steps"] > 0
    same_tokens(plain, fixed)


def test_speculative_sampling_with_a_shorter_length_matches_target():
    """As the end-to-end sampling test, with every step verifying one of the T = 3 drafts (a cost
    model where longer verifies are dear): the draft block's logits cut to the verified drafts
    keep rejection sampling exact."""
    from dspark_jax.decode.spec_length import StepCosts
    target = tiny_llama(3, vocab=12)
    draft = tiny_draft(target, 4)
    prompt = [1, 5, 7, 2]
    p1, p2 = _exact_two_token_marginal(target, prompt)
    costs = StepCosts.of(lambda rows, n: 1.0 if n <= 1 else 100.0)
    res = generate(target, draft, [prompt] * 2000, max_new_tokens=3, temperature=1.0,
                   num_speculative_tokens=3, seed=12, step_costs=costs)
    second = np.array([o.token_ids[1] for o in res.outputs])
    assert chi2_pvalue(np.bincount(second, minlength=12), p2) > 1e-3
    st = res.stats
    assert st["verify_length_counts"]["1"] == st["num_verify_steps"] > 0 and st["num_plain_steps"] == 0
    assert st["total_accepted_tokens"] > 0


def test_engine_cache_keeps_the_last_targets_and_lets_older_ones_go(monkeypatch):
    """generate() reuses a target's compiled engine on the next call, and keeps the engines of the
    last MAX_CACHED_TARGETS targets only: an engine holds its target, so a target that has dropped
    out of the cache, and that nothing else holds, is freed with its engines."""
    import gc
    import importlib
    import weakref

    generate_lib = importlib.import_module("dspark_jax.decode.generate")
    monkeypatch.setattr(generate_lib, "MAX_CACHED_TARGETS", 1)
    monkeypatch.setattr(generate_lib, "_ENGINES", type(generate_lib._ENGINES)())
    first, second = tiny_llama(0), tiny_llama(1)
    p = prompts(1, first.cfg.vocab_size, seed=5)
    generate(first, None, p, max_new_tokens=2)
    engine = generate_lib.engine_for(first, None, EngineConfig(num_speculative_tokens=0))
    generate(first, None, p, max_new_tokens=2)
    assert generate_lib.engine_for(first, None, EngineConfig(num_speculative_tokens=0)) is engine
    gone = weakref.ref(first)
    del first, engine
    generate(second, None, p, max_new_tokens=2)
    gc.collect()
    assert gone() is None
    assert [t for t, _ in generate_lib._ENGINES.values()] == [second]
