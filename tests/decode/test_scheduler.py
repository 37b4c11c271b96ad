"""Continuous batching (`generate.Scheduler`): admitting a request prefills only its row and
leaves every other slot's caches untouched; inactive rows of a step keep their state; a slot's
new occupant starts from zero KDA state; staggered admissions, slot reuse, aborts and mixed
sampling settings all give each request exactly what it gets alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode.buckets import PREFILL_CALL_TOKENS, batch_bucket, prefill_bucket, prefill_groups
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.generate import engine_for
from dspark_jax.decode.requests import eos_ids
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.sampling import SamplingParams
from tests.float64 import assert_f32_close
from tests.gen_utils import prompts, tiny_draft, tiny_k3, tiny_llama

SLOTS, MAX_LEN, T = 3, 128, 4


def _pair_engines(target, draft):
    """Plain and speculative engines shared by a module's tests (one compilation each): generate()'s
    engines for these settings, so its calls here reuse their compiled programs."""
    return target, {0: engine_for(target, None, EngineConfig(num_speculative_tokens=0)),
                    T: engine_for(target, draft, EngineConfig(num_speculative_tokens=T))}


@pytest.fixture(scope="module")
def k3():
    target = tiny_k3(0)
    return _pair_engines(target, tiny_draft(target, 1, layer_ids=(1, 3)))


@pytest.fixture(scope="module")
def llama():
    target = tiny_llama(0)
    return _pair_engines(target, tiny_draft(target, 1))


def _eos(target) -> frozenset[int]:
    return frozenset(eos_ids(target, None))


def _solo(engine, prompt, n, eos) -> list[int]:
    """The request alone in a fresh scheduler."""
    return Scheduler(engine, SchedulerConfig(SLOTS, MAX_LEN)).run([Request(prompt, n, eos_ids=eos)])[0].tokens


def _pages_of(caches, slot):
    """Every pool row of one slot's pages, and its KDA states (numpy copies)."""
    pool = caches.pool
    pages = np.asarray(pool.pages)[:, np.asarray(pool.block_table)[slot]]
    kda = None if caches.kda is None else (np.asarray(caches.kda.conv[:, slot]), np.asarray(caches.kda.ssm[:, slot]))
    return pages, kda


def _assert_same(a, b):
    np.testing.assert_array_equal(a[0], b[0])      # bitwise: nothing may write into other slots
    if a[1] is not None:
        np.testing.assert_array_equal(a[1][0], b[1][0])
        np.testing.assert_array_equal(a[1][1], b[1][1])


def test_admission_and_inactive_rows_leave_other_slots_untouched(k3):
    target, engines = k3
    b = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN))
    ps = prompts(3, target.cfg.vocab_size, seed=21, lo=5, hi=14)
    r0 = Request(ps[0], 50)
    b.add(r0)
    b.step()                                       # prefill slot 0 + one step
    b.step()
    snap0, snap2 = _pages_of(b.caches, 0), _pages_of(b.caches, 2)
    assert np.abs(snap0[1][1]).max() > 1e-3        # slot 0 holds real state
    # admit into slot 1 only (its prefill), without a decode step in between
    r1 = Request(ps[1], 50)
    b.add(r1)
    b._admit()
    assert r1.slot == 1
    _assert_same(_pages_of(b.caches, 0), snap0)
    _assert_same(_pages_of(b.caches, 2), snap2)
    # a step in which slot 1 is inactive leaves it as it was
    snap1 = _pages_of(b.caches, 1)
    eng = engines[T]
    _, _, caches = eng.step(jnp.asarray(b.x0), jnp.asarray(b.lens), jnp.asarray([True, False, False]),
                            jnp.int32(MAX_LEN), b.caches, jax.random.PRNGKey(0))
    _assert_same(_pages_of(caches, 1), snap1)
    assert not np.array_equal(_pages_of(caches, 0)[1][1], snap0[1][1])     # while slot 0 moved on


def test_new_occupant_starts_from_zero_kda_state(k3):
    """A slot that held a long sequence, reused by a new request, gives exactly the tokens of a
    fresh scheduler (a stale KDA state, conv window or draft context row would change them)."""
    target, engines = k3
    ps = prompts(2, target.cfg.vocab_size, seed=22, lo=10, hi=14)
    fresh = _solo(engines[T], ps[1], 12, frozenset())
    b = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN))
    b.run([Request(ps[0], 30)])                    # leaves non-zero state in slot 0
    assert np.abs(np.asarray(b.caches.kda.ssm[:, 0])).max() > 1e-2
    again = b.run([Request(ps[1], 12)])
    assert again[0].tokens == fresh


