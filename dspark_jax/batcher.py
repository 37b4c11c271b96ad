"""Continuous batching over cache slots: the one scheduling loop that `generate()`, the HTTP
server, the benchmark and answer generation drive.

`Request` is one sequence (its prompt, limits, sampling and what it produced); `Batcher` admits
waiting requests into free slots (one prefill of just the new rows), then runs one propose/verify
`Engine.step` over every occupied slot and hands the emitted tokens back.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.engine import Engine, sampling_key
from dspark_jax.errors import RequestError
from dspark_jax.schedule import verify_lengths
from dspark_jax.stats import SpecStats

_KEYS_PER_SPLIT = 64      # PRNG keys split off at once (`Batcher._next_key`)


@dataclass(eq=False)
class Request:
    """One sequence in the batcher: its prompt, limits and sampling, and what it produced."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: frozenset[int] = frozenset()
    stop_check: Callable[[list[int]], bool] | None = None
    index: int = 0                         # the caller's tag (the prompt index for a proposer)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None       # "stop", "length" or "abort" once finished
    stats: SpecStats | None = None
    slot: int | None = None

    @property
    def sampling(self) -> tuple[float, float]:
        return sampling_key(self.temperature, self.top_p)


class Batcher:
    """Continuous batching over `max_num_seqs` cache slots of capacity `max_len` tokens.

    Each `step()` admits waiting requests into free slots (one prefill of just the new rows; the
    other slots' caches are untouched) and then runs one propose/verify step over the occupied
    slots. Slots whose requests use another sampling setting sit that step out (they are
    inactive rows) and go next, round robin. Finished or aborted requests free their slot at
    once. `generate()`, the HTTP server and the benchmark all drive this loop."""

    def __init__(self, engine: Engine, max_num_seqs: int, max_len: int, *, seed: int = 0, proposer=None,
                 disable_by_batch_size: int | None = None):
        if max_num_seqs < 1:
            raise RequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if disable_by_batch_size is not None and disable_by_batch_size < 1:
            raise RequestError(f"speculative_disable_by_batch_size must be >= 1, got {disable_by_batch_size}")
        # steps over this many sequences or more run without drafts (EngineConfig.disable_by_batch_size)
        self.disable_by_batch_size = disable_by_batch_size
        self.engine, self.num_slots, self.max_len = engine, max_num_seqs, max_len
        self.caches = engine.new_caches(max_num_seqs, max_len)
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.lens = np.zeros(max_num_seqs, np.int32)       # tokens in the cache (= next position)
        self.x0 = np.zeros(max_num_seqs, np.int32)         # last emitted token, the next anchor
        self.waiting: collections.deque[Request] = collections.deque()
        self.stats = SpecStats(engine.t)                   # cumulative over every request
        self.num_steps = 0                                 # verify/decode steps run
        self.proposer = proposer
        self._key = jax.random.PRNGKey(seed)
        self._keys: collections.deque[np.ndarray] = collections.deque()
        self._turn = 0

    def reset_stats(self) -> None:
        """Forget the statistics so far (the server's warm-up steps are not served traffic)."""
        self.stats, self.num_steps = SpecStats(self.engine.t), 0

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def check(self, req: Request) -> None:
        """Raise RequestError if `req` can never run in this batcher."""
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = len(req.prompt) + self.engine.t + 1
        if need > self.max_len:
            raise RequestError(f"prompt of {len(req.prompt)} tokens (+{self.engine.t + 1} for one verify "
                               f"step) exceeds max_model_len={self.max_len}")

    def add(self, req: Request) -> None:
        self.check(req)
        req.stats = SpecStats(self.engine.t)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request (waiting or running); its slot is free for the next step."""
        if req.finish_reason is not None:
            return
        req.finish_reason = "abort"
        if req.slot is not None:
            self.slots[req.slot] = None
            req.slot = None
        elif req in self.waiting:
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
            for r in self.slots:
                if r is not None:
                    self._finish(r, "abort")
            self.caches = self.engine.new_caches(self.num_slots, self.max_len)
            raise
        return touched

    def _span(self, n: int) -> int | None:
        """Positions a step must see, bucketed to powers of two (few compilations); None = all."""
        span = max(pow2(n), 64)
        return None if span >= self.max_len else span

    def _next_key(self) -> np.ndarray:
        """A fresh PRNG key for one program call, as a host array. Keys are split off 64 at a time:
        one `jax.random.split` dispatch per step cost ~0.8 ms of host time at batch 1 on CPU."""
        if not self._keys:
            keys = np.asarray(jax.random.split(self._key, _KEYS_PER_SPLIT + 1))
            self._key = keys[0]
            self._keys.extend(keys[1:])
        return self._keys.popleft()

    def _admit(self) -> list[Request]:
        free = [i for i, s in enumerate(self.slots) if s is None]
        new: list[Request] = []
        while free and self.waiting:
            req = self.waiting.popleft()
            req.slot = free.pop(0)
            self.slots[req.slot] = req
            new.append(req)
        groups: dict[tuple[float, float], list[Request]] = {}
        for r in new:
            groups.setdefault(r.sampling, []).append(r)
        eng = self.engine
        for (temperature, top_p), reqs in groups.items():
            p = min(pow2(len(reqs)), self.num_slots)
            s = prefill_bucket(max(len(r.prompt) for r in reqs))
            tokens = np.zeros((p, s), np.int32)
            lens = np.zeros(p, np.int32)
            slots = np.full(p, self.num_slots, np.int32)      # padding rows: out of range, dropped
            for j, r in enumerate(reqs):
                tokens[j, :len(r.prompt)] = r.prompt
                lens[j], slots[j] = len(r.prompt), r.slot
            first, self.caches = eng.prefill(tokens, lens, slots, self.caches, self._next_key(),
                                             temperature=temperature, top_p=top_p, span=self._span(s))
            first = np.asarray(first)
            for j, r in enumerate(reqs):
                self.lens[r.slot], self.x0[r.slot] = lens[j], first[j]
                r.tokens.append(int(first[j]))
                self._maybe_finish(r)
        return new

    def _decode(self) -> list[Request]:
        running = [s for s in self.slots if s is not None]
        if not running:
            return []
        groups = list(dict.fromkeys(r.sampling for r in running))
        temperature, top_p = groups[self._turn % len(groups)]
        self._turn += 1
        active = np.array([s is not None and s.sampling == (temperature, top_p) for s in self.slots])
        eng, t = self.engine, self.engine.t
        off = self.disable_by_batch_size
        plain = bool(t) and off is not None and int(active.sum()) >= off
        # a one-token step needs no room for drafts: the span bucket a plain engine would use
        span = self._span(int(self.lens[active].max()) + (0 if plain else t) + 1)
        given = logits = limits = None
        if plain:     # no drafts this step: a one-token step (the draft's context rows are still written)
            given = jnp.zeros((self.num_slots, 0), jnp.int32)
        elif self.proposer is not None:
            given = jnp.asarray([self.proposer(s.index, s.tokens, t) if active[i] else [0] * t
                                 for i, s in enumerate(self.slots)], jnp.int32).reshape(self.num_slots, t)
        elif eng.schedule is not None:
            given, logits, conf, self.caches = eng.propose(
                self.x0.copy(), self.lens.copy(), self.caches, self._next_key(),
                temperature=temperature, top_p=top_p, span=span)
            lengths = np.zeros(self.num_slots, np.int32)
            lengths[active] = verify_lengths(np.asarray(conf)[active], eng.schedule)
            width = int(lengths.max())     # the step verifies x0 + `width` drafts (T+1 compilations)
            given, limits = given[:, :width], jnp.asarray(lengths)
            logits = logits[:, :width] if temperature > 0 else None
        # host arrays go to the program as they are (jit's own transfer; a jnp.asarray per input
        # cost more host time per step); copies, as x0/lens change in place after the call
        n, emitted, self.caches = eng.step(self.x0.copy(), self.lens.copy(), active, np.int32(self.max_len),
                                           self.caches, self._next_key(), drafts_BT=given,
                                           given_logits_BTV=logits, limit_B=limits, temperature=temperature,
                                           top_p=top_p, span=span)
        self.num_steps += 1
        n, emitted = np.asarray(n), np.asarray(emitted)
        touched = []
        for i, r in enumerate(self.slots):
            if not active[i]:
                continue
            if plain:
                r.stats.plain_steps += 1
                self.stats.plain_steps += 1
            elif t:
                verified = t if limits is None else int(lengths[i])
                r.stats.update(int(n[i]), verified)
                self.stats.update(int(n[i]), verified)
            new = [int(x) for x in emitted[i, :n[i] + 1]]
            self.lens[i] += n[i] + 1
            self.x0[i] = new[-1]
            for tok in new:
                r.tokens.append(tok)
                if self._maybe_finish(r):
                    break
            if r.finish_reason is None and self.lens[i] >= self.max_len:
                self._finish(r, "length")      # the next anchor has no cache position left
            touched.append(r)
        return touched

    def _maybe_finish(self, r: Request) -> bool:
        out = r.tokens
        if out[-1] in r.eos_ids or (r.stop_check is not None and r.stop_check(out)):
            self._finish(r, "stop")
        elif len(out) >= r.max_new_tokens:
            self._finish(r, "length")
        return r.finish_reason is not None

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.slots[r.slot] = None
        r.slot = None


def pow2(n: int) -> int:
    """The smallest power of two >= n (shape buckets: few compilations)."""
    return 1 << max(n - 1, 0).bit_length()


def prefill_bucket(n: int) -> int:
    """Prefill length buckets: few compilations, bounded padding."""
    b = 16
    while b < n:
        b *= 2
    return b
