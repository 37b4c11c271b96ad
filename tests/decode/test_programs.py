"""The compiled programs an engine keeps (`dspark_jax.decode.programs`): one jit per program shape, the
least recently used dropped when the process nears its memory-mapping limit; dropping one releases
its mappings, and a dropped program called again compiles again and computes the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.programs import CompiledPrograms, memory_mappings
from dspark_jax.decode.scheduler import Request, Scheduler
from tests.gen_utils import prompts, tiny_draft, tiny_llama


def _chain(x, n):
    for i in range(n):            # each dot ends a fusion: n kernels
        x = jnp.sin(x @ x) + i
    return x


class FakeMappings:
    """A process holding `base` mappings plus `per_program` for each program `programs` holds."""

    def __init__(self, programs: CompiledPrograms, base: int, per_program: int, limit: int):
        self.programs, self.base, self.per, self.limit = programs, base, per_program, limit

    def __call__(self):
        return self.base + self.per * len(self.programs), self.limit


def test_least_recently_used_programs_are_dropped_past_the_share_of_the_limit():
    programs = CompiledPrograms()
    programs._mappings = FakeMappings(programs, base=10, per_program=10, limit=100)
    x = jnp.ones((4, 4))
    for n in range(1, 8):           # 7 programs: 80 mappings, not past 0.8 x 100
        jitted, new = programs.get(("chain", n), _chain, {"static_argnames": "n"}, tag=n)
        assert new
        jitted(x, n=n)
        assert programs.trim() == 0
    jitted, new = programs.get(("chain", 1), _chain, {"static_argnames": "n"}, tag=1)
    assert not new                  # used again: now the most recent
    jitted, new = programs.get(("chain", 8), _chain, {"static_argnames": "n"}, tag=8)
    assert new
    jitted(x, n=8)
    # 90 mappings > 80: the least recently used (2, 3) go, down to 70 (<= 0.7 x 100)
    assert programs.trim() == 2
    assert programs.tags() == {1, 4, 5, 6, 7, 8} and programs.dropped == 2
    assert programs.compiled() == 6          # one executable per program held
    # never the newest, however high the count
    programs._mappings = lambda: (1000, 100)
    assert programs.trim() == 5 and programs.tags() == {8}
    # no limit known: nothing dropped
    programs._mappings = lambda: None
    programs.get(("chain", 9), _chain, {"static_argnames": "n"})
    assert programs.trim() == 0 and len(programs) == 2


def test_dropping_a_program_releases_its_memory_mappings():
    """The mappings are the process's own (/proc/self/maps): a 40-kernel program holds dozens, and
    they go when its jit is dropped."""
    programs = CompiledPrograms(mappings=lambda: None)
    x = jnp.ones((8, 8))
    before = memory_mappings()[0]
    for n in (40, 41):
        jitted, _ = programs.get(n, _chain, {"static_argnames": "n"})
        jitted(x, n=n)
    held = memory_mappings()[0]
    assert held - before >= 40                 # two programs of 40+ kernels
    programs.clear()
    assert memory_mappings()[0] < held - 40


def test_an_engine_near_the_limit_drops_programs_and_recompiles_them_with_the_same_output():
    """A scheduler whose process is 'near the limit' past four programs: programs are dropped
    while requests run (their step tags leave `programs_called`), dropped ones come back when
    called again, and the output equals a run where nothing is dropped."""
    target = tiny_llama(0)
    draft = tiny_draft(target, 1)

    def run(limit_after: int | None):
        eng = Engine(target, draft, EngineConfig(num_speculative_tokens=3))
        if limit_after is not None:
            eng.programs._mappings = FakeMappings(eng.programs, base=0, per_program=100 // limit_after,
                                                  limit=100)
        b = Scheduler(eng, SchedulerConfig(4, 96, speculative_length="fixed"))
        reqs = [Request(p, max_new_tokens=8) for p in prompts(3, 96, seed=0, lo=5, hi=60)]
        for r in reqs[:2]:
            b.add(r)
        b.step()
        b.add(reqs[2])         # a third row: a new batch bucket and prefill shape
        while b.has_work():
            b.step()
        return [r.tokens for r in reqs], eng

    kept, eng_kept = run(None)
    dropped, eng = run(4)
    assert dropped == kept
    assert eng_kept.programs.dropped == 0 and eng.programs.dropped > 0
    assert len(eng.programs) < len(eng_kept.programs)
    assert eng.programs_called <= eng_kept.programs_called and eng.programs_called != eng_kept.programs_called
    assert np.all(np.asarray([len(t) for t in dropped]) == 8)
    jax.clear_caches()