@pytest.mark.parametrize("pair", ["llama", "k3"])
def test_staggered_admissions_equal_solo_greedy(request, pair):
    """7 requests through 3 slots, arriving while others decode, with slot reuse and one abort:
    every completed request equals plain greedy decoding of its prompt alone; the speculative
    path (the draft) is used throughout."""
    target, engines = request.getfixturevalue(pair)
    eos = _eos(target)
    ps = prompts(7, target.cfg.vocab_size, seed=23, lo=3, hi=14)
    budgets = [9, 25, 4, 17, 30, 12, 20]
    want = [_solo(engines[0], p, n, eos) for p, n in zip(ps, budgets)]
    b = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN))
    reqs = [Request(p, n, eos_ids=eos) for p, n in zip(ps, budgets)]
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5], 9: [6]}
    doomed = reqs[4]
    step = 0
    while step < 10 or b.has_work():
        for i in arrivals.get(step, []):
            b.add(reqs[i])
        if step == 7:
            b.abort(doomed)                        # its slot must come free for the others
        b.step()
        step += 1
        assert step < 500
    for i, r in enumerate(reqs):
        if r is doomed:
            assert r.finish_reason == "abort"
            continue
        assert r.tokens == want[i], i
        assert r.finish_reason == ("stop" if r.tokens[-1] in eos else "length")
    assert b.num_running == 0 and b.stats.to_dict()["num_verify_steps"] > 0


def test_mixed_sampling_settings_share_steps_and_keep_greedy_rows_exact(llama):
    """Greedy requests and requests at two sampling settings share every step (one program:
    settings are per row); the greedy ones still equal greedy decoding, the sampled ones produce
    their full budget."""
    target, engines = llama
    ps = prompts(4, target.cfg.vocab_size, seed=24, lo=3, hi=14)
    want = [_solo(engines[0], p, 16, frozenset()) for p in ps]
    b = Scheduler(engines[T], SchedulerConfig(4, MAX_LEN), seed=3)
    reqs = [Request(p, 16, SamplingParams(0.0 if i % 2 == 0 else 0.9, 0.8 if i == 3 else 1.0))
            for i, p in enumerate(ps)]
    b.run(reqs)
    # every step advances every running row by at least one token: 15 tokens after the first
    # (prefill's) take at most 15 steps when the rows step together, and about twice that if
    # each setting took turns
    assert b.num_steps <= 15
    for i, r in enumerate(reqs):
        assert len(r.tokens) == 16
        if i % 2 == 0:
            assert r.tokens == want[i]
    # the sampled rows really sampled (they differ from greedy somewhere)
    assert any(reqs[i].tokens != want[i] for i in (1, 3))


def test_step_keys_are_fresh_past_a_split_and_follow_the_seed(llama):
    """The scheduler splits its PRNG keys off in chunks: across more than one chunk every program
    call still gets a key of its own, and the stream is the seed's (the same again for the same
    seed, another for another seed)."""
    _, engines = llama

    def draw(seed, n):
        b = Scheduler(engines[T], SchedulerConfig(1, 64), seed=seed)
        return [tuple(int(x) for x in b._next_key()) for _ in range(n)]

    keys = draw(5, 150)
    assert len(set(keys)) == 150 and all(len(k) == 2 for k in keys)
    assert keys == draw(5, 150)
    assert not set(keys) & set(draw(6, 150))


def test_bad_request_rejected_at_add(llama):
    _, engines = llama
    b = Scheduler(engines[T], SchedulerConfig(2, 64))
    with pytest.raises(ValueError, match="max_model_len=64"):
        b.add(Request(list(range(1, 61)), 4))      # 60 + T + 1 > 64
    with pytest.raises(ValueError, match="max_new_tokens"):
        b.add(Request([1, 2], 0))
    assert not b.has_work()


