"""Decode step time by the longest row's length: attention reads as far as that row, key chunk by chunk.

    python -m benchmarks.step_lengths                                  # demo pair, 8192 positions
    python -m benchmarks.step_lengths --key_chunks 64,128,256 --rounds 2

The server's engine (demo pair, `--dtype auto`, `--max_model_len`) and a `Scheduler` over its slots
time one step program at a time through the scheduler's own `run_step`, on rows whose lengths are all
`L` (the cache holds zeros: the step's cost does not depend on the values): a one-token step
(width 0) and a verify of T drafts, over 1 and 8 rows, for each L in `--lengths`. Each call is
made twice untimed (compile or load, first run), then `--reps` times; the median is printed, in ms.
With several `--key_chunks` (`kernels.paged_attention.KEY_CHUNK`) the rounds alternate between
them (programs are dropped and traced again for each), so the sizes are compared in one run.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags

_LENGTHS = flags.DEFINE_list("lengths", ["40", "200", "450", "1000", "3000", "7000"], "longest-row lengths")
_ROWS = flags.DEFINE_list("rows", ["1", "8"], "rows per step (batch buckets)")
_WIDTHS = flags.DEFINE_list("widths", ["0", "7"], "drafts verified (0: a one-token step)")
_CHUNKS = flags.DEFINE_list("key_chunks", [], "key positions per attention trip to compare (default: the "
                            "library's)")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 8192, "positions per slot (the block table's width)")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls per point", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 1, "passes over the key chunks, alternating; medians of all",
                               lower_bound=1)
_JSON = flags.DEFINE_string("output_json", None, "write the results here")


def main(argv):
    del argv
    import numpy as np

    from dspark_jax.decode import warmup
    from dspark_jax.decode.config import EngineConfig, SchedulerConfig
    from dspark_jax.decode.engine import Engine
    from dspark_jax.decode.scheduler import Scheduler
    from dspark_jax.hostinfo import describe_cpu
    from dspark_jax.kernels import paged_attention
    from dspark_jax.serving.pair import load_pair

    warmup.enable_compilation_cache(warmup.compilation_cache_dir(None))
    pair = load_pair()
    draft, config = EngineConfig().for_pair(pair.draft)
    eng = Engine(pair.target, draft, config)
    b = Scheduler(eng, SchedulerConfig(max(int(r) for r in _ROWS.value), _MAX_LEN.value))
    chunks = [int(c) for c in _CHUNKS.value] or [paged_attention.key_chunk()]
    lengths = [int(x) for x in _LENGTHS.value]
    if max(lengths) + eng.t + 1 > _MAX_LEN.value:
        raise app.UsageError(f"--lengths up to {max(lengths)} do not fit --max_model_len {_MAX_LEN.value}")
    print(f"demo pair, {np.dtype(eng.compute_dtype).name}, T = {eng.t}, {_MAX_LEN.value} positions; CPU: "
          f"{describe_cpu()}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    times: dict[tuple, list[float]] = {}
    for _ in range(_ROUNDS.value):
        for chunk in chunks:
            paged_attention.KEY_CHUNK = chunk
            eng.programs.clear()          # the chunk is fixed when a program is traced
            for rows in (int(r) for r in _ROWS.value):
                for width in (int(w) for w in _WIDTHS.value):
                    for n in lengths:
                        times.setdefault((chunk, rows, width, n), []).extend(
                            _time_step(b, rows, width, n, _REPS.value))
    results = []
    for chunk in chunks:
        for rows in (int(r) for r in _ROWS.value):
            for width in (int(w) for w in _WIDTHS.value):
                ms = {n: 1e3 * statistics.median(times[chunk, rows, width, n]) for n in lengths}
                results.append({"key_chunk": chunk, "rows": rows, "width": width, "ms_by_length": ms})
                print(f"key chunk {chunk}, {rows} rows, width {width}: "
                      + ", ".join(f"L={n} {v:.1f} ms" for n, v in ms.items()), flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"cpu": describe_cpu(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results}, f,
                      indent=1)


def _time_step(b, rows: int, width: int, length: int, reps: int) -> list[float]:
    import numpy as np

    from dspark_jax.sampling import GREEDY

    rows_B = np.arange(rows, dtype=np.int32)
    lens = np.full(rows, length, np.int32)
    x0 = np.zeros(rows, np.int32)
    drafts = np.zeros((rows, 0), np.int32) if width == 0 else None

    def call():       # run_step returns the step's tokens on the host: the wait is in the timing
        b.run_step(rows_B, x0, lens, rows, GREEDY, drafts, length=width)

    call()
    call()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    app.run(main)
