"""What a decode step costs, measured without a checkpoint: the step timing shared by
`benchmarks.decode_speed` and `benchmarks.gpu_bench` (kept free of command-line flags so both,
and tests, can import it).

- `random_target(config)` / `random_weights(make)`: a model of an architecture with random weights
  (a step's cost does not depend on the values), drawn without running the initialisers;
- `make_engine(target, draft, T)`: the greedy Engine generate() uses for the pair;
- `step_costs(engine, batch)`: the draft's block pass, a verify of T+1 tokens and a one-token
  step, timed on a fresh cache `context` tokens deep;
- `run_every_length` / `run_every_prefill`: a benchmark's untimed pass, compiling the programs
  a later pass may call that this one did not;
- `CompileClock`: the seconds JAX reports compiling (to take them out of an end-to-end rate).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.config import load_config
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.decode.buckets import batch_buckets, pow2
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.generate import engine_for
from dspark_jax.decode.scheduler import Scheduler
from dspark_jax.decode.warmup import ProgramShape, call_program
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.models.llama import LlamaModel
from dspark_jax.sampling import SamplingParams


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class CompileClock:
    """Sums the durations JAX reports for compilation (`/jax/core/compile/*` events: tracing,
    lowering, backend compile) from `reset()` on; one listener per clock, registered once."""

    def __init__(self):
        self.seconds = 0.0

        def on_event(event: str, seconds: float, **_) -> None:
            if event.startswith("/jax/core/compile/"):
                self.seconds += seconds
        jax.monitoring.register_event_duration_secs_listener(on_event)

    def reset(self) -> None:
        self.seconds = 0.0


class StepClock:
    """Wall seconds spent in `Engine.step` calls from `reset()` on (the dispatch and the wait for
    the step's tokens, which the scheduler reads at once anyway) and their count; the rest of a
    `generate()` call is prefill, the host loop and set-up. Wraps `Engine.step` for the process."""

    def __init__(self):

        self.seconds, self.steps = 0.0, 0
        inner = Engine.step

        def step(eng, *args, **kw):
            t0 = time.perf_counter()
            out = inner(eng, *args, **kw)
            jax.block_until_ready(out[:2])
            self.seconds += time.perf_counter() - t0
            self.steps += 1
            return out
        Engine.step = step

    def reset(self) -> None:
        self.seconds, self.steps = 0.0, 0


def make_engine(target, draft, t: int, page_size: int = 16):
    """The greedy Engine generate() uses for this pair and T (shared, so its compiles are too)."""

    return engine_for(target, draft, EngineConfig(num_speculative_tokens=t, page_size=page_size))


def run_every_length(eng) -> int:
    """For every cache geometry `eng`'s schedulers have called, run each speculation length an
    adaptive scheduler can choose once, on padding rows (nothing written), at every batch bucket up
    to the widest one called (greedy, and sampling where it was called), so a later pass over the
    same work compiles nothing whichever lengths it picks and whichever bucket its last rows end
    in (a benchmark's untimed pass: which rows finish together, and so the buckets a batch's tail
    steps use, can change from one pass to the next). A bucket whose step costs are not known yet
    is measured first (`LengthChoice.choose`). Returns the programs run."""


    shapes: dict[tuple, set] = {}
    for p in list(eng.programs_called):
        shapes.setdefault((p.slots, p.max_len), set()).add((p.rows, p.sampled))
    before = len(eng.programs_called)
    for (slots, max_len), met in shapes.items():
        b = Scheduler(eng, SchedulerConfig(slots, max_len))
        buckets = batch_buckets(max(r for r, _ in met), slots)
        for sampled in sorted({s for _, s in met}):
            for rows in buckets:
                b.length_choice.choose(rows, b.max_len, sampled=sampled)    # measures the bucket if its costs are unknown
                pad = np.full(rows, slots, np.int32)
                zeros = np.zeros(rows, np.int32)
                for n in b.lengths:
                    b.run_step(pad, zeros, zeros, 0, SamplingParams(1.0 if sampled else 0.0), length=n)
    return len(eng.programs_called) - before


def run_every_prefill(eng, widths) -> int:
    """For every cache geometry `eng`'s schedulers have stepped, a prefill on padding rows at every
    batch bucket up to its slot count and each of `widths` (prompt buckets): continuous batching
    admits as many prompts as slots have freed, so the prefills of a pass differ from the last
    one's (a benchmark's untimed pass). Returns the prefill calls made."""

    calls = 0
    for slots, max_len in sorted({(p.slots, p.max_len) for p in eng.programs_called}):
        b = Scheduler(eng, SchedulerConfig(slots, max_len))
        for rows in batch_buckets(slots, slots):
            for width in widths:
                call_program(b, ProgramShape("prefill", rows, width, True))
                calls += 1
    return calls


def step_costs(eng, b: int, reps: int = 5, context: int = 100):
    """Timed steps on a fresh cache, `context` tokens deep: the draft's block pass alone, a verify
    of T+1 tokens and a one-token step (both with given drafts, so without the block pass).
    Returns the draft's share of a speculative step, the tok/fwd at which speculation breaks even
    with one-token steps, and the three times in ms."""


    t = eng.t
    max_len = max(512, pow2(context + t + 1))
    caches = eng.new_caches(b, max_len)
    x0, lens = jnp.ones((b,), jnp.int32), jnp.full((b,), context, jnp.int32)
    active, key = jnp.ones((b,), bool), jax.random.PRNGKey(0)

    def propose():
        nonlocal caches
        *out, caches = eng.propose(x0, lens, caches, key)
        jax.block_until_ready(out)

    def verify(width):
        nonlocal caches
        given = jnp.ones((b, width), jnp.int32)
        *out, caches = eng.step(x0, lens, active, jnp.int32(max_len), caches, key, drafts_BT=given)
        jax.block_until_ready(out)

    def timed(fn):
        _, first = _timed(fn)                  # compile
        print(f"  batch {b}: compiled a step in {first:.1f} s", flush=True)
        return _timed(lambda: [fn() for _ in range(reps)])[1] / reps

    t_draft, t_full, t_one = timed(propose), timed(lambda: verify(t)), timed(lambda: verify(0))
    return {"draft_share": t_draft / (t_draft + t_full), "break_even": (t_draft + t_full) / t_one,
            "draft_block_ms": 1e3 * t_draft,
            "verify_ms": 1e3 * t_full, "one_token_step_ms": 1e3 * t_one}


def random_target(path: str, dtype, on_device: bool = False):
    """A target of the architecture in `path` (a config.json or its directory, or a loaded
    config) with random weights (see `random_weights`)."""

    cfg = path if not isinstance(path, (str, Path)) else load_config(
        Path(path) / "config.json" if Path(path).is_dir() else path)
    if isinstance(cfg, DraftConfig):
        raise ValueError(f"{path}: a DSpark draft config, not a target's")
    cls = LlamaModel if isinstance(cfg, LlamaConfig) else KimiLinearModel
    return random_weights(lambda rngs: cls(cfg, dtype=dtype, rngs=rngs), on_device)


def random_weights(make, on_device: bool = False, host_max_bytes: int = 16 << 20):
    """`make(rngs)` (a model constructor) with random weights, without running its initialisers
    (jitting them is a very slow compile on a GPU), placed as `load_target` places a checkpoint's
    (one device). Host: numpy draws, fine up to a few hundred MB. `on_device` (models of many
    GB): leaves over `host_max_bytes` are drawn on the device, one small jitted draw per distinct
    shape. Floats ~ N(0, 0.02); packed MXFP4 bytes random, their E8M0 scales 2^-5."""


    graphdef, state = nnx.split(params_lib.abstract(lambda: make(nnx.Rngs(0))))
    shardings = sharding.param_shardings(state, sharding.make_mesh(devices=jax.local_devices()[:1]))
    rng = np.random.default_rng(0)
    count = iter(range(1 << 30))

    def draw(path, a, s):
        i = next(count)
        kind = ("scale" if "weight_scale" in jax.tree_util.keystr(path) else "bits") if a.dtype == np.uint8 else \
            ("float" if np.issubdtype(a.dtype, np.floating) else "zeros")
        if on_device and a.size * np.dtype(a.dtype).itemsize > host_max_bytes:
            return _device_draw(tuple(a.shape), np.dtype(a.dtype).name, kind, s)(jax.random.PRNGKey(i))
        if kind == "scale":
            x = np.full(a.shape, 122, np.uint8)
        elif kind == "bits":
            x = rng.integers(0, 256, a.shape, dtype=np.uint8)
        else:
            x = (0.02 * rng.standard_normal(a.shape, np.float32)).astype(a.dtype)
        return jax.device_put(x, s)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state, shardings))


@functools.cache
def _device_draw(shape, dtype_name, kind, sharding_):

    dtype = jnp.dtype(dtype_name)
    fns = {"float": lambda k: (jax.random.normal(k, shape, dtype) * jnp.asarray(0.02, dtype)).astype(dtype),
           "bits": lambda k: jax.random.bits(k, shape, jnp.uint8),
           "scale": lambda k: jnp.full(shape, 122, jnp.uint8),           # E8M0 2^(122-127)
           "zeros": lambda k: jnp.zeros(shape, dtype)}
    return jax.jit(fns[kind], out_shardings=sharding_)