@pytest.mark.parametrize("sharded", [False, True])
def test_caches_keep_their_placement_so_each_step_compiles_once(sharded):
    """The steps return the caches with `new_caches`' shardings: otherwise the second call (the
    first one fed a step's output) compiles every program again (seconds per program on CPU)."""
    from dspark_jax.sharding import make_mesh, shard_module

    target = tiny_k3(0)
    draft = tiny_draft(target, 1, layer_ids=(1, 3))
    if sharded:
        mesh = make_mesh(tensor=2, fsdp=2, data=2)
        target, draft = shard_module(target, mesh), shard_module(draft, mesh)
    eng = Engine(target, draft, EngineConfig(num_speculative_tokens=T))
    b = 2
    caches = eng.new_caches(b, 64)
    placement = [x.sharding for x in jax.tree.leaves(caches)]
    if sharded:   # KDA heads on the tensor axis, the pool replicated
        assert {str(s.spec) for s in placement} == {"P()", "P(None, None, None, 'tensor')",
                                                    "P(None, None, 'tensor')"}
    x0, lens = jnp.ones((b,), jnp.int32), jnp.full((b,), 5, jnp.int32)
    active, key = jnp.ones((b,), bool), jax.random.PRNGKey(0)
    for _ in range(3):
        *_, caches = eng.propose(x0, lens, caches, key)
        *_, caches = eng.step(x0, lens, active, jnp.int32(64), caches, key)
        assert [x.sharding for x in jax.tree.leaves(caches)] == placement
    assert len(eng.programs) == 2 and eng.programs.compiled() == 2      # one propose, one step: compiled once


def test_adaptive_length_follows_the_batch_keeps_output_and_draft_context(k3):
    """A cost model where any draft costs more than it returns at 2+ rows: steps over 2+
    sequences are one-token steps, a lone sequence verifies all T again. Every request still
    equals plain greedy decoding, and the draft's context rows written by the one-token steps
    equal those a fully speculative run writes (so speculation resumes on a complete draft cache)."""
    from dspark_jax.decode.spec_length import StepCosts
    target, engines = k3
    eos = _eos(target)
    dear = StepCosts.of(lambda rows, n: 1.0 if rows == 1 else 1.0 + n)
    ps = prompts(3, target.cfg.vocab_size, seed=24, lo=4, hi=12)
    budgets = [6, 14, 30]
    want = [_solo(engines[0], p, n, eos) for p, n in zip(ps, budgets)]
    b = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN, step_costs=dear))
    reqs = b.run([Request(p, n, eos_ids=eos) for p, n in zip(ps, budgets)])
    assert [r.tokens for r in reqs] == want
    stats = b.stats.to_dict()
    assert stats["num_plain_steps"] > 0 and stats["num_verify_steps"] > 0
    assert {k for k, c in stats["verify_length_counts"].items() if c} == {"0", str(T)}
    assert reqs[2].stats.plain_steps > 0 and reqs[2].stats.to_dict()["num_verify_steps"] > 0
    assert reqs[0].stats.to_dict()["num_verify_steps"] == 0      # it never ran alone

    # through generate(), whose engine (this module's engines[T]) is shared with calls of a fixed length
    from dspark_jax.decode.generate import generate
    assert engine_for(target, engines[T].draft, EngineConfig(num_speculative_tokens=T)) is engines[T]
    fixed = generate(target, engines[T].draft, ps, max_new_tokens=10, num_speculative_tokens=T,
                     speculative_length="fixed", step_costs=dear)
    adaptive = generate(target, engines[T].draft, ps, max_new_tokens=10, num_speculative_tokens=T, step_costs=dear)
    assert fixed.stats["num_plain_steps"] == 0 and adaptive.stats["num_plain_steps"] > 0
    assert [o.token_ids for o in adaptive.outputs] == [o.token_ids for o in fixed.outputs]

    # draft context rows: always one-token steps vs always speculative, the same sequence
    rows = slice(target.attention_rows, None)
    got = {}
    for name, costs in (("plain", StepCosts.of(lambda rows, n: 1.0 + n)), ("spec", StepCosts.constant())):
        bb = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN, step_costs=costs))
        r = bb.run([Request(ps[2], 20)])[0]
        n = len(ps[2]) + len(r.tokens) - 1           # positions written (the last token is not yet in)
        pages, _ = _pages_of(bb.caches, 0)
        got[name] = (r.tokens, pages[rows].reshape(pages.shape[0] - target.attention_rows, -1, pages.shape[-1])[:, :n])
        assert (bb.stats.plain_steps > 0) == (name == "plain")
    assert got["plain"][0] == got["spec"][0]
    assert_f32_close(got["plain"][1], got["spec"][1], "draft context rows: one-token vs speculative steps")


