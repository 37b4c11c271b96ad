"""Continuous batching over cache slots: the one scheduling loop that `generate()`, the HTTP
server, the benchmark and answer generation drive.

`Request` is one sequence (its prompt, limits, sampling and what it produced); `Scheduler` admits
waiting requests into free slots, runs at most one prefill call of at most
`max_num_batched_tokens` prompt tokens (a long prompt goes in chunk by chunk over several steps,
holding its slot meanwhile), then runs one propose/verify `Engine.step` over the sequences whose
prompt is in and hands the emitted tokens back. So a long prompt stalls the running streams for
one chunk at a time, not for its whole prefill. Without a budget (offline batches) every admitted
prompt goes in at once, in calls of prompts of like length (`prefill_groups`).

Every program call computes only the rows it needs, padded to a batch bucket (1, 2, 4, ... up to
the slot count; `batch_bucket`), and its attention reads keys only as far as its longest row
reaches (`dspark_jax.kernels.paged_attention`): one user on an 8-slot server pays for one row, and a
short sequence in a long-context server for its own length, with one program for every length. The
pool and the slots stay as allocated; the rows carry their slot numbers (`Engine.step_fn`'s `rows_B`).

Each step verifies L drafts, L chosen for the step from the engine's pooled acceptance and the
measured cost of a step over its batch bucket (`dspark_jax.decode.spec_length`; `speculative_length=
"fixed"`: always T). A bucket whose costs are not known yet is measured when first met
(`measure_step_costs`, a few timed steps on padding rows per length), once per host and model;
the wall time of every step run then corrects those figures (`StepTimes`). The choice itself is
`spec_length.LengthChoice`; the shape buckets are `dspark_jax.decode.buckets`.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from dspark_jax.decode.buckets import batch_bucket, chunk_bucket, prefill_groups, time_bucket
from dspark_jax.decode.config import SchedulerConfig, check_prompt
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.spec_length import LengthChoice, StepCosts
from dspark_jax.decode.stats import SpecStats
from dspark_jax.errors import RequestError
from dspark_jax.sampling import GREEDY, SamplingParams

log = logging.getLogger("dspark_jax")

_KEYS_PER_SPLIT = 64      # PRNG keys split off at once (`Scheduler._next_key`)


@dataclass(eq=False)
class Request:
    """One sequence in the scheduler: its prompt, limits and sampling, and what it produced."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    eos_ids: frozenset[int] = frozenset()
    stop_check: Callable[[list[int]], bool] | None = None
    index: int = 0                         # the caller's tag (the prompt index for a proposer)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None       # "stop", "length" or "abort" once finished
    stats: SpecStats | None = None
    slot: int | None = None
    prefilled: int = 0                     # prompt tokens already in the cache (chunked prefill)


