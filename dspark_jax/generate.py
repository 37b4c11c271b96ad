"""Batched speculative generation (DESIGN §4, §5; spec E).

One loop for both plain and speculative decoding: prefill, then steps that (if a draft is
given) propose T drafts from the shared cache, verify `[x0, d_1..d_T]` in one target forward,
accept, commit the KDA snapshot of the last accepted token and write the verified tokens' draft
context rows. `draft=None` or `num_speculative_tokens=0` is plain decoding: T = 0, the same code.

`Engine` holds the jitted prefill/step functions; `Batcher` is the one scheduling loop
(continuous batching over cache slots) that `generate()`, the HTTP server and the benchmark share.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dspark_jax import steps
from dspark_jax.cache import KDAStates, PagedPool, storage_dtype
from dspark_jax.kernels.dispatch import kernel_mode
from dspark_jax.schedule import VerifyCost, verify_lengths
from dspark_jax.sharding import logical_to_spec

# model -> directory it was loaded from (to find its tokenizer)
_SOURCES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def register_source(model, directory) -> None:
    _SOURCES[model] = str(directory)


class RequestError(ValueError):
    """A malformed generation request; the message names the field."""


# ---------------------------------------------------------------------------------------------
# statistics (ATOM /debug/mtp_stats schema, spec E.5)


@dataclass
class SpecStats:
    num_speculative_tokens: int
    total_draft_tokens: int = 0
    total_accepted_tokens: int = 0
    distribution: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)   # drafts accepted at position k

    def __post_init__(self):
        t = self.num_speculative_tokens
        self.distribution = self.distribution or [0] * (t + 1)
        self.accepted_at_position = self.accepted_at_position or [0] * t

    def update(self, n: int, verified: int | None = None) -> None:
        """One verify step in which `verified` drafts (default T) were scored and n accepted."""
        self.total_draft_tokens += self.num_speculative_tokens if verified is None else verified
        self.total_accepted_tokens += n
        self.distribution[n] += 1
        for k in range(n):
            self.accepted_at_position[k] += 1

    def merge(self, other: "SpecStats") -> None:
        self.total_draft_tokens += other.total_draft_tokens
        self.total_accepted_tokens += other.total_accepted_tokens
        self.distribution = [a + b for a, b in zip(self.distribution, other.distribution)]
        self.accepted_at_position = [a + b for a, b in zip(self.accepted_at_position, other.accepted_at_position)]

    def to_dict(self) -> dict:
        steps_n = sum(self.distribution)
        return {
            "enabled": self.num_speculative_tokens > 0,
            "total_draft_tokens": self.total_draft_tokens,
            "total_accepted_tokens": self.total_accepted_tokens,
            "acceptance_rate": (self.total_accepted_tokens / self.total_draft_tokens
                                if self.total_draft_tokens else 0.0),
            "average_tokens_per_forward": 1.0 + (self.total_accepted_tokens / steps_n if steps_n else 0.0),
            "distribution": {str(i): c for i, c in enumerate(self.distribution)},
            "distribution_percent": {str(i): (100.0 * c / steps_n if steps_n else 0.0)
                                     for i, c in enumerate(self.distribution)},
            "num_verify_steps": steps_n,
            # P(draft k accepted): acceptance per draft position, k = 1..T
            "per_position_acceptance": [a / steps_n if steps_n else 0.0 for a in self.accepted_at_position],
        }


@dataclass
class RequestOutput:
    text: str | None
    token_ids: list[int]
    finish_reason: str                 # "stop" (eos / stop string) or "length"
    prompt_token_ids: list[int]
    stats: dict


@dataclass
class GenerateResult:
    outputs: list[RequestOutput]
    stats: dict


# ---------------------------------------------------------------------------------------------
# the engine: compiled steps for one (target, draft, batch, T, sampling) setting


def embed_and_head(target):
    """The target's embedding table and lm_head (the same array when tied): the draft uses both."""
    embed = target.model.embed_tokens.weight.get_value()
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight.get_value()
    return embed, head


