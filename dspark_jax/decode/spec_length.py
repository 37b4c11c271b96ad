"""How many drafts each decode step verifies: the length L in 0..T that maximises expected tokens
per second, from the acceptance measured so far and the measured cost of a step (docs/profile.md,
"Speculation length per step").

A step over B rows that verifies L drafts per row emits on average B * (1 + E[accepted | L])
tokens and takes c(B, L) seconds; L = 0 is a one-token step (no draft block; the draft's context
rows are still written, so speculation can resume at any step). The choice looks only at past
steps, never at the target's verdict on the current one, so greedy output stays the target's own.

- `AcceptanceEstimate`: P(draft k accepted | drafts before k were), pooled over every row and
  step of an engine, with a prior so it starts sensibly and keeps an estimate for positions it
  rarely verifies.
- `StepCosts`: c(B, L) by batch bucket, measured once per bucket on padding rows
  (`Scheduler.measure_step_costs`) and kept on disk as JSON, keyed by what decides the figures: the
  CPU model and its bf16 flags (or the GPU model), the device count, the JAX version, the model
  pair's configs, the dtypes, T, the page size, how attention reads the pool (its key chunk) and
  the library's source.
- `StepTimes`: the wall time of the steps the engine really ran (its host loop included), by batch
  bucket, length bucket (`Scheduler.time_bucket`: the positions its longest row reaches) and L. A
  measured table times the program alone, on padding rows (the shortest length); what a step
  costs in the loop can differ by more than the margin between two lengths, so the observed
  medians replace the table's figures, and the table, scaled by what was observed beside it,
  stands in for a length not run yet at that bucket. Observed figures expire after a few hundred
  steps, so a length is measured again now and then.
- `choose_length`: the argmax, a one-token step unless it wins by `GAIN_MARGIN`; a length not
  observed yet whose estimate comes within `EXPLORE_MARGIN` of the best is tried first, so its
  estimate is replaced by a measurement, if its program for the step's shape is compiled
  already: a compilation (seconds) costs more than the few steps a trial measures are worth.

`$DSPARK_STEP_COSTS` overrides where the tables live: a directory, "off" (measure, keep in memory
only) or "uniform" (assume every L costs the same as a one-token step: L is always T; what a
memory-bound accelerator at small batch amounts to, and what keeps test runs from measuring).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from dspark_jax.hostinfo import describe_cpu
from dspark_jax.kernels.dispatch import kernel_mode
from dspark_jax.kernels.paged_attention import key_chunk
from dspark_jax.presets import cache_dir

log = logging.getLogger("dspark_jax")

ENV_COSTS = "DSPARK_STEP_COSTS"
SPECULATIVE_LENGTHS = ("adaptive", "fixed")
# a length whose cost is only estimated is tried when its expected rate is within this factor of
# the best one's (a length far behind is not worth the steps to find out)
EXPLORE_MARGIN = 0.85
# a step verifies drafts only when that is expected to beat a one-token step by this factor: the
# expected rates carry the noise of in-loop times on a machine whose speed drifts, and a batch
# that must finish (`generate()`) waits for its slowest row, which gains less than the pooled
# acceptance says; at a near tie, one-token steps are the safe side
GAIN_MARGIN = 1.05


def candidate_lengths(t: int) -> tuple[int, ...]:
    """The lengths a step may verify: 0, then verify widths L + 1 that are powers of two (2, 4, 8
    tokens a row), and T. Each length is a compiled program per batch bucket, so the set
    is small; halving the width between candidates keeps the step from the best length within a
    factor of two of its verify work, and T = 7 (ATOM's default) gives exactly {0, 1, 3, 7}."""
    out, k = {0, t}, 1
    while (1 << k) - 1 < t:
        out.add((1 << k) - 1)
        k += 1
    return tuple(sorted(out))


class AcceptanceEstimate:
    """Conditional acceptance per draft position, pooled over steps and rows. Position k's
    estimate is (accepted_k + s * p_{k-1}) / (tried_k + s): its prior is the estimate of the
    position before it (the first one's: `prior`), so a position the steps rarely reach keeps a
    sensible value (acceptance seldom rises along the block). Counts are halved past `window`
    tries of the first position, so the estimate follows a workload that changes."""

    def __init__(self, t: int, prior: float = 0.6, strength: float = 8.0, window: int = 4096):
        self.t, self.prior, self.strength, self.window = t, prior, strength, window
        self.tried_K = np.zeros(t)
        self.accepted_K = np.zeros(t)

    def observe(self, verified: int, accepted: int) -> None:
        """One row of a step: `verified` drafts scored, the first `accepted` of them accepted
        (the one after them, if scored, was rejected)."""
        if verified <= 0:
            return
        self.tried_K[:min(accepted + 1, verified)] += 1
        self.accepted_K[:accepted] += 1
        if self.tried_K[0] > self.window:
            self.tried_K /= 2
            self.accepted_K /= 2

    def conditional(self) -> np.ndarray:
        """[T] P(draft k accepted | drafts before it were)."""
        out, prev = np.zeros(self.t), self.prior
        for k in range(self.t):
            prev = out[k] = (self.accepted_K[k] + self.strength * prev) / (self.tried_K[k] + self.strength)
        return out

    def expected_accepted(self, lengths) -> dict[int, float]:
        """E[drafts accepted] of a step verifying L drafts, for each L in `lengths`."""
        survival = np.concatenate([[0.0], np.cumsum(np.cumprod(self.conditional()))])
        return {int(n): float(survival[n]) for n in lengths}


class StepCosts:
    """Seconds of one decode step by batch bucket (rows) and verified length: measured tables
    (`table`, persisted at `path`), or a function of (rows, length) (an injected model; tests).
    `uniform()`: every length costs the same (L is always T: nothing to measure)."""

    def __init__(self, table: dict[int, dict[int, float]] | None = None, *, path: Path | None = None,
                 key: dict | None = None, fn: Callable[[int, int], float] | None = None, uniform: bool = False):
        self.table = {int(b): {int(n): float(s) for n, s in c.items()} for b, c in (table or {}).items()}
        self.path, self.key, self.fn, self.uniform = path, key, fn, uniform

    @classmethod
    def of(cls, fn: Callable[[int, int], float]) -> "StepCosts":
        """A cost model given as a function `fn(rows, length) -> seconds` (nothing measured)."""
        return cls(fn=fn)

    @classmethod
    def constant(cls) -> "StepCosts":
        return cls(fn=lambda rows, length: 1.0, uniform=True)

    def get(self, rows: int, lengths) -> dict[int, float] | None:
        """{length: seconds} for a step over `rows` rows, None when not measured yet."""
        if self.fn is not None:
            return {n: float(self.fn(rows, n)) for n in lengths}
        got = self.table.get(rows)
        return got if got is not None and all(n in got for n in lengths) else None

    def put(self, rows: int, costs: dict[int, float]) -> None:
        """Record a measured bucket and write the table (atomically) where it is kept."""
        self.table[rows] = {int(n): float(s) for n, s in costs.items()}
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"key": self.key, "seconds_by_rows_and_length":
                {str(b): {str(n): s for n, s in sorted(c.items())} for b, c in sorted(self.table.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, self.path)

    @property
    def measured(self) -> bool:
        """Figures measured where the engine runs (not a cost model given as a function, nor uniform)."""
        return self.fn is None and not self.uniform

    def reachable(self, lengths) -> tuple[int, ...]:
        """The lengths `choose_length` can pick (all of them unless costs are uniform)."""
        return (max(lengths),) if self.uniform else tuple(lengths)

    @classmethod
    def load(cls, directory: Path, key: dict) -> "StepCosts":
        """The table kept for `key` in `directory` (empty if none, or if the file is unreadable)."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        path = directory / f"{digest}.json"
        table = {}
        try:
            body = json.loads(path.read_text())
            if body.get("key") == key:
                table = body["seconds_by_rows_and_length"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls(table, path=path, key=key)


class StepTimes:
    """Wall seconds of the decode steps an engine ran, host work included, by (batch bucket, length
    bucket, speculation length): the last `window` of each, from the last `horizon` steps the
    engine ran. The first step of each key is not kept: it may compile or load its program. A key
    counts as observed from `min_seen` such steps on. Figures expire so that a length measured
    during a slow moment of the machine (a length the choice then avoids, so nothing would replace
    its figures) is measured again, as a length not observed is (`choose_length`)."""

    def __init__(self, window: int = 16, min_seen: int = 3, horizon: int = 256):
        self.window, self.min_seen, self.horizon = window, min_seen, horizon
        self.clock = 0                   # steps observed so far, of every key
        self._times: dict[tuple, collections.deque] = {}

    def observe(self, rows: int, bucket: int, length: int, seconds: float) -> None:
        self.clock += 1
        key = (rows, bucket, length)
        if key not in self._times:
            self._times[key] = collections.deque(maxlen=self.window)     # the first one: compiling
            return
        self._times[key].append((self.clock, seconds))

    def _recent(self, key: tuple) -> list[float]:
        return [s for at, s in self._times.get(key, ()) if self.clock - at < self.horizon]

    def seen(self) -> dict[tuple, int]:
        """Steps kept (not expired) per (rows, length bucket, speculation length)."""
        return {k: len(self._recent(k)) for k in self._times}

    def expired(self, rows: int, bucket: int, length: int) -> bool:
        """Not observed now because figures it had grew too old (not because too few were taken yet)."""
        got = self._times.get((rows, bucket, length), ())
        return (any(self.clock - at >= self.horizon for at, _ in got)
                and len(self._recent((rows, bucket, length))) < self.min_seen)

    def median(self, rows: int, bucket: int, length: int) -> float | None:
        got = self._recent((rows, bucket, length))
        return float(np.median(got)) if len(got) >= self.min_seen else None

    def corrected(self, rows: int, bucket: int, table: dict[int, float]) -> tuple[dict[int, float], tuple[int, ...]]:
        """({length: seconds}, lengths not observed yet) for steps over `rows` rows at length bucket `bucket`: the
        observed median where there is one, else the table's figure times the median ratio of
        observed to table figures at this bucket (the table itself when nothing was observed)."""
        seen = {n: m for n in table if (m := self.median(rows, bucket, n)) is not None}
        scale = float(np.median([seen[n] / table[n] for n in seen])) if seen else 1.0
        costs = {n: seen[n] if n in seen else table[n] * scale for n in table}
        return costs, tuple(n for n in table if n not in seen)


def costs_for(engine) -> StepCosts:
    """The step-cost tables of `engine`'s programs on the host it runs on, as `$DSPARK_STEP_COSTS` says
    (default: `<dspark cache>/step_costs`, beside the compilation cache)."""

    value = os.environ.get(ENV_COSTS)
    if value is not None and value.strip().lower() == "uniform":
        return StepCosts.constant()
    key = cost_key(engine)
    if value is not None and value.strip().lower() in ("", "off", "none"):
        return StepCosts(key=key)
    directory = Path(value).expanduser() if value is not None else cache_dir() / "step_costs"
    return StepCosts.load(directory, key)


def cost_key(engine) -> dict:
    """What a step's measured time depends on besides the batch and L."""


    dev = jax.devices()[0]
    configs = repr(engine.target.cfg) + "|" + repr(engine.draft.cfg if engine.draft is not None else None)
    return {"hardware": describe_cpu() if dev.platform == "cpu" else f"{dev.platform} {dev.device_kind}",
            "devices": jax.device_count(), "jax": jax.__version__,
            "model": hashlib.sha256(configs.encode()).hexdigest()[:16],
            "dtype": str(np.dtype(engine.compute_dtype)), "kv_storage": str(np.dtype(engine.store_dtype)),
            "num_speculative_tokens": engine.t, "page_size": engine.page_size,
            "serving_layout": engine.serving is not None, "kernels": kernel_mode(),
            # how attention reads the pool: tables measured with other reads (e.g. one-piece span
            # gathers, which had no such field) cost differently and are not reused
            "attention_key_chunk": key_chunk(),
            # the library's own source: a table measured by other code (another release, an edit to
            # a step function) may cost differently and is measured again
            "code": source_digest()}


@functools.cache
def source_digest() -> str:
    """A digest of the dspark_jax package's Python source."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def choose_length(acceptance: AcceptanceEstimate, costs: dict[int, float], unseen=(),
                  margin: float = EXPLORE_MARGIN, *, uncompiled=(), expired=(), gain: float = GAIN_MARGIN) -> int:
    """The length of highest expected tokens per second, (1 + E[accepted | L]) / c(L) (the rows
    are the same for every L); the shorter one among equals; L = 0 unless the best rate is `gain`
    times L = 0's or more. Among `unseen` lengths (costs only estimated), the best one within
    `margin` of the best rate goes first: running it measures it, unless it is `uncompiled` (no
    program for this step's shape yet: not compiled to explore).
    L = 0 is tried whatever its estimate unless it is among the `expired` (measured before, its
    figures too old to count: then it must come within the margin like the others): a one-token
    step is what decoding without a draft costs, the bar every other length is chosen against,
    and a table measured on padding rows can misstate it against the others by more than the
    margins speculation wins by."""
    expected = acceptance.expected_accepted(costs)
    rate = {n: (1.0 + expected[n]) / costs[n] for n in costs}
    best = max(costs, key=lambda n: (rate[n], -n))
    if 0 in rate and rate[best] < gain * rate[0]:
        best = 0
    trial = [n for n in unseen if n != best and n not in uncompiled
             and ((n == 0 and n not in expired) or rate[n] >= margin * rate[best])]
    return max(trial, key=lambda n: (rate[n], -n)) if trial else best


COST_REPS = 5             # timed rounds over the lengths per bucket; the fastest of each is kept


class LengthChoice:
    """The speculation length of each step of one scheduler: the lengths it may verify (T alone
    when fixed or plain, else `candidate_lengths`), the step-cost table (the engine's measured one
    unless given) and the argmax over them, corrected by the engine's observed step times.

    `program_called(rows, length, sampled)` says whether the step program a length would run is
    compiled already; `time_step(rows, length)` times one greedy step over padding rows (for
    measuring a bucket's costs)."""

    def __init__(self, engine, speculative_length: str, step_costs: StepCosts | None,
                 program_called: Callable[[int, int, bool], bool], time_step: Callable[[int, int], float]):
        self.engine = engine
        self.lengths = (candidate_lengths(engine.t) if engine.t and speculative_length == "adaptive"
                        else (engine.t,))
        self._step_costs = step_costs        # None: the engine's measured ones (resolved on first use)
        self._program_called, self._time_step = program_called, time_step

    @property
    def adaptive(self) -> bool:
        return len(self.lengths) > 1

    @property
    def step_costs(self) -> StepCosts:
        if self._step_costs is None:
            self._step_costs = self.engine.step_costs()
        return self._step_costs

    def reachable(self) -> tuple[int, ...]:
        """The lengths steps can verify (what the warm-up compiles)."""
        return self.step_costs.reachable(self.lengths) if self.adaptive else self.lengths

    def choose(self, rows: int, bucket: int, *, sampled: bool = False) -> int:
        """The length of a step over `rows` rows (a batch bucket) whose longest row reaches `bucket`
        positions (`buckets.time_bucket`); measures the batch bucket's step costs first if they are
        not known yet. Measured costs are corrected by the steps run so far at that length bucket
        (`StepTimes`); a length is tried to measure it only where its program for this step
        (`sampled`) has been compiled."""
        reachable = self.reachable()
        if len(reachable) == 1:              # a fixed length, or uniform costs: all the drafts
            return reachable[0]
        costs = self.step_costs.get(rows, self.lengths)
        if costs is None:
            costs = self.measure(rows)
        unseen, uncompiled, expired = (), (), ()
        if self.step_costs.measured:
            times = self.engine.step_times
            costs, unseen = times.corrected(rows, bucket, costs)
            if unseen:
                uncompiled = [n for n in unseen if not self._program_called(rows, n, sampled)]
                expired = [n for n in unseen if times.expired(rows, bucket, n)]
        return choose_length(self.engine.acceptance, costs, unseen, uncompiled=uncompiled, expired=expired)

    def measure(self, rows: int, *, reps: int = COST_REPS) -> dict[int, float]:
        """Time a greedy step over `rows` padding rows at each length: one call per length to compile
        (or load) its program, then `reps` rounds over the lengths in turn (a slow moment of the
        machine then hits every length alike), the fastest of each; recorded in the step-cost table
        (and its file). Logs a line per length."""
        start = time.perf_counter()
        for i, n in enumerate(self.lengths):
            self._time_step(rows, n)
            log.info("step costs, %d rows: length %d compiled (%d/%d, %.1f s)", rows, n, i + 1, len(self.lengths),
                     time.perf_counter() - start)
        times = {n: [] for n in self.lengths}
        for _ in range(reps):
            for n in self.lengths:
                times[n].append(self._time_step(rows, n))
        costs = {n: min(ts) for n, ts in times.items()}
        log.info("step costs, %d rows: %s", rows, ", ".join(f"length {n} {1e3 * c:.2f} ms" for n, c in costs.items()))
        self.step_costs.put(rows, costs)
        return costs
