"""The speculation length per step (`dspark_jax.decode.spec_length`): the candidate lengths, the pooled
acceptance estimate, the choice against a brute-force optimum, and the step-cost tables measured
once and kept on disk (the losslessness of adaptive generation: tests/decode/test_generate.py,
tests/decode/test_scheduler.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.bench.steps_timing import CompileClock, run_every_length, run_every_prefill
from dspark_jax.sampling import GREEDY
from dspark_jax.decode import warmup
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.decode.spec_length import (
    ENV_COSTS,
    GAIN_MARGIN,
    AcceptanceEstimate,
    StepCosts,
    StepTimes,
    candidate_lengths,
    choose_length,
    costs_for,
    source_digest,
)
from tests.gen_utils import prompts, tiny_draft, tiny_llama


def test_candidate_lengths_are_power_of_two_widths_and_t():
    assert candidate_lengths(7) == (0, 1, 3, 7)
    assert candidate_lengths(5) == (0, 1, 3, 5)
    assert candidate_lengths(1) == (0, 1)
    assert candidate_lengths(15) == (0, 1, 3, 7, 15)


def test_acceptance_estimate_counts_tries_and_keeps_a_prior_for_unreached_positions():
    est = AcceptanceEstimate(4, prior=0.6, strength=8.0)
    np.testing.assert_allclose(est.conditional(), [0.6] * 4)
    for _ in range(100):
        est.observe(verified=2, accepted=0)        # position 1 tried and rejected
        est.observe(verified=2, accepted=2)        # positions 1, 2 accepted
    p = est.conditional()
    assert p[0] == pytest.approx((100 + 8 * 0.6) / (200 + 8))
    assert p[1] == pytest.approx((100 + 8 * p[0]) / (100 + 8))
    # positions never verified take the estimate before them
    assert p[2] == pytest.approx(p[1]) and p[3] == pytest.approx(p[1])
    expected = est.expected_accepted((0, 1, 3))
    assert expected[0] == 0.0 and expected[1] == pytest.approx(p[0])
    assert expected[3] == pytest.approx(p[0] + p[0] * p[1] + p[0] * p[1] * p[2])
    est.observe(verified=0, accepted=0)            # a one-token step scores nothing
    assert est.conditional()[0] == pytest.approx(p[0])


def test_acceptance_estimate_forgets_old_steps_past_its_window():
    est = AcceptanceEstimate(1, strength=1.0, window=100)
    for _ in range(1000):
        est.observe(1, 1)
    for _ in range(300):
        est.observe(1, 0)
    assert est.tried_K[0] <= 100 and est.conditional()[0] < 0.4


def test_choose_length_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    lengths = candidate_lengths(7)
    for _ in range(200):
        est = AcceptanceEstimate(7, prior=float(rng.uniform(0.05, 0.95)))
        for _ in range(int(rng.integers(0, 50))):
            v = int(rng.choice(lengths[1:]))
            est.observe(v, int(rng.integers(0, v + 1)))
        costs = {n: 1.0 + float(rng.uniform(0, 0.5)) * n ** float(rng.uniform(0.5, 1.5)) for n in lengths}
        got = choose_length(est, costs, gain=1.0)
        e = est.expected_accepted(lengths)
        best = max((1 + e[n]) / costs[n] for n in lengths)
        assert (1 + e[got]) / costs[got] == pytest.approx(best, rel=1e-12)
    est = AcceptanceEstimate(7)
    assert choose_length(est, dict.fromkeys(lengths, 1.0)) == 7                 # free drafts: all of them
    assert choose_length(est, {n: 1.0 + n for n in lengths}) == 0                # dear drafts: none


def test_choose_length_speculates_only_when_it_beats_a_one_token_step_by_the_margin():
    est = AcceptanceEstimate(7, prior=0.5)          # E[accepted | L] = 0.5, 0.875, 0.992 for L = 1, 3, 7
    costs = {0: 1.0, 1: 1.4, 3: 2.0, 7: 4.0}       # rates 1.0, 1.071, 0.938, 0.498
    assert GAIN_MARGIN == 1.05 and choose_length(est, costs) == 1
    assert choose_length(est, costs, gain=1.08) == 0                  # 1.071 < 1.08 x 1.0
    assert choose_length(est, {0: 1.0, 1: 1.45, 3: 2.0, 7: 4.0}) == 0       # 1.034: within the margin
    assert choose_length(est, {0: 1.0, 1: 1.45, 3: 2.0, 7: 4.0}, gain=1.0) == 1
    # a length only estimated still runs to be measured when it comes within the exploration margin
    assert choose_length(est, {0: 1.0, 1: 1.45, 3: 2.0, 7: 4.0}, unseen=(1,)) == 1
    assert choose_length(est, {1: 1.45, 3: 2.0}) == 1                 # no one-token step among them: the best


def test_choose_length_first_runs_an_unmeasured_length_close_to_the_best():
    est = AcceptanceEstimate(7, prior=0.5)          # E[accepted | L] = 0.5, 0.875, 0.992 for L = 1, 3, 7
    costs = {0: 1.0, 1: 1.4, 3: 2.0, 7: 4.0}       # rates 1.0, 1.071, 0.938, 0.498
    assert choose_length(est, costs) == 1
    assert choose_length(est, costs, unseen=(0, 3)) == 0        # both within 0.85 of the best: the better
    assert choose_length(est, costs, unseen=(3,)) == 3
    assert choose_length(est, costs, unseen=(7,)) == 1          # far behind: not worth a step
    assert choose_length(est, {0: 2.0, 1: 1.4, 3: 2.0, 7: 4.0}, unseen=(0, 7)) == 0   # far behind, but the bar
    assert choose_length(est, costs, unseen=(1,)) == 1          # the best itself
    assert choose_length(est, costs, unseen=(1, 3, 7), margin=1.0) == 1
    assert choose_length(est, costs, unseen=(0, 1, 3, 7), margin=1.0) == 0     # the one-token step is measured


def test_a_length_without_its_program_is_not_compiled_to_explore():
    est = AcceptanceEstimate(7, prior=0.5)          # E[accepted | L] = 0.5, 0.875, 0.992 for L = 1, 3, 7
    costs = {0: 1.0, 1: 1.4, 3: 2.0, 7: 4.0}       # rates 1.0, 1.071, 0.938, 0.498
    assert choose_length(est, costs, unseen=(0, 3)) == 0
    assert choose_length(est, costs, unseen=(0, 3), uncompiled=(0,)) == 3
    assert choose_length(est, costs, unseen=(0, 3), uncompiled=(0, 3)) == 1
    assert choose_length(est, costs, unseen=(1,), uncompiled=(1,)) == 1      # the best is run all the same
    # a one-token step measured before whose figures expired must come within the margin like the others
    assert choose_length(est, costs, unseen=(0,), expired=(0,)) == 0          # rate 1.0 >= 0.85 x 1.071
    far = {0: 1.0, 1: 0.7, 3: 2.0, 7: 4.0}                                      # rates 1.0, 1.53, ...
    assert choose_length(est, far, unseen=(0,)) == 0 and choose_length(est, far, unseen=(0,), expired=(0,)) == 1


def test_step_times_replace_the_table_where_observed_and_scale_it_elsewhere():
    times = StepTimes(window=4, min_seen=2)
    table = {0: 1.0, 1: 1.5, 3: 2.0, 7: 3.0}
    assert times.corrected(4, 128, table) == (table, (0, 1, 3, 7))
    times.observe(4, 128, 1, 99.0)                  # a key's first step compiles: not kept
    times.observe(4, 128, 1, 3.0)
    assert times.corrected(4, 128, table) == (table, (0, 1, 3, 7))   # one step: not observed yet
    times.observe(4, 128, 1, 3.4)
    times.observe(4, 128, 1, 2.6)
    costs, unseen = times.corrected(4, 128, table)
    assert unseen == (0, 3, 7) and costs[1] == pytest.approx(3.0)
    # the others scaled by observed / table = 2
    assert costs[0] == pytest.approx(2.0) and costs[3] == pytest.approx(4.0) and costs[7] == pytest.approx(6.0)
    times.observe(4, 128, 0, 5.0)
    times.observe(4, 128, 0, 0.5)
    times.observe(4, 128, 0, 0.7)
    costs, unseen = times.corrected(4, 128, table)
    # scale: the median of 3.0 / 1.5 and 0.6 / 1.0
    assert unseen == (3, 7) and costs[0] == pytest.approx(0.6) and costs[7] == pytest.approx(3.0 * 1.3)
    # another batch bucket or span bucket has its own times
    assert times.corrected(2, 128, table) == (table, (0, 1, 3, 7))
    assert times.corrected(4, 256, table) == (table, (0, 1, 3, 7))
    for _ in range(4):                              # the window keeps the last steps
        times.observe(4, 128, 1, 1.0)
    assert times.median(4, 128, 1) == 1.0 and times.seen()[(4, 128, 1)] == 4


def test_step_times_expire_so_a_length_is_measured_again():
    """Figures older than the horizon (steps of any key) no longer count: a length timed during a
    slow moment, which the choice then avoids, is not held to that figure for good."""
    times = StepTimes(window=8, min_seen=2, horizon=10)
    table = {0: 1.0, 3: 2.0}
    times.observe(8, 256, 1, 99.0)
    times.observe(8, 256, 1, 1.5)                   # one figure, being measured: not expired
    assert times.median(8, 256, 1) is None and not times.expired(8, 256, 1)
    for s in (None, 9.0, 9.0):                      # L = 3 timed slow (the first step: compiling)
        times.observe(8, 256, 3, s if s is not None else 99.0)
    assert times.median(8, 256, 3) == 9.0 and not times.expired(8, 256, 3)
    for _ in range(7):                              # other steps pass: the clock runs for every key
        times.observe(8, 256, 0, 1.0)
    assert times.median(8, 256, 3) == 9.0           # 8 and 7 steps old: within the horizon
    times.observe(8, 256, 0, 1.0)
    times.observe(8, 256, 0, 1.0)
    assert times.median(8, 256, 3) is None and times.expired(8, 256, 3) and times.seen()[(8, 256, 3)] == 1
    costs, unseen = times.corrected(8, 256, table)
    assert unseen == (3,) and costs[0] == 1.0 and costs[3] == pytest.approx(2.0)    # the table, scaled by L = 0's
    assert not times.expired(8, 256, 7) and not times.expired(4, 256, 0)           # never observed: not expired
    times.observe(8, 256, 3, 2.0)
    times.observe(8, 256, 3, 2.2)
    assert times.median(8, 256, 3) == pytest.approx(2.1) and not times.expired(8, 256, 3)


def test_step_costs_measured_once_and_kept_on_disk(tmp_path, monkeypatch):
    """A batch bucket met for the first time is measured (a few steps per length on padding rows,
    nothing written into the caches) and written as JSON under $DSPARK_STEP_COSTS, keyed by the
    host, the model and the dtypes; a new engine of the same pair reads it instead of measuring."""
    monkeypatch.setenv(ENV_COSTS, str(tmp_path))
    target = tiny_llama(0)
    draft = tiny_draft(target, 1)
    t = 3
    eng = Engine(target, draft, EngineConfig(num_speculative_tokens=t))
    b = Scheduler(eng, SchedulerConfig(1, 128))
    assert warmup.measure_step_costs(b) == 1
    assert not np.asarray(b.caches.pool.pages).any()
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    body = json.loads(files[0].read_text())
    assert body["key"]["num_speculative_tokens"] == t and body["key"]["dtype"] == "float32"
    assert "cores" in body["key"]["hardware"] and body["key"]["devices"] >= 1
    assert body["key"]["attention_key_chunk"] == 128
    assert body["key"]["code"] == source_digest() and len(source_digest()) == 16
    measured = body["seconds_by_rows_and_length"]["1"]
    assert set(measured) == {"0", "1", "3"} and all(s > 0 for s in measured.values())
    # a fresh engine loads the table: nothing left to measure, and generation uses it
    again = Scheduler(Engine(target, draft, EngineConfig(num_speculative_tokens=t)), SchedulerConfig(1, 128))
    assert again.step_costs.get(1, again.lengths) == {int(k): v for k, v in measured.items()}
    assert warmup.measure_step_costs(again) == 0
    ref = Scheduler(Engine(target, None, EngineConfig(num_speculative_tokens=0)), SchedulerConfig(1, 128))
    p = prompts(1, target.cfg.vocab_size, seed=3)[0]
    assert again.run([Request(p, 10)])[0].tokens == ref.run([Request(p, 10)])[0].tokens
    # the steps it ran are timed, by batch bucket, length bucket and speculation length, to correct the table
    seen = again.engine.step_times.seen()
    assert seen and {k[:2] for k in seen} == {(1, 64)} and {k[2] for k in seen} <= {0, 1, 3}
    # a benchmark's untimed pass then runs every length at each step shape met (padding rows)
    called = again.engine.programs_called
    met = {(k.rows, k.sampled) for k in called}
    missing = {(r, s, n) for r, s in met for n in again.lengths if again._program_key(r, n, s) not in called}
    assert missing and run_every_length(again.engine) == len(missing)
    called = again.engine.programs_called
    assert all(again._program_key(r, n, s) in called for r, s in met for n in again.lengths)
    assert run_every_length(again.engine) == 0
    # another dtype or T is another table
    other = dict(costs_for(Engine(target, draft, EngineConfig(num_speculative_tokens=2))).key)
    assert other != body["key"] and other["num_speculative_tokens"] == 2


def test_untimed_pass_covers_every_batch_bucket_a_tail_can_reach(tmp_path, monkeypatch):
    """A batch's last rows can finish together in one pass and one by one in the next, so a later
    pass may step at a bucket the untimed pass never met: `run_every_length` runs every length at
    every bucket up to the widest one called, measuring the buckets whose costs are unknown."""
    monkeypatch.setenv(ENV_COSTS, str(tmp_path))
    target = tiny_llama(0)
    eng = Engine(target, tiny_draft(target, 1), EngineConfig(num_speculative_tokens=1))
    b = Scheduler(eng, SchedulerConfig(4, 64))
    b.step_costs.put(4, {0: 1.0, 1: 1.5})                    # only the 4-row bucket known and called
    pad, zeros = np.full(4, 4, np.int32), np.zeros(4, np.int32)
    b.run_step(pad, zeros, zeros, 0, GREEDY, length=1)
    assert {(p.rows, p.width, p.given) for p in eng.programs_called} == {(4, None, None)}
    assert run_every_length(eng) == 5                         # rows 1, 2, 4 x lengths 0, 1, less the one called
    assert {(p.rows, p.given) for p in eng.programs_called} == {(r, g) for r in (1, 2, 4) for g in (0, None)}
    table = json.loads(next(tmp_path.glob("*.json")).read_text())["seconds_by_rows_and_length"]
    assert sorted(table) == ["1", "2", "4"] and table["4"] == {"0": 1.0, "1": 1.5}
    assert run_every_length(eng) == 0


def test_untimed_pass_compiles_the_prefills_continuous_batching_can_admit():
    """`run_every_prefill`: a prefill at every batch bucket up to the slots and each prompt bucket
    given, so a second pass (admissions that differ) compiles nothing."""
    target = tiny_llama(0)
    eng = Engine(target, tiny_draft(target, 1), EngineConfig(num_speculative_tokens=1))
    b = Scheduler(eng, SchedulerConfig(4, 64))
    b.run_step(np.full(4, 4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32), 0, GREEDY, length=1)
    clock = CompileClock()
    assert run_every_prefill(eng, [16, 32]) == 6                  # rows 1, 2, 4 x two prompt buckets
    assert clock.seconds > 0
    clock.reset()
    assert run_every_prefill(eng, [16, 32]) == 6 and clock.seconds == 0


def test_step_costs_environment_settings(monkeypatch):
    target = tiny_llama(0)
    eng = Engine(target, tiny_draft(target, 1), EngineConfig(num_speculative_tokens=3))
    monkeypatch.setenv(ENV_COSTS, "uniform")
    uniform = costs_for(eng)
    assert uniform.uniform and uniform.reachable((0, 1, 3)) == (3,)
    monkeypatch.setenv(ENV_COSTS, "off")
    off = costs_for(eng)
    assert off.path is None and off.get(1, (0, 1, 3)) is None and not off.uniform
    off.put(1, {0: 1.0, 1: 2.0, 3: 3.0})            # kept in memory only
    assert off.get(1, (0, 1, 3)) == {0: 1.0, 1: 2.0, 3: 3.0}
    with pytest.raises(Exception, match="speculative_length"):
        SchedulerConfig(speculative_length="sometimes")
    assert StepCosts.of(lambda rows, n: rows + n).get(4, (0, 1)) == {0: 4.0, 1: 5.0}