def test_a_step_computes_the_running_rows_padded_to_a_bucket(k3):
    """A request alone in a 4-slot scheduler runs batch-1 steps. With three greedy requests running
    (slots 0..2) and a fourth whose long prompt is part-way in (slot 3), a step is one batch-4
    call of slots 0..2 and a padding row, which writes nothing: slot 3's pages and KDA states stay
    bitwise as they were, and the greedy requests equal each one decoded alone."""
    target, engines = k3
    eng = engines[T]
    ps = prompts(3, target.cfg.vocab_size, seed=25, lo=4, hi=12)
    long_prompt = prompts(1, target.cfg.vocab_size, seed=26, lo=100, hi=101)[0]
    want = [_solo(engines[0], p, 12, frozenset()) for p in ps]
    calls = []
    step = eng.step

    def spy(x0_B, *a, **kw):
        calls.append((len(x0_B), tuple(int(r) for r in kw["rows_B"])))
        return step(x0_B, *a, **kw)

    eng.step = spy
    try:
        b = Scheduler(eng, SchedulerConfig(4, MAX_LEN, max_num_batched_tokens=64), seed=1)
        greedy = [Request(p, 12) for p in ps]
        b.add(greedy[0])
        b.step()
        b.step()
        assert calls == [(1, (0,))] * 2
        b.add(greedy[1])
        b.add(greedy[2])
        b._admit()                                   # both prompts in one call
        later = Request(long_prompt, 8)
        b.add(later)
        b._admit()                                   # its first 64 tokens: slot 3 now holds state
        assert [r.slot for r in greedy] == [0, 1, 2] and later.slot == 3 and later.prefilled == 64
        snap3 = _pages_of(b.caches, 3)
        assert np.asarray(snap3[0]).any() and np.abs(snap3[1][1]).max() > 0
        checked = 0
        while any(r.finish_reason is None for r in greedy):
            calls.clear()
            b._decode()
            _assert_same(_pages_of(b.caches, 3), snap3)
            checked += calls[0][1] == (0, 1, 2, 4)    # a padding row beside the three
            assert calls[0][0] in (1, 2, 4)
        assert checked > 0
        assert [r.tokens for r in greedy] == want
    finally:
        del eng.step


def test_prefill_groups_pad_less_than_one_call_and_cover_every_prompt():
    """`prefill_groups` splits whole prompts into calls that each pad to their longest prompt's
    bucket and to a batch bucket: every prompt in exactly one call, longest first, and never more
    padded tokens (plus the per-call charge) than one call over all of them."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        slots = int(rng.choice([1, 3, 8, 16]))
        lengths = [int(x) for x in rng.integers(1, 600, rng.integers(1, slots + 1))]
        groups = prefill_groups(lengths, slots)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(lengths)))
        assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)

        def cost(gs):
            return sum(batch_bucket(len(g), slots) * prefill_bucket(max(lengths[i] for i in g)) + PREFILL_CALL_TOKENS
                       for g in gs)
        assert cost(groups) <= cost([list(range(len(lengths)))])
        # the fewest padded tokens over every split of the sorted prompts into consecutive calls
        srt = sorted(lengths, reverse=True)
        least = [0.0] + [float("inf")] * len(srt)          # least[k]: the first k prompts
        for k in range(1, len(srt) + 1):
            least[k] = min(least[j] + batch_bucket(k - j, slots) * prefill_bucket(srt[j]) + PREFILL_CALL_TOKENS
                           for j in range(k))
        assert cost(groups) == least[-1]
    # one long prompt beside short ones goes in alone; prompts of one bucket and a full batch
    # bucket share a call
    assert prefill_groups([300, 20, 18, 30], 4) == [[0], [3, 1, 2]]
    assert prefill_groups([100, 90, 70, 80], 4) == [[0, 1, 3, 2]]


def test_whole_prompts_go_in_at_one_step_in_calls_by_length(llama):
    """Without a token budget (generate()), one step prefills every admitted prompt, in the calls
    `prefill_groups` chose (a long prompt alone, the short ones together), and each request then
    decodes what it decodes alone."""
    target, engines = llama
    eng = engines[T]
    eos = _eos(target)
    ps = [prompts(1, target.cfg.vocab_size, seed=31, lo=60, hi=61)[0]] + prompts(3, target.cfg.vocab_size, seed=32,
                                                                                     lo=4, hi=12)
    want = [_solo(engines[0], p, 10, eos) for p in ps]
    shapes = []
    prefill = eng.prefill

    def spy(tokens_PS, *a, **kw):
        shapes.append(tokens_PS.shape)
        return prefill(tokens_PS, *a, **kw)

    eng.prefill = spy
    try:
        b = Scheduler(eng, SchedulerConfig(4, MAX_LEN))
        reqs = [Request(p, 10, eos_ids=eos) for p in ps]
        for r in reqs:
            b.add(r)
        b.step()
        assert all(r.tokens for r in reqs) and not b.filling
        assert shapes == [(1, 64), (4, 16)]
        while b.has_work():
            b.step()
    finally:
        del eng.prefill
    assert [r.tokens for r in reqs] == want