def attention_rows(target) -> int:
    """Pool rows the target's attention layers take (the draft's rows follow them)."""
    cfg = target.cfg
    return len(cfg.full_attn_layers) if cfg.family == "kimi_linear" else cfg.num_hidden_layers


def row_width(target) -> int:
    """Width of one target pool row: the MLA latent, or a llama layer's `[k | v]`."""
    cfg = target.cfg
    if cfg.family == "kimi_linear":
        return cfg.kv_latent_dim
    return 2 * cfg.num_key_value_heads * cfg.head_dim


def pool_geometry(target, draft) -> tuple[int, int]:
    """(rows, width) of the paged pool a pair needs: the target's attention rows then the
    draft's layers, as wide as the wider of the two row kinds."""
    rows = attention_rows(target) + (draft.cfg.num_hidden_layers if draft is not None else 0)
    return rows, max(row_width(target), draft.cfg.kv_latent_dim if draft is not None else 0)


class Engine:
    """Split models and the jitted prefill/step functions for one (target, draft, T, cache) setting.

    Sampling settings are static arguments of the jitted functions (one compilation per distinct
    (temperature, top_p)); `temperature`/`top_p` given here are the defaults (`run`, and calls
    that pass none)."""

    def __init__(self, target, draft, num_speculative_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, kv_cache_dtype: str = "auto", page_size: int = 16,
                 schedule: VerifyCost | None = None):
        self.target, self.draft = target, draft
        self.t = num_speculative_tokens
        self.temperature, self.top_p = sampling_key(temperature, top_p)
        self.page_size = page_size
        self.compute_dtype = target.dtype
        self.store_dtype = storage_dtype(kv_cache_dtype, self.compute_dtype)
        if draft is not None:
            self._check_pair(target, draft)
        if schedule is not None and (draft is None or not draft.cfg.enable_confidence_head):
            raise RequestError("the confidence schedule needs a draft with a confidence head "
                               "(enable_confidence_head in its config.json)")
        self.schedule = schedule
        self.aux_ids = tuple(draft.cfg.target_layer_ids) if draft is not None else ()
        self.t_graph, self.t_state = nnx.split(target)
        self.d_graph, self.d_state = nnx.split(draft) if draft is not None else (None, None)
        sharding = jax.tree.leaves(self.t_state)[0].sharding
        self.mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("temperature", "top_p", "span"),
                                donate_argnames=("caches",))
        self._step = jax.jit(self._step_impl, static_argnames=("temperature", "top_p", "span"),
                             donate_argnames=("caches",))
        self._propose = jax.jit(self._propose_impl, static_argnames=("temperature", "top_p", "span"),
                                donate_argnames=("caches",))

    @staticmethod
    def _check_pair(target, draft) -> None:
        tc, dc = target.cfg, draft.cfg
        if dc.target_hidden_size != tc.hidden_size:
            raise RequestError(f"draft target_hidden_size {dc.target_hidden_size} != target hidden_size "
                               f"{tc.hidden_size}: the draft was trained for another target")
        if dc.vocab_size != tc.vocab_size:
            raise RequestError(f"draft vocab_size {dc.vocab_size} != target vocab_size {tc.vocab_size}")
        if dc.hidden_size != tc.hidden_size:
            raise RequestError(f"draft hidden_size {dc.hidden_size} != target hidden_size {tc.hidden_size}: "
                               "the draft shares the target's embeddings and lm_head")
        bad = [i for i in dc.target_layer_ids if i >= tc.num_hidden_layers]
        if bad:
            raise RequestError(f"draft target_layer_ids {bad} exceed the target's {tc.num_hidden_layers} layers")

    # -- caches -----------------------------------------------------------------------------
    def new_caches(self, batch: int, max_len: int) -> steps.TargetCaches:
        rows, width = pool_geometry(self.target, self.draft)
        pool = PagedPool.create(rows, batch, max_len, self.page_size, width, self.store_dtype)
        kda = None
        cfg = self.target.cfg
        if cfg.family == "kimi_linear" and cfg.kda_layers:
            p = cfg.kda_num_heads * cfg.kda_head_dim
            kda = KDAStates.create(len(cfg.kda_layers), batch, 3 * p, cfg.short_conv_kernel_size,
                                   cfg.kda_num_heads, cfg.kda_head_dim, self.compute_dtype)
        caches = steps.TargetCaches(pool, kda)
        return caches if self.mesh is None else jax.device_put(caches, self._cache_shardings(caches))

    def _cache_shardings(self, caches: steps.TargetCaches):
        axes = steps.TargetCaches(caches.pool.logical_axes(),
                                  None if caches.kda is None else caches.kda.logical_axes())

        def named(ax, x):
            spec = list(logical_to_spec(ax, x.shape, self.mesh))
            while spec and spec[-1] is None:     # the form XLA gives outputs: P(None, None) is P()
                spec.pop()
            return NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))

        return jax.tree.map(named, axes, caches,
                            is_leaf=lambda t: isinstance(t, tuple) and all(a is None or isinstance(a, str) for a in t))

    def _pinned(self, caches: steps.TargetCaches) -> steps.TargetCaches:
        """The steps return the caches in exactly `new_caches`' placement: a different output
        sharding would make the next call (its input) compile the step a second time."""
        if self.mesh is None:
            return caches
        return jax.lax.with_sharding_constraint(caches, self._cache_shardings(caches))

    # -- jitted bodies ----------------------------------------------------------------------
    def _sampling(self, temperature: float | None, top_p: float | None) -> tuple[float, float]:
        """A call's static sampling setting; None: the engine's defaults."""
        return sampling_key(self.temperature if temperature is None else temperature,
                            self.top_p if top_p is None else top_p)

    def _models(self, t_state, d_state):
        target = nnx.merge(self.t_graph, t_state)
        draft = nnx.merge(self.d_graph, d_state) if self.d_graph is not None else None
        return target, draft

    def _prefill_impl(self, t_state, d_state, tokens_PS, lens_P, slots_P, caches, key, *,
                      temperature: float | None = None, top_p: float | None = None, span: int | None = None):
        """Prefill P new sequences into cache slots `slots_P` (padding rows: slot = batch size,
        length 0) while the other slots keep their state: only the new rows run. They see the
        pool through their own block-table rows, start from zero KDA state (whatever the slot
        held before) and their new KDA states are scattered back into their slots."""
        target, draft = self._models(t_state, d_state)
        temperature, top_p = self._sampling(temperature, top_p)
        p, s = tokens_PS.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
        valid = positions < lens_P[:, None]
        full_table = caches.pool.block_table
        table = _span_table(jnp.take(full_table, slots_P, axis=0, mode="clip"), caches.pool.page_size, span)
        sub = steps.TargetCaches(
            caches.pool._replace(block_table=table),
            None if caches.kda is None else KDAStates(
                jnp.zeros((caches.kda.conv.shape[0], p) + caches.kda.conv.shape[2:], caches.kda.conv.dtype),
                jnp.zeros((caches.kda.ssm.shape[0], p) + caches.kda.ssm.shape[2:], caches.kda.ssm.dtype)))
        out, sub, _ = steps.target_forward(target, tokens_PS, positions, valid, sub, self.aux_ids,
                                           verify=False)
        last = jnp.take_along_axis(out.logits, jnp.maximum(lens_P - 1, 0)[:, None, None], axis=1)[:, 0]
        first = steps.sample_tokens(last, temperature, top_p, key)
        pool = sub.pool
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, pool, attention_rows(target))
        kda = caches.kda
        if kda is not None:   # padding rows (slot out of range) are dropped
            kda = KDAStates(kda.conv.at[:, slots_P].set(sub.kda.conv, mode="drop"),
                            kda.ssm.at[:, slots_P].set(sub.kda.ssm, mode="drop"))
        return first, self._pinned(steps.TargetCaches(pool._replace(block_table=full_table), kda))

    def _propose_impl(self, t_state, d_state, x0_B, lens_B, caches, key, *,
                      temperature: float | None = None, top_p: float | None = None, span: int | None = None):
        """The draft's block pass alone (the confidence schedule looks at it before verifying)."""
        target, draft = self._models(t_state, d_state)
        temperature, top_p = self._sampling(temperature, top_p)
        full_table = caches.pool.block_table
        pool = caches.pool._replace(block_table=_span_table(full_table, caches.pool.page_size, span))
        embed, head = embed_and_head(target)
        prop = steps.draft_block(draft, embed, head, x0_B, lens_B, pool, attention_rows(target), self.t,
                                 temperature=temperature, top_p=top_p, key=key if temperature > 0 else None)
        caches = caches._replace(pool=prop.pool._replace(block_table=full_table))
        return prop.tokens_BT, prop.logits_BTV, prop.confidence_BT, self._pinned(caches)

    def _step_impl(self, t_state, d_state, x0_B, given_drafts_BT, lens_B, active_B, max_len, caches, key, *,
                   given_logits_BTV=None, limit_B=None,
                   temperature: float | None = None, top_p: float | None = None, span: int | None = None):
        """One propose/verify step over every slot; inactive rows write nothing and keep their
        KDA state. `given_drafts_BT` (their width is the step's T) replaces the draft model's block
        pass: an external proposer's drafts (greedy only), or `_propose`'s output cut to the
        schedule's widest row, with its logits (for sampling) and `limit_B` drafts per row.
        `span` (a page multiple >= every active length + T + 1) bounds the positions attention
        reads, so a step costs what the sequences hold, not max_len."""
        target, draft = self._models(t_state, d_state)
        temperature, top_p = self._sampling(temperature, top_p)
        full_table = caches.pool.block_table
        caches = caches._replace(pool=caches.pool._replace(
            block_table=_span_table(full_table, caches.pool.page_size, span)))
        k_draft, k_acc = jax.random.split(key)
        b = x0_B.shape[0]
        draft_logits = given_logits_BTV
        if given_drafts_BT is not None:
            drafts = given_drafts_BT
        elif draft is not None:
            embed, head = embed_and_head(target)
            prop = steps.draft_block(draft, embed, head, x0_B, lens_B, caches.pool, attention_rows(target), self.t,
                                     temperature=temperature, top_p=top_p,
                                     key=k_draft if temperature > 0 else None)
            drafts, draft_logits = prop.tokens_BT, prop.logits_BTV
        else:
            drafts = jnp.zeros((b, 0), x0_B.dtype)
        t = drafts.shape[1]
        tokens = jnp.concatenate([x0_B[:, None], drafts], 1)
        positions = lens_B[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None]
        valid = active_B[:, None] & (positions < max_len)
        out, caches, snaps = steps.target_forward(target, tokens, positions, valid, caches, self.aux_ids,
                                                  verify=True)
        room = jnp.maximum(max_len - lens_B - 1, 0)
        limit = room if limit_B is None else jnp.minimum(room, limit_B)
        if temperature > 0 and draft_logits is not None and t > 0:
            acc = steps.accept_sampling(out.logits, draft_logits, drafts, temperature, top_p, k_acc, limit_B=limit)
        elif temperature > 0:
            tok = steps.sample_tokens(out.logits[:, 0], temperature, top_p, k_acc)
            acc = steps.Acceptance(jnp.zeros((b,), jnp.int32), tok[:, None])
        else:
            acc = steps.accept_greedy(out.logits, drafts, limit_B=limit)
        n = jnp.where(active_B, acc.num_accepted_B, 0)
        if snaps is not None:
            # inactive rows: every snapshot equals the old state (nothing valid), so this keeps it
            caches = caches._replace(kda=steps.commit_kda(caches.kda, snaps, n))
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, caches.pool,
                                       attention_rows(target))
            caches = caches._replace(pool=pool)
        return n, acc.emitted_BT1, self._pinned(caches._replace(pool=caches.pool._replace(block_table=full_table)))

    # -- static batch (tests, generate) ----------------------------------------------------
    def run(self, prompts: list[list[int]], max_new_tokens: int, max_len: int, eos_ids: set[int],
            stop_check, seed: int, proposer=None) -> list[tuple[list[int], str, SpecStats]]:
        """All prompts in one batch with the engine's default sampling, through `Batcher`.
        `proposer(i, tokens_so_far, T) -> T token ids` (host side, greedy verification only)
        replaces the draft model, e.g. an oracle in tests."""
        batcher = Batcher(self, len(prompts), max_len, seed=seed, proposer=proposer)
        reqs = [Request(list(p), max_new_tokens, self.temperature, self.top_p, frozenset(eos_ids), stop_check,
                        index=i) for i, p in enumerate(prompts)]
        batcher.run(reqs)
        self.last_caches = batcher.caches          # final cache state, for inspection in tests
        return [(r.tokens, r.finish_reason, r.stats) for r in reqs]


