"""Chunked prefill (`Scheduler(max_num_batched_tokens=...)`): a prompt longer than the budget goes
into its slot chunk by chunk, each chunk continuing from the KDA state and the cache rows the
earlier chunks left; the caches it leaves and the greedy output equal a whole-prompt prefill's
(float32, both target families, with and without the draft), and a running stream gets tokens
at every step while the long prompt goes in."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.generate import generate
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.kernels import paged_attention
from tests.float64 import assert_f32_close
from tests.gen_utils import prompts, tiny_draft, tiny_k3, tiny_llama

# one slot count and capacity throughout: the caches' shape is part of every compiled program
SLOTS, MAX_LEN, T = 3, 128, 4
BUDGET = 32                          # tokens per prefill call in the chunked schedulers
LONG = 100                           # prompt tokens: four chunks of at most BUDGET


@pytest.fixture(scope="module", params=["llama", "k3"])
def family(request):
    if request.param == "llama":
        target = tiny_llama(0)
        draft = tiny_draft(target, 1)
    else:
        target = tiny_k3(0)
        draft = tiny_draft(target, 1, layer_ids=(1, 3))
    return target, {0: Engine(target, None, EngineConfig(num_speculative_tokens=0)),
                    T: Engine(target, draft, EngineConfig(num_speculative_tokens=T))}


def _counting_prefill(eng, calls: list):
    """Record (rows, width, starts) of every prefill call of `eng` (undo with `del eng.prefill`)."""
    prefill = eng.prefill

    def spy(tokens_PS, lens_P, slots_P, *a, **kw):
        calls.append((tokens_PS.shape[0], tokens_PS.shape[1], tuple(int(s) for s in kw["starts_P"]),
                      tuple(int(n) for n in lens_P)))
        return prefill(tokens_PS, lens_P, slots_P, *a, **kw)
    eng.prefill = spy


def _slot_caches(b: Scheduler, slot: int, n: int):
    """The first n positions of every pool row of a slot, and its KDA states (numpy)."""
    pool = b.caches.pool
    pages = np.asarray(pool.pages)[:, np.asarray(pool.block_table)[slot]]
    rows = pages.reshape(pages.shape[0], -1, pages.shape[-1])[:, :n]
    kda = None if b.caches.kda is None else [np.asarray(x[:, slot]) for x in b.caches.kda]
    return rows, kda


@pytest.mark.parametrize("t", [0, T])
def test_chunked_prefill_equals_whole_prompt(family, t):
    """A 100-token prompt in 32-token chunks (4 prefill calls at offsets 0, 32, 64, 96) leaves the
    attention/MLA rows, the draft's context rows and the KDA state of a whole-prompt prefill, and
    decodes the same greedy tokens; a slot's earlier occupant does not leak into the first chunk."""
    target, engines = family
    eng = engines[t]
    prompt, other = prompts(2, target.cfg.vocab_size, seed=41, lo=LONG, hi=LONG + 1)
    whole = Scheduler(eng, SchedulerConfig(SLOTS, MAX_LEN))
    whole_req = Request(prompt, 20)
    whole.add(whole_req)
    whole._admit()
    calls = []
    _counting_prefill(eng, calls)
    try:
        chunked = Scheduler(eng, SchedulerConfig(SLOTS, MAX_LEN, max_num_batched_tokens=BUDGET))
        chunked.run([Request(other, 3)])           # leaves its state in slot 0
        calls.clear()
        req = Request(prompt, 20)
        chunked.add(req)
        while req.prefilled < len(prompt):
            assert not req.tokens
            chunked._admit()
    finally:
        del eng.prefill
    assert [(c[0], c[1], c[2][0], c[3][0]) for c in calls] == [(1, BUDGET, 0, 32), (1, BUDGET, 32, 32),
                                                                (1, BUDGET, 64, 32), (1, BUDGET, 96, 4)]
    assert req.slot == 0 and whole_req.slot == 0
    assert req.tokens == whole_req.tokens
    got, want = _slot_caches(chunked, 0, LONG), _slot_caches(whole, 0, LONG)
    assert_f32_close(got[0], want[0], "pool rows: chunked vs whole prefill")
    if want[1] is not None:
        for g, w in zip(got[1], want[1]):
            assert_f32_close(g, w, "KDA state: chunked vs whole prefill")
    while chunked.has_work():
        chunked.step()
    while whole.has_work():
        whole.step()
    assert len(req.tokens) == 20 and req.tokens == whole_req.tokens


