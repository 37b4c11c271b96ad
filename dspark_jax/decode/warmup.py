"""Compiling a `Scheduler`'s programs before traffic, and keeping them across restarts.

`program_shapes` lists every (program, rows, length) shape a scheduler can call: prefill (one
program for greedy and sampled prompts) per batch bucket x chunk bucket within
`max_num_batched_tokens` (a longer prompt's later chunks run the one-row full-width program of its
first); the decode step per batch bucket x speculation length the scheduler can choose
(`Scheduler.reachable_lengths`), greedy and (with `sampled=True`) sampling (sampling settings are
traced per row, so one sampling program serves every temperature and top_p). No program depends on
how long the sequences are: attention reads as far as the longest row reaches
(`dspark_jax.kernels.paged_attention`).

`warm_up` compiles them, cheapest first, through the scheduler's own calls on padding rows (the
arguments a request's call passes; nothing is written), so they land in the engine's programs
as a request would call them, and runs each one once where that is cheap (`RUN_TOKENS`):
XLA:CPU's first run of a compiled program costs far more than the next (the demo pair's step:
~0.7 s against ~0.06 s, with no compile), which the first request would pay otherwise; larger
prefills are only compiled (`Engine.compile_only`). A cap keeps the start-up bounded (the shapes
past it are the largest, rarest ones), and the warm-up stops at three quarters of the process's
memory-mapping limit (`MAPPINGS_SHARE`).

`enable_compilation_cache` turns on JAX's persistent compilation cache, so a restarted server loads
its programs instead of compiling them again. `measure_step_costs` measures the step costs the
adaptive speculation length needs for every batch bucket not measured yet on the host it runs on (kept on
disk beside the compilation cache, `dspark_jax.decode.spec_length`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from dspark_jax.decode.buckets import batch_buckets, chunk_bucket
from dspark_jax.decode.programs import memory_mappings
from dspark_jax.decode.scheduler import Scheduler
from dspark_jax.presets import cache_dir
from dspark_jax.sampling import SamplingParams

log = logging.getLogger("dspark_jax")

ENV_CACHE = "DSPARK_COMPILATION_CACHE"    # a directory, or "off"
# the warm-up stops at this share of the process's memory-mapping limit (`dspark_jax.decode.programs`):
# below the share at which the engine starts dropping programs (0.8), so it never drops what it
# warmed. The list is every shape requests can meet, so once it is all warmed nothing compiles
# later; the demo pair's whole list at --max_model_len 8192 holds ~45,000 of 65,530 (0.69).
MAPPINGS_SHARE = 0.75
# a program over at most this many token positions (rows x tokens each) is also run once at
# warm-up; larger prefills would take seconds each on a CPU and are only compiled
RUN_TOKENS = 4096


@dataclass(frozen=True)
class ProgramShape:
    """One compiled program a scheduler can call. `length`: the chunk bucket (prefill; None for
    steps); `sampled`: the program of steps where some row samples (else every row is greedy);
    `width`: drafts verified (None: the engine's T; 0 with a T > 0 engine: a one-token step; else a
    shorter speculation length)."""

    kind: str                      # "prefill" or "step"
    rows: int
    length: int | None
    sampled: bool
    width: int | None = None

    def positions(self, t: int) -> int:
        """Token positions the program computes: rows x chunk (prefill), rows x verified tokens (step)."""
        if self.kind == "prefill":
            return self.rows * self.length
        return self.rows * ((t if self.width is None else self.width) + 1)

    def __str__(self) -> str:
        what = f"{self.kind} {self.rows}" + (f"x{self.length}" if self.length else "")
        if self.width is not None:
            what += f" width {self.width}"
        return what + (" sampled" if self.sampled else "")


def program_shapes(scheduler: Scheduler, sampled: bool = False) -> list[ProgramShape]:
    """Every shape `scheduler` can call for greedy requests (and for sampled ones with `sampled`),
    cheapest first (greedy steps first among equals)."""
    slots, max_len, t = scheduler.num_slots, scheduler.max_len, scheduler.engine.t
    buckets = batch_buckets(slots, slots)
    longest_prompt = max_len - t - 1
    budget = scheduler.max_num_batched_tokens           # None: whole prompts, any rows
    longest_chunk = longest_prompt if budget is None else min(longest_prompt, budget)
    chunks = sorted({chunk_bucket(n, budget) for n in [1] + [1 << k for k in range(longest_chunk.bit_length())]
                     + [longest_chunk]})
    widths = [None if n == t else n for n in scheduler.reachable_lengths()]
    # one prefill program serves greedy and sampled prompts (`Engine.prefill`)
    out = [ProgramShape("prefill", b, c, True) for b in buckets for c in chunks
           if budget is None or b == 1 or b * c <= budget]
    for s in (False, True) if sampled else (False,):
        out += [ProgramShape("step", b, None, s, w) for b in buckets for w in widths]
    return sorted(out, key=lambda p: (p.positions(t), p.sampled, p.kind, p.width or 0))


def warm_up(scheduler: Scheduler, *, max_programs: int | None = None, sampled: bool = False,
            progress: Callable[[int, int, ProgramShape], None] | None = None) -> dict:
    """Compile each of the scheduler's program shapes (the cheapest `max_programs`; None: all) and
    run each over at most `RUN_TOKENS` positions once on padding rows, stopping early once the
    process holds `MAPPINGS_SHARE` of its memory-mapping limit. Returns
    {"programs", "skipped",
    "seconds", "cache_hits"} (cache_hits: loaded from the persistent compilation cache)."""
    shapes = program_shapes(scheduler, sampled)
    todo = shapes if max_programs is None else shapes[:max_programs]
    done = 0
    hits = []
    listener = (lambda event, **kw: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
    jax.monitoring.register_event_listener(listener)
    start = time.perf_counter()
    try:
        for i, shape in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), shape)
            if shape.positions(scheduler.engine.t) <= RUN_TOKENS:
                call_program(scheduler, shape)
            else:
                with scheduler.engine.compile_only():
                    call_program(scheduler, shape)
            done += 1
            held = memory_mappings()
            if held is not None and held[0] > MAPPINGS_SHARE * held[1] and done < len(todo):
                log.warning("warm-up stopped after %d of %d programs: the process holds %d memory mappings of "
                            "the kernel's limit of %d (vm.max_map_count), and each compiled program keeps "
                            "hundreds; raise the limit (e.g. sysctl -w vm.max_map_count=1048576) to warm up "
                            "more", done, len(todo), held[0], held[1])
                todo = todo[:done]
                break
    finally:
        jax.monitoring.unregister_event_listener(listener)
    if progress is not None and todo:
        progress(len(todo), len(todo), todo[-1])
    info = {"programs": len(todo), "skipped": len(shapes) - len(todo), "seconds": time.perf_counter() - start,
            "cache_hits": len(hits)}
    log.info("warm-up: %d programs in %.1f s (%d loaded from the compilation cache)%s", info["programs"],
             info["seconds"], info["cache_hits"],
             f"; {info['skipped']} larger shapes left to compile on first use" if info["skipped"] else "")
    return info


def call_program(scheduler: Scheduler, shape: ProgramShape) -> None:
    """The call a request of this shape makes (padding rows only), through the scheduler's own
    `run_prefill` / `run_step`; the deployment plan (`dspark_jax.plan.serving`) lowers the programs so."""
    rows = np.full(shape.rows, scheduler.num_slots, np.int32)     # padding rows only
    zeros = np.zeros(shape.rows, np.int32)
    sampling = SamplingParams(temperature=1.0 if shape.sampled else 0.0)
    if shape.kind == "prefill":
        scheduler.run_prefill(np.zeros((shape.rows, shape.length), np.int32), zeros, rows, sampling)
        return
    drafts = None
    if scheduler.proposer is not None and scheduler.engine.t:
        drafts = np.zeros((shape.rows, scheduler.engine.t if shape.width is None else shape.width), np.int32)
    scheduler.run_step(rows, zeros, zeros, 0, sampling, drafts, length=shape.width)


def measure_step_costs(scheduler: Scheduler, progress: Callable[[int, int, int], None] | None = None) -> int:
    """Measure the step costs of every batch bucket whose costs are not known yet (an adaptive
    scheduler; a few steps per speculation length each, on padding rows). `progress(done, total,
    rows)` before each bucket. Returns the buckets measured."""
    if not scheduler.adaptive or scheduler.step_costs.uniform:
        return 0
    buckets = batch_buckets(scheduler.num_slots, scheduler.num_slots)
    todo = [b for b in buckets if scheduler.step_costs.get(b, scheduler.lengths) is None]
    start = time.perf_counter()
    for i, b in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), b)
        scheduler.measure_step_costs(b)
    if todo:
        log.info("step costs: %d batch buckets measured in %.1f s (kept in %s)", len(todo),
                 time.perf_counter() - start, scheduler.step_costs.path or "memory")
    return len(todo)


class ProgressBar:
    """`warm_up`'s progress as a bar redrawn in place on a terminal, else a log line per tenth."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width, self.start, self.last_tenth = width, time.perf_counter(), -1
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int, shape: ProgramShape) -> None:
        elapsed = time.perf_counter() - self.start
        if self.tty:
            fill = self.width * done // max(total, 1)
            end = "\n" if done == total else ""
            self.stream.write(f"\rwarm-up [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} programs, "
                              f"{elapsed:.0f} s, {shape}{' ' * 10}{end}")
            self.stream.flush()
        elif done == total or 10 * done // max(total, 1) > self.last_tenth:
            self.last_tenth = 10 * done // max(total, 1)
            log.info("warm-up: %d/%d programs, %.0f s (%s)", done, total, elapsed, shape)


def compilation_cache_dir(flag: str | None = None) -> Path | None:
    """The persistent compilation cache directory: `flag`, else $DSPARK_COMPILATION_CACHE, else
    `<dspark cache>/xla` (`presets.cache_dir()`, ~/.cache/dspark_jax by default); "off" (or "")
    disables it (None)."""

    value = flag if flag is not None else os.environ.get(ENV_CACHE)
    if value is None:
        return cache_dir() / "xla"
    if value.strip().lower() in ("", "off", "none"):
        return None
    return Path(value).expanduser()


def enable_compilation_cache(path: Path | None) -> None:
    """Turn on JAX's persistent compilation cache in `path` (None: leave it off). Every program is
    kept, however fast it compiled: a restart should compile nothing."""
    if path is None:
        return
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