def _span_table(table, page_size: int, span: int | None):
    """The first pages of a block table that cover `span` positions (None: all of them)."""
    return table if span is None else table[:, :-(-span // page_size)]


def sampling_key(temperature: float, top_p: float) -> tuple[float, float]:
    """The static sampling setting of a compiled step (top_p is irrelevant when greedy)."""
    return (0.0, 1.0) if temperature <= 0 else (float(temperature), float(top_p))


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

    def __init__(self, engine: Engine, max_num_seqs: int, max_len: int, *, seed: int = 0, proposer=None):
        if max_num_seqs < 1:
            raise RequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
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
        self._turn = 0

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

    def _next_key(self) -> jax.Array:
        self._key, sub = jax.random.split(self._key)
        return sub

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
            s = _bucket(max(len(r.prompt) for r in reqs))
            tokens = np.zeros((p, s), np.int32)
            lens = np.zeros(p, np.int32)
            slots = np.full(p, self.num_slots, np.int32)      # padding rows: out of range, dropped
            for j, r in enumerate(reqs):
                tokens[j, :len(r.prompt)] = r.prompt
                lens[j], slots[j] = len(r.prompt), r.slot
            first, self.caches = eng._prefill(eng.t_state, eng.d_state, jnp.asarray(tokens), jnp.asarray(lens),
                                              jnp.asarray(slots), self.caches, self._next_key(),
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
        span = self._span(int(self.lens[active].max()) + t + 1)
        given = logits = limits = None
        if self.proposer is not None:
            given = jnp.asarray([self.proposer(s.index, s.tokens, t) if active[i] else [0] * t
                                 for i, s in enumerate(self.slots)], jnp.int32).reshape(self.num_slots, t)
        elif eng.schedule is not None:
            given, logits, conf, self.caches = eng._propose(
                eng.t_state, eng.d_state, jnp.asarray(self.x0), jnp.asarray(self.lens), self.caches,
                self._next_key(), temperature=temperature, top_p=top_p, span=span)
            lengths = np.zeros(self.num_slots, np.int32)
            lengths[active] = verify_lengths(np.asarray(conf)[active], eng.schedule)
            width = int(lengths.max())     # the step verifies x0 + `width` drafts (T+1 compilations)
            given, limits = given[:, :width], jnp.asarray(lengths)
            logits = logits[:, :width] if temperature > 0 else None
        n, emitted, self.caches = eng._step(eng.t_state, eng.d_state, jnp.asarray(self.x0), given,
                                            jnp.asarray(self.lens), jnp.asarray(active), jnp.int32(self.max_len),
                                            self.caches, self._next_key(), given_logits_BTV=logits, limit_B=limits,
                                            temperature=temperature, top_p=top_p, span=span)
        self.num_steps += 1
        n, emitted = np.asarray(n), np.asarray(emitted)
        touched = []
        for i, r in enumerate(self.slots):
            if not active[i]:
                continue
            if t:
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


def _bucket(n: int) -> int:
    """Prefill length buckets: few compilations, bounded padding."""
    b = 16
    while b < n:
        b *= 2
    return b


# ---------------------------------------------------------------------------------------------
# public entry point


def generate(target, draft=None, prompts: Sequence[Any] = (), max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, num_speculative_tokens: int = 7,
             stop: Sequence[str] | None = None, seed: int = 0, chat: bool = True, *,
             tokenizer=None, max_model_len: int | None = None, kv_cache_dtype: str = "auto",
             page_size: int = 16, engine: Engine | None = None, proposer=None,
             confidence_schedule: bool | VerifyCost = False) -> GenerateResult:
    """Generate continuations for a batch of prompts.

    `target`/`draft` are loaded models or anything `load_target`/`load_draft` accept (a directory
    or a preset name). `prompts`: strings, chat message lists (`[{"role","content"}]`) or token-id
    lists. With `chat=True` strings are wrapped as one user turn and rendered with the target's
    chat template. `draft=None` or `num_speculative_tokens=0` decodes without speculation.
    `confidence_schedule` (True or a `VerifyCost`) lets the draft's confidence head choose how many
    drafts each step verifies (spec E.6); off by default, as in ATOM for Kimi-K3-DSpark.
    Returns `result.outputs[i].text / .token_ids / .finish_reason / .stats` and aggregate
    `result.stats` (ATOM mtp_stats schema plus per-position acceptance)."""
    from dspark_jax.api import load_draft, load_target

    if isinstance(target, str) or hasattr(target, "__fspath__"):
        target = load_target(target)
    if draft is not None and (isinstance(draft, str) or hasattr(draft, "__fspath__")):
        draft = load_draft(draft)
    if num_speculative_tokens < 0:
        raise RequestError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if num_speculative_tokens == 0:
        draft = None
    if proposer is not None and temperature > 0:
        raise RequestError("an external proposer supports greedy verification only (temperature=0)")
    if max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not prompts:
        raise RequestError("prompts: at least one prompt is required")
    if tokenizer is None:
        tokenizer = tokenizer_for(target)
    ids = [encode_prompt(p, tokenizer, chat, f"prompts[{i}]") for i, p in enumerate(prompts)]

    t = num_speculative_tokens if (draft is not None or proposer is not None) else 0
    longest = max(len(p) for p in ids)
    limit = max_model_len or default_max_len(target)
    for i, p in enumerate(ids):
        if len(p) + t + 1 > limit:
            raise RequestError(f"prompts[{i}]: {len(p)} tokens (+{t + 1} for one verify step) exceed "
                               f"max_model_len={limit}")
    # bucketed (powers of two) so repeated calls reuse compiled steps
    max_len = min(limit, max(128, pow2(longest + max_new_tokens + t + 1)))
    eos = frozenset(eos_ids(target, tokenizer))
    stops = list(stop or [])
    check = stop_checker(stops, tokenizer)

    schedule = None
    if confidence_schedule and draft is not None:
        schedule = confidence_schedule if isinstance(confidence_schedule, VerifyCost) else VerifyCost()
    if engine is None:
        engine = engine_for(target, draft, t, temperature, top_p, kv_cache_dtype, page_size, schedule)
    batcher = Batcher(engine, len(ids), max_len, seed=seed, proposer=proposer)
    reqs = batcher.run([Request(p, max_new_tokens, temperature, top_p, eos, check, index=i)
                        for i, p in enumerate(ids)])
    outputs, total = [], SpecStats(engine.t)
    for r in reqs:
        total.merge(r.stats)
        text = output_text(r.tokens, tokenizer, eos, stops) if tokenizer is not None else None
        outputs.append(RequestOutput(text, r.tokens, r.finish_reason, r.prompt, r.stats.to_dict()))
    return GenerateResult(outputs, total.to_dict())


# compiled engines per target, so repeated generate() calls do not recompile
_ENGINES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def engine_for(target, draft, t, temperature, top_p, kv_cache_dtype, page_size, schedule=None) -> Engine:
    """The Engine for one setting, kept per target, so repeated `generate()` calls (and regen,
    benchmarks) reuse its compiled programs."""
    per_target = _ENGINES.setdefault(target, {})
    # the kernel mode is read when a step is traced, so it is part of what a compiled engine is
    key = (id(draft), t, *sampling_key(temperature, top_p), kv_cache_dtype, page_size, schedule, kernel_mode())
    eng = per_target.get(key)
    if eng is None or eng.draft is not draft:
        eng = per_target[key] = Engine(target, draft, t, temperature, top_p, kv_cache_dtype, page_size, schedule)
    return eng


# ---------------------------------------------------------------------------------------------
# request helpers shared with the server and the benchmark


def tokenizer_for(target):
    """The tokenizer of a target loaded with `load_target` (None if its directory is unknown)."""
    if target not in _SOURCES:
        return None
    from dspark_jax.tokenizer import load_tokenizer
    return load_tokenizer(_SOURCES[target])


def eos_ids(target, tokenizer) -> set[int]:
    """Every token id that ends generation: the config's and the tokenizer's."""
    eos = set()
    if target.cfg.eos_token_id is not None:
        eos.add(int(target.cfg.eos_token_id))
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    return eos


def stop_checker(stops: Sequence[str], tokenizer) -> Callable[[list[int]], bool] | None:
    """A per-token check 'does the decoded output contain a stop string'. It runs after every
    token, so a stop string first shows up at the tail: only a window of tokens wide enough for
    the longest stop string (each token decodes to at least a byte) is decoded, not the whole
    output."""
    if not stops or tokenizer is None:
        return None
    window = 2 * max(len(s.encode()) for s in stops) + 8

    def check(out: list[int]) -> bool:
        text = tokenizer.decode(out[-window:])
        return any(s in text for s in stops)
    return check


def output_text(tokens: Sequence[int], tokenizer, eos: frozenset[int] | set[int], stops: Sequence[str]) -> str:
    """The text of generated tokens: end-of-sequence ids dropped, cut before the first stop string."""
    text = tokenizer.decode([x for x in tokens if x not in eos])
    for s in stops:
        if s in text:
            text = text[:text.index(s)]
    return text


def default_max_len(target) -> int:
    """The target's position limit (max_position_embeddings; 4096 when the config has none)."""
    cfg = target.cfg
    return int(getattr(cfg, "max_position_embeddings", 0) or 4096)


def encode_prompt(prompt, tokenizer, chat: bool, where: str = "prompt") -> list[int]:
    """Token ids of a prompt: token ids as given, a string (wrapped as one user turn and rendered
    with the chat template when `chat`) or a list of `{"role", "content"}` messages."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, (int, np.integer)) for x in prompt):
        return [int(x) for x in prompt]
    if tokenizer is None:
        raise RequestError(f"{where}: text prompts need a tokenizer (pass tokenizer= or load the "
                           "target with load_target so its tokenizer is found)")
    if isinstance(prompt, str):
        if not chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for j, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(f"{where}[{j}]: a message needs string 'role' and 'content'")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tokenizer.encode(text)
    raise RequestError(f"{where}: expected a string, a list of messages or a list of token ids")