def test_query_tiles_leave_the_output_unchanged(family, monkeypatch):
    """With query tiles of 8 rows over key chunks of one page (every prefill call many tiles, each
    tile's early chunks unmasked and later ones masked, the whole prompt's padding rows a tile of
    their own), the chunked prefill still equals the whole-prompt one, and both give the greedy
    tokens and cache rows of the engine at the default tile (one tile per call here)."""
    target, engines = family
    prompt = prompts(1, target.cfg.vocab_size, seed=46, lo=LONG, hi=LONG + 1)[0]
    want = Scheduler(engines[0], SchedulerConfig(SLOTS, MAX_LEN))
    want_req = want.run([Request(prompt, 12)])[0]
    monkeypatch.setattr(paged_attention, "QUERY_TILE", 8)
    monkeypatch.setattr(paged_attention, "KEY_CHUNK", 16)
    tiled = Engine(target, None, EngineConfig(num_speculative_tokens=0))
    for budget in (None, BUDGET):
        b = Scheduler(tiled, SchedulerConfig(SLOTS, MAX_LEN, max_num_batched_tokens=budget))
        req = b.run([Request(prompt, 12)])[0]
        assert req.tokens == want_req.tokens, f"budget {budget}"
        assert_f32_close(_slot_caches(b, 0, LONG)[0], _slot_caches(want, 0, LONG)[0], f"pool rows, budget {budget}")


# the scheduling does not depend on the family (the k3 family's compilations are the slow ones)
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_running_stream_advances_at_every_step_while_a_long_prompt_goes_in(family):
    """A stream decoding in slot 0; a 100-token prompt arrives with short ones behind it. Every step
    runs one prefill call of at most BUDGET tokens and then the decode step: the stream gets
    tokens at each of the long prompt's chunks, the short prompts wait their turn, and every
    request equals its output alone with whole-prompt prefill."""
    target, engines = family
    eng = engines[T]
    running, *short = prompts(3, target.cfg.vocab_size, seed=42, lo=5, hi=12)
    long_prompt = prompts(1, target.cfg.vocab_size, seed=43, lo=LONG, hi=LONG + 1)[0]
    want = [Scheduler(eng, SchedulerConfig(SLOTS, MAX_LEN)).run([Request(p, n)])[0].tokens
            for p, n in ((running, 60), (long_prompt, 12), (short[0], 10), (short[1], 10))]
    b = Scheduler(eng, SchedulerConfig(SLOTS, MAX_LEN, max_num_batched_tokens=BUDGET))
    stream = Request(running, 60)
    b.add(stream)
    b.step()
    calls = []
    _counting_prefill(eng, calls)
    try:
        late = [Request(long_prompt, 12), Request(short[0], 10), Request(short[1], 10)]
        for r in late:
            b.add(r)
        steps = 0
        while late[0].prefilled < LONG:
            before = len(stream.tokens)
            calls.clear()
            b.step()
            steps += 1
            assert len(calls) == 1 and calls[0][0] * calls[0][1] <= BUDGET
            assert len(stream.tokens) > before and stream.finish_reason is None
            # the long prompt holds a slot (it is running) without decoding until its last chunk
            assert late[0].slot is not None and (late[0].tokens == []) == (late[0].prefilled < LONG)
        assert steps == 4
        # the short prompt beside it did not fit a call with a full chunk: it goes in next
        assert late[1].slot is not None and not late[1].tokens and late[2].slot is None
        while b.has_work():
            b.step()
    finally:
        del eng.prefill
    assert [stream.tokens, *(r.tokens for r in late)] == want


def test_abort_part_way_through_a_prompt_frees_its_slot(family):
    target, engines = family
    b = Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN, max_num_batched_tokens=BUDGET))
    long_prompt, short = prompts(2, target.cfg.vocab_size, seed=44, lo=LONG, hi=LONG + 1)
    doomed = Request(long_prompt, 5)
    b.add(doomed)
    b.step()
    assert 0 < doomed.prefilled < LONG and b.num_running == 1
    b.abort(doomed)
    assert doomed.finish_reason == "abort" and b.num_running == 0 and not b.filling
    got = b.run([Request(short, 6)])[0].tokens            # slot 0 again, from zero KDA state
    assert got == Scheduler(engines[T], SchedulerConfig(SLOTS, MAX_LEN)).run([Request(short, 6)])[0].tokens


def test_generate_passes_the_budget():
    """generate(max_num_batched_tokens=24): a budget that is no power of two, the same output."""
    target = tiny_llama(0)
    draft = tiny_draft(target, 1)
    ps = prompts(2, target.cfg.vocab_size, seed=45, lo=60, hi=70)
    outs = [[o.token_ids for o in generate(target, draft, ps, max_new_tokens=12, num_speculative_tokens=T,
                                           **kw).outputs] for kw in ({}, {"max_num_batched_tokens": 24})]
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])


def test_budget_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