class Scheduler:
    """Continuous batching over `max_num_seqs` cache slots of capacity `max_len` tokens.

    Each `step()` admits waiting requests into free slots, runs one prefill call of at most
    `max_num_batched_tokens` padded prompt tokens over the admitted requests whose prompt is not
    yet in (just their rows; the other slots' caches are untouched), and then one propose/verify
    step over every decoding slot, padded to a batch bucket. Sampling settings are per row
    (`Engine`): requests of different settings share each call. Finished or aborted requests free
    their slot at once. `generate()`, the HTTP server and the benchmark all drive this loop.

    Prefill calls take one of two forms (few compiled programs): the first chunks of newly admitted
    prompts, rows x chunk bucket <= the budget, each prompt's first `max_num_batched_tokens` tokens;
    or the next chunk of the one prompt longer than that, alone, at the full chunk width, continuing
    from the KDA state and cache rows its slot holds.
    `max_num_batched_tokens=None`: no bound, whole prompts, every admitted one in the same step, in
    the calls `prefill_groups` splits them into (offline batches: `generate()`, answer generation,
    where no stream waits and admitting all at once gives the widest decode steps)."""

    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig(), *, seed: int = 0,
                 proposer=None):
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        max_num_seqs, max_len = config.max_num_seqs, config.max_len_for(engine.target)
        check_prompt(1, engine.t, max_len, "max_model_len")
        self.engine, self.num_slots, self.max_len = engine, max_num_seqs, max_len
        self.length_choice = LengthChoice(engine, config.speculative_length, config.step_costs,
                                          program_called=self._program_called, time_step=self._time_padding_step)
        self.caches = engine.new_caches(max_num_seqs, max_len)
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.lens = np.zeros(max_num_seqs, np.int32)       # tokens in the cache (= next position)
        self.x0 = np.zeros(max_num_seqs, np.int32)         # last emitted token, the next anchor
        self.waiting: collections.deque[Request] = collections.deque()
        # admitted, holding a slot, prompt not yet whole in the cache (admission order); only the
        # first can be part-way through (`_next_chunks`)
        self.filling: list[Request] = []
        self.stats = SpecStats(engine.t)                   # cumulative over every request
        self.num_steps = 0                                 # verify/decode steps run
        self.proposer = proposer
        self._key = jax.random.PRNGKey(seed)
        self._keys: collections.deque[np.ndarray] = collections.deque()

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.length_choice.lengths

    @property
    def adaptive(self) -> bool:
        return self.length_choice.adaptive

    @property
    def step_costs(self) -> StepCosts:
        return self.length_choice.step_costs

    def reachable_lengths(self) -> tuple[int, ...]:
        """The lengths steps can verify (what the warm-up compiles)."""
        return self.length_choice.reachable()

    def measure_step_costs(self, rows: int) -> dict[int, float]:
        """Measure the step costs of a batch bucket of `rows` rows (`LengthChoice.measure`)."""
        return self.length_choice.measure(rows)

    def _program_called(self, rows: int, length: int, sampled: bool) -> bool:
        return self._program_key(rows, length, sampled) in self.engine.programs_called

    def _program_key(self, rows: int, length: int | None, sampled: bool, given: int | None = None) -> "StepProgram":
        """The step program a call over `rows` rows verifying `length` drafts (None: T) runs;
        `given`: the width of drafts passed in (None: the draft model drafts)."""
        t = self.engine.t
        if given is None and t and (length == 0 or self.proposer is not None):
            given = t if length is None else length          # a one-token step: empty given drafts
        # L = T is the program a fixed-length step runs too (one compilation for both)
        width = None if given is not None or length is None or length == t else length
        return StepProgram(self.num_slots, self.max_len, rows, width, given, sampled)

    def _time_padding_step(self, rows: int, length: int) -> float:
        """Seconds of one greedy step over `rows` padding rows verifying `length` drafts (nothing
        written; their attention reads one key chunk, and grows with the context for every length
        alike)."""
        rows_B = np.full(rows, self.num_slots, np.int32)
        zeros = np.zeros(rows, np.int32)
        key = np.asarray(jax.random.PRNGKey(0))      # the requests' key stream stays as it is
        # an engine without a draft model verifies given drafts (an external proposer's)
        given = np.zeros((rows, length), np.int32) if self.engine.draft is None else None
        t0 = time.perf_counter()
        out = self._step_call(rows_B, zeros, zeros, np.zeros(rows, bool), GREEDY, given, length, key)
        np.asarray(out[0])
        return time.perf_counter() - t0

    def reset_stats(self) -> None:
        """Forget the statistics so far (the server's warm-up steps are not served traffic)."""
        self.stats, self.num_steps = SpecStats(self.engine.t), 0

    @property
    def num_running(self) -> int:
        """Requests holding a slot (decoding, or their prompt going in)."""
        return sum(s is not None for s in self.slots) + len(self.filling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def check(self, req: Request) -> None:
        """Raise RequestError if `req` can never run in this scheduler."""
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        check_prompt(len(req.prompt), self.engine.t, self.max_len)

    def add(self, req: Request) -> None:
        self.check(req)
        req.stats = SpecStats(self.engine.t)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request (waiting or running); its slot is free for the next step."""
        if req.finish_reason is not None:
            return
        if req.slot is not None:
            self._finish(req, "abort")
            return
        req.finish_reason = "abort"
        if req in self.waiting:
            self.waiting.remove(req)

    def run(self, reqs: Sequence[Request]) -> list[Request]:
        """Add `reqs` and step until every one of them has finished."""
        for r in reqs:
            self.add(r)
        while any(r.finish_reason is None for r in reqs):
            self.step()
        return list(reqs)

    def step(self) -> list[Request]:
        """Admit, then one decode step. Returns the requests that got tokens (or finished).
        If a step raises, the running requests are aborted and the caches rebuilt (a failed
        call may have consumed the donated cache buffers); waiting requests stay queued."""
        try:
            touched = self._admit()
            for r in self._decode():
                if r not in touched:
                    touched.append(r)
        except Exception:
            for r in [*self.slots, *self.filling]:
                if r is not None:
                    self._finish(r, "abort")
            self.caches = self.engine.new_caches(self.num_slots, self.max_len)
            raise
        return touched

    def _next_key(self) -> np.ndarray:
        """A fresh PRNG key for one program call, as a host array. Keys are split off 64 at a time:
        one `jax.random.split` dispatch per step cost ~0.8 ms of host time at batch 1 on CPU."""
        if not self._keys:
            keys = np.asarray(jax.random.split(self._key, _KEYS_PER_SPLIT + 1))
            self._key = keys[0]
            self._keys.extend(keys[1:])
        return self._keys.popleft()

    def _admit(self) -> list[Request]:
        """Admit waiting requests into free slots, then run one prefill call (`_next_chunks`), or
        without a token budget as many as it takes to put every admitted prompt in. Returns the
        requests whose prompt is now whole in the cache (each has its first token)."""
        held = {r.slot for r in self.filling}
        free = [i for i, s in enumerate(self.slots) if s is None and i not in held]
        while free and self.waiting:
            req = self.waiting.popleft()
            req.slot, req.prefilled = free.pop(0), 0
            self.filling.append(req)
        done = []
        while self.filling:
            done += self._prefill_call(self._next_chunks())
            if self.max_num_batched_tokens is not None:
                break                          # one call a step: the running streams wait for no more
        return done

    def _prefill_call(self, chunks: list[tuple[Request, int]]) -> list[Request]:
        """One prefill call of `chunks` (request, tokens); returns the requests whose prompt is now
        whole in the cache."""
        head = chunks[0][0]
        budget = self.max_num_batched_tokens
        width = budget if head.prefilled else chunk_bucket(max(n for _, n in chunks), budget)
        rows = self.batch_rows([r.slot for r, _ in chunks])
        tokens = np.zeros((len(rows), width), np.int32)
        lens, starts = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
        for j, (r, n) in enumerate(chunks):
            tokens[j, :n] = r.prompt[r.prefilled:r.prefilled + n]
            lens[j], starts[j] = n, r.prefilled
        first = self.run_prefill(tokens, lens, rows, batch_sampling([r for r, _ in chunks], len(rows)), starts)
        done = []
        for j, (r, n) in enumerate(chunks):
            r.prefilled += n
            if r.prefilled < len(r.prompt):
                continue                       # its next chunk runs in the next step
            self.filling.remove(r)
            self.slots[r.slot] = r
            self.lens[r.slot], self.x0[r.slot] = r.prefilled, first[j]
            r.tokens.append(int(first[j]))
            self._maybe_finish(r)
            done.append(r)
        return done

    def _next_chunks(self) -> list[tuple[Request, int]]:
        """(request, tokens) of the next prefill call: the oldest admitted request's next chunk;
        when that is a first chunk, the first chunks of newer requests beside it while rows (batch
        bucket) x chunk bucket stays within the budget. A prompt longer than the budget therefore
        goes in alone, and is the only one part-way through. Without a budget: the first of the
        calls `prefill_groups` splits the admitted prompts into."""
        budget = self.max_num_batched_tokens
        head = self.filling[0]
        if budget is None:
            group = prefill_groups([len(r.prompt) for r in self.filling], self.num_slots)[0]
            return [(self.filling[i], len(self.filling[i].prompt)) for i in group]
        chunks = [(head, min(len(head.prompt) - head.prefilled, budget))]
        if head.prefilled:
            return chunks
        for r in self.filling[1:]:
            n = min(len(r.prompt), budget)
            width = chunk_bucket(max(n, *(c for _, c in chunks)), budget)
            if batch_bucket(len(chunks) + 1, self.num_slots) * width <= budget:
                chunks.append((r, n))
        return chunks

    def _decode(self) -> list[Request]:
        # the step computes the running slots only, padded to a batch bucket
        slots = [i for i, s in enumerate(self.slots) if s is not None]
        if not slots:
            return []
        m = len(slots)
        rows = self.batch_rows(slots)
        x0, lens = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
        x0[:m], lens[:m] = self.x0[slots], self.lens[slots]
        t = self.engine.t
        sampling = batch_sampling([self.slots[i] for i in slots], len(rows))
        # step times are kept by the positions a speculative step would reach (one key for every length)
        bucket = time_bucket(int(lens[:m].max()) + t + 1, self.max_len)
        length = self.length_choice.choose(len(rows), bucket, sampled=sampling.sampled) if t else 0
        started = time.perf_counter()
        drafts = None
        if t and not length:    # no drafts this step: a one-token step (the draft's context rows are still written)
            drafts = np.zeros((len(rows), 0), np.int32)
        elif self.proposer is not None:
            drafts = np.zeros((len(rows), length), np.int32)
            for j, i in enumerate(slots):
                drafts[j] = self.proposer(self.slots[i].index, self.slots[i].tokens, t)[:length]
        n, emitted = self.run_step(rows, x0, lens, m, sampling, drafts, length=length)
        self.num_steps += 1
        touched = []
        for j, i in enumerate(slots):
            r = self.slots[i]
            if t and not length:
                r.stats.plain()
                self.stats.plain()
            elif t:
                r.stats.update(int(n[j]), length)
                self.stats.update(int(n[j]), length)
                # drafts scored: the length, less what the room left before max_len cut off
                self.engine.acceptance.observe(min(length, self.max_len - int(lens[j]) - 1), int(n[j]))
            new = [int(x) for x in emitted[j, :n[j] + 1]]
            self.lens[i] += n[j] + 1
            self.x0[i] = new[-1]
            for tok in new:
                r.tokens.append(tok)
                if self._maybe_finish(r):
                    break
            if r.finish_reason is None and self.lens[i] >= self.max_len:
                self._finish(r, "length")      # the next anchor has no cache position left
            touched.append(r)
        if t:
            self.engine.step_times.observe(len(rows), bucket, length, time.perf_counter() - started)
        return touched

    def batch_rows(self, slots: Sequence[int]) -> np.ndarray:
        """The slot of each row of a program call over `slots`: them, then padding rows (slot =
        the number of slots: inactive, writing nothing) up to the batch bucket."""
        rows = np.full(batch_bucket(max(len(slots), 1), self.num_slots), self.num_slots, np.int32)
        rows[:len(slots)] = slots
        return rows

    def run_prefill(self, tokens_PS: np.ndarray, lens_P: np.ndarray, slots_P: np.ndarray, sampling: SamplingParams,
                    starts_P: np.ndarray | None = None) -> np.ndarray:
        """One prefill call of prompt chunks at positions `starts_P`.. (None: 0; rows past the
        prompts: slot = number of slots, length 0); the tokens sampled after each chunk (at
        `sampling`: numbers or per-row arrays). The
        warm-up (`dspark_jax.decode.warmup`) calls it with padding rows only."""
        if starts_P is None:
            starts_P = np.zeros(len(lens_P), np.int32)
        first, self.caches = self.engine.prefill(tokens_PS, lens_P, slots_P, self.caches, self._next_key(),
                                                 starts_P=starts_P, sampling=sampling)
        return np.asarray(first)

    def run_step(self, rows_B: np.ndarray, x0_B: np.ndarray, lens_B: np.ndarray, num_active: int,
                 sampling: SamplingParams, drafts_BT: np.ndarray | None = None, *, length: int | None = None):
        """One decode step over the rows `rows_B` (`batch_rows`), the first `num_active` of them
        running, verifying `length` drafts of the draft's block (None: T) or `drafts_BT`.
        Returns (accepted [B], emitted [B, T+1]) on the host. The warm-up calls it with
        `num_active = 0`."""
        active = np.arange(len(rows_B)) < num_active
        n, emitted = self._step_call(rows_B, x0_B, lens_B, active, sampling, drafts_BT, length,
                                     self._next_key())
        return np.asarray(n), np.asarray(emitted)

    def _step_call(self, rows_B, x0_B, lens_B, active_B, sampling, drafts_BT, length, key):
        eng = self.engine
        if eng.t and length == 0 and drafts_BT is None:
            drafts_BT = np.zeros((len(rows_B), 0), np.int32)
        program = self._program_key(len(rows_B), length, sampling.sampled,
                                    None if drafts_BT is None else drafts_BT.shape[1])
        # host arrays go to the program as they are (jit's own transfer; a jnp.asarray per input
        # cost more host time per step)
        n, emitted, self.caches = eng.step(x0_B, lens_B, active_B, np.int32(self.max_len), self.caches, key,
                                           rows_B=rows_B, drafts_BT=drafts_BT, sampling=sampling,
                                           width=program.width, tag=program)
        return n, emitted

    def _maybe_finish(self, r: Request) -> bool:
        out = r.tokens
        if out[-1] in r.eos_ids or (r.stop_check is not None and r.stop_check(out)):
            self._finish(r, "stop")
        elif len(out) >= r.max_new_tokens:
            self._finish(r, "length")
        return r.finish_reason is not None

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r in self.filling:
            self.filling.remove(r)
        else:
            self.slots[r.slot] = None
        r.slot = None


class StepProgram(NamedTuple):
    """What tells one compiled step program from another (`Engine.programs_called`)."""
    slots: int                 # the cache geometry
    max_len: int
    rows: int
    width: int | None          # drafts of the draft's block verified (None: all T)
    given: int | None          # width of drafts passed in (0: a one-token step)
    sampled: bool


def batch_sampling(reqs: Sequence[Request], rows: int) -> SamplingParams:
    """The per-row sampling settings of a program call over `reqs` padded to `rows` rows (padding
    rows greedy)."""
    return SamplingParams.batch([r.sampling for r in reqs], rows)
