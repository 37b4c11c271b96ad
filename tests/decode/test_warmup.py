"""Warm-up (`dspark_jax.decode.warmup`): it compiles every program shape a scheduler can call, writes
nothing into the caches, and afterwards requests compile nothing; the persistent compilation
cache directory follows the flag, then the environment, then the default."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dspark_jax.decode import warmup
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.sampling import SamplingParams
from tests.gen_utils import prompts, tiny_draft, tiny_llama

T = 4


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, 1)


class CompileCounter:
    """Tracings, lowerings and backend compilations while inside the `with` block (JAX's
    monitoring events): a call that finds its program compiled records none of them. `traces`:
    the tracings alone."""

    def __enter__(self):
        self.count = self.traces = 0

        def listener(event, duration, **kw):
            if event.startswith("/jax/core/compile/"):
                self.count += 1
                self.traces += event.endswith("jaxpr_trace_duration")
        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def _dear_at_two_rows(rows: int, n: int) -> float:
    """Step costs where the choice depends on the batch: any length alone, shorter ones beside others."""
    return 1.0 if rows == 1 else 1.0 + 0.3 * n


@pytest.mark.parametrize("speculative_length,budget", [("fixed", 32), ("adaptive", None)])
def test_after_warm_up_requests_compile_nothing(pair, speculative_length, budget, monkeypatch):
    """budget 32: prompts longer than 32 tokens go in chunk by chunk (later chunks at offsets 32,
    64, 96 run the first chunk's program), short ones several to a call. With the sampling programs warmed
    too (the fixed case), requests at settings never seen before share the steps and compile
    nothing either. Programs over at most `RUN_TOKENS` positions also ran once (an executable
    enters its jit's call cache when called), the larger ones were only compiled."""
    from dspark_jax.decode.spec_length import StepCosts
    target, draft = pair
    eng = Engine(target, draft, EngineConfig(num_speculative_tokens=T))
    costs = StepCosts.of(_dear_at_two_rows)
    kw = dict(speculative_length=speculative_length, step_costs=costs, max_num_batched_tokens=budget)
    b = Scheduler(eng, SchedulerConfig(2, 128, **kw))
    sampled = speculative_length == "fixed"
    widths = {s.width for s in warmup.program_shapes(b) if s.kind == "step"}
    assert widths == ({None} if speculative_length == "fixed" else {0, 1, 3, None})
    monkeypatch.setattr(warmup, "RUN_TOKENS", 16)
    with CompileCounter() as warm:
        info = warmup.warm_up(b, sampled=sampled)
    shapes = warmup.program_shapes(b, sampled)
    assert info["programs"] == len(shapes) and info["skipped"] == 0
    assert warm.count > 0
    ran = sum(s.positions(T) <= 16 for s in shapes)
    assert 0 < ran < len(shapes) and len(eng.programs) == len(shapes) and eng.programs.compiled() == ran
    # padding rows only: the warm-up wrote nothing
    assert not np.asarray(b.caches.pool.pages).any()
    ps = prompts(4, target.cfg.vocab_size, seed=31, lo=3, hi=40)
    long_prompt = prompts(1, target.cfg.vocab_size, seed=32, lo=110, hi=111)[0]
    with CompileCounter() as served:
        short = b.run([Request(ps[0], 6)])                           # a short request alone
        many = b.run([Request(p, 30) for p in ps])                   # then a batch, slots reused
        b.run([Request(ps[1], 12), Request(long_prompt, 8)])         # and the longest prompt beside one
        if sampled:                                                  # settings no warm-up call used
            b.run([Request(ps[2], 10, SamplingParams(0.7, 0.9)), Request(ps[3], 10, SamplingParams(1.3))])
    if speculative_length == "fixed":
        assert served.count == 0
    else:
        # nothing lowered or compiled; JAX's own parameter cache may retrace a program whose
        # executable the warm-up built once a warm-up has built a few dozen, and then reuses the
        # executable
        assert served.count == served.traces
    fresh = Scheduler(eng, SchedulerConfig(2, 128, **kw))
    assert short[0].tokens == fresh.run([Request(ps[0], 6)])[0].tokens
    assert all(len(r.tokens) == 30 for r in many)


def test_program_shapes_cheapest_first_and_capped(pair, monkeypatch):
    target, draft = pair
    eng = Engine(target, None, EngineConfig(num_speculative_tokens=0))
    b = Scheduler(eng, SchedulerConfig(8, 1024))
    shapes = warmup.program_shapes(b, sampled=True)
    # batch buckets 1, 2, 4, 8; prompt buckets 16..1024; steps of any length: one program per batch
    # bucket (greedy and sampling)
    assert {s.rows for s in shapes} == {1, 2, 4, 8}
    assert {s.length for s in shapes if s.kind == "prefill"} == {16, 32, 64, 128, 256, 512, 1024}
    assert {s.length for s in shapes if s.kind == "step"} == {None}
    assert len(shapes) == 4 * 7 + 2 * 4          # one prefill program for greedy and sampled prompts
    costs = [s.positions(0) for s in shapes]
    assert costs == sorted(costs)
    assert shapes[0] == warmup.ProgramShape("step", 1, None, False)
    greedy = len(warmup.program_shapes(b))
    assert greedy == 4 * 7 + 4
    info = warmup.warm_up(b, max_programs=3)
    assert info == {**info, "programs": 3, "skipped": greedy - 3}
    # a process near its memory-mapping limit stops warming up (each program holds mappings)
    held = warmup.memory_mappings()
    assert held is None or (held[0] > 0 and held[1] > 0)
    assert warmup.MAPPINGS_SHARE == 0.75
    counts = iter([10, 60, 80, 95])
    monkeypatch.setattr(warmup, "memory_mappings", lambda: (next(counts), 100))
    info = warmup.warm_up(b, max_programs=4)
    assert info == {**info, "programs": 3, "skipped": greedy - 3}
    # a 256-token budget: first chunks up to 256 tokens with rows x bucket <= 256 (a longer prompt's
    # later chunks run the one-row 256 program)
    chunked = warmup.program_shapes(Scheduler(eng, SchedulerConfig(8, 1024, max_num_batched_tokens=256)))
    prefills = [s for s in chunked if s.kind == "prefill"]
    assert max(s.rows * s.length for s in prefills) == 256
    assert len(prefills) == 5 + 4 + 3 + 2          # chunk buckets 16..256 by rows 1, 2, 4, 8


def test_compilation_cache_dir_flag_then_environment_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv(warmup.ENV_CACHE, raising=False)
    assert warmup.compilation_cache_dir() == tmp_path / "c" / "xla"
    monkeypatch.setenv(warmup.ENV_CACHE, str(tmp_path / "env"))
    assert warmup.compilation_cache_dir() == tmp_path / "env"
    assert warmup.compilation_cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert warmup.compilation_cache_dir("off") is None
    monkeypatch.setenv(warmup.ENV_CACHE, "off")
    assert warmup.compilation_cache_dir() is None
