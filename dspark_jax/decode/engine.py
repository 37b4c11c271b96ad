"""The engine: a (target, draft) pair split for jit, and its three compiled programs over `steps.py`.

- `prefill`: new sequences' prompts, or chunks of them at their offsets, into their cache slots
  (only these rows run; a later chunk continues from the KDA state and attends to the rows the
  earlier chunks wrote), the first token sampled, the draft's context rows written.
- `propose`: the draft's block pass alone (profiling times it apart).
- `step`: propose T drafts (or take given ones), verify `[x0, d_1..d_L]` in one target forward
  (L = `width`, T by default: the draft's block is then L rows, as at T = L), accept, commit
  the KDA snapshot of the last accepted token, write the verified tokens' draft context rows.
  Drafts of width 0 are a plain one-token step through the same program.

Each program is a pure function of (target state, draft state, inputs, caches) compiled once per
static setting (sampling, width) and batch shape, one jit per shape (`dspark_jax.decode.programs`:
the least recently used are dropped near the process's memory-mapping limit); its rows name their
cache slots, so a call computes the running sequences only (padding rows write nothing), and its
attention reads keys as far as its longest row reaches (`kernels.paged_attention`), so no program
depends on the sequences' lengths. `Engine.prefill/propose/step`
call them with the engine's own states (`Engine.compile_only`: compile without running, the
warm-up). The scheduling loop over these programs is `dspark_jax.decode.scheduler.Scheduler`; the engine
keeps what it chooses the speculation length from (`acceptance`, `step_costs()`, `step_times`,
`dspark_jax.decode.spec_length`), shared by every scheduler that drives it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dspark_jax.cache import PagedPool, TargetCaches, bits_storage, storage_dtype
from dspark_jax.decode import steps
from dspark_jax.decode.config import EngineConfig
from dspark_jax.decode.programs import CompiledPrograms
from dspark_jax.decode.spec_length import AcceptanceEstimate, StepCosts, StepTimes, costs_for
from dspark_jax.errors import RequestError
from dspark_jax.sampling import GREEDY, SamplingParams, sample_tokens
from dspark_jax.sharding import logical_to_spec


def embed_and_head(target):
    """The target's embedding table and lm_head (the same array when tied): the draft uses both."""
    embed = target.model.embed_tokens.weight.get_value()
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight.get_value()
    return embed, head


def pool_geometry(target, draft) -> tuple[int, int]:
    """(rows, width) of the paged pool a pair needs: the target's attention rows then the
    draft's layers, as wide as the wider of the two row kinds."""
    rows = target.attention_rows + (draft.cfg.num_hidden_layers if draft is not None else 0)
    return rows, max(target.row_width, draft.cfg.kv_latent_dim if draft is not None else 0)


class Engine:
    """Split models and the jitted programs for one (target, draft, EngineConfig) setting.

    Sampling settings are per row and traced (`SamplingParams` of [B] arrays), so requests of any
    settings share a step and compile nothing new; the one static flag, `sampled`, says whether
    any row samples: an all-greedy step runs a program without the sampling work. Calls pass
    `sampling` as numbers or per-row arrays (None: greedy). `draft=None` with T > 0
    verifies drafts given to `step` (an external proposer)."""

    def __init__(self, target, draft, config: EngineConfig = EngineConfig(), *, serving_layout: bool = False):
        self.target, self.draft, self.config = target, draft, config
        self.t = config.num_speculative_tokens
        self.page_size = config.page_size
        self.compute_dtype = target.dtype
        self.store_dtype = storage_dtype(config.kv_cache_dtype, self.compute_dtype)
        if jax.default_backend() == "cpu":
            # bf16/fp8 pages as their bit patterns: XLA:CPU would convert the whole pool around
            # every cache write (cache.bits_storage); the stored numbers are the same
            self.store_dtype = bits_storage(self.store_dtype)
        if draft is not None:
            self._check_pair(target, draft)
        # pooled acceptance per draft position, what the speculation length is chosen from
        self.acceptance = AcceptanceEstimate(self.t)
        self.step_times = StepTimes()        # what its steps took, host loop included
        # the programs called or compiled so far, one jit per shape, least recently used dropped near
        # the process's memory-mapping limit (`dspark_jax.decode.programs`)
        self.programs = CompiledPrograms()
        self._step_costs: StepCosts | None = None
        self.aux_ids = tuple(draft.cfg.target_layer_ids) if draft is not None else ()
        self.t_graph, self.t_state = nnx.split(target)
        self.d_graph, d_state = nnx.split(draft) if draft is not None else (None, None)
        # one compute dtype per engine: a bf16 draft beside an f32 target would ask XLA:CPU for
        # bf16 x bf16 -> f32 dots, which CPUs with AMX lack (dspark_jax/numerics.py)
        self.d_state = cast_floating(d_state, self.compute_dtype) if draft is not None else None
        sharding = jax.tree.leaves(self.t_state)[0].sharding
        self.mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        # `serving_layout`: the target's weights also in the layout its family says the backend runs
        # faster (`TargetLM.serving_weights`, e.g. fused q|k|v and gate|up [in, out] copies), built
        # once here and passed to every program beside the declared params. Off by default: on a
        # 2-core CPU it measured neutral at batch 1 (docs/profile.md) and it doubles the target's
        # weight memory. A sharded engine always uses the params as declared.
        self.serving = None
        if serving_layout and self.mesh is None and jax.default_backend() == "cpu":
            self.serving = target.serving_weights()
        # a reduced-vocabulary draft's lm_head rows [K, D], gathered once here: inside the programs
        # the gather would rerun on every block pass
        self.draft_head = None
        if draft is not None and draft.cfg.reduced_vocab:
            self.draft_head = draft.head_rows(embed_and_head(target)[1])
        static = ("sampled",)
        self._jit_kw = {name: {"static_argnames": static + (("width",) if name == "step" else ()),
                               "donate_argnames": ("caches",)} for name in ("prefill", "propose", "step")}
        # the programs as one jit each, to `.lower()` for AOT checks and plans; calls go through
        # prefill/propose/step, which keep one jit per shape in `programs`
        self.prefill_jit = jax.jit(self.prefill_fn, **self._jit_kw["prefill"])
        self.propose_jit = jax.jit(self.propose_fn, **self._jit_kw["propose"])
        self.step_jit = jax.jit(self.step_fn, **self._jit_kw["step"])

    @property
    def programs_called(self) -> set:
        """The step programs called or compiled and still held, by the tag their caller gave
        (`Scheduler._program_key`)."""
        return self.programs.tags()

    def step_costs(self) -> StepCosts:
        """The measured step costs of this engine's programs on the host it runs on (loaded from the cost
        cache on first use; buckets not measured yet are measured by the scheduler that meets them)."""
        if self._step_costs is None:
            self._step_costs = costs_for(self)
        return self._step_costs

    # The programs take the weights as either nnx States or their flat leaf lists. The calls below
    # pass the lists: jit flattens an nnx.State in Python on every call, a list of arrays in C++
    # (SmolLM2's 272 arrays: 0.3-0.7 ms against 0.06 ms on an x86 server CPU, 2026-12-01).
    @property
    def t_state(self):
        return self._t_state

    @t_state.setter
    def t_state(self, state):
        self._t_state = state
        self._t_leaves, self._t_def = jax.tree.flatten(state)

    @property
    def d_state(self):
        return self._d_state

    @d_state.setter
    def d_state(self, state):          # a swapped draft of the same structure (monitor.HeldOutEval)
        self._d_state = state
        self._d_leaves, self._d_def = jax.tree.flatten(state) if state is not None else (None, None)

    def prefill(self, tokens_PS, lens_P, slots_P, caches: TargetCaches, key, *, sampling: SamplingParams = GREEDY,
                **kw):
        """(first tokens [P], caches): see `prefill_fn`."""
        # one program for greedy and sampled prompts: it samples one position per row (rows at
        # temperature 0 take the argmax), so a greedy variant would save nothing and double the programs
        return self._call("prefill", self._t_leaves, self._d_leaves, tokens_PS, lens_P, slots_P, caches, key,
                          serving=self.serving, sampling=sampling.rows(len(lens_P)), sampled=True, **kw)

    def propose(self, x0_B, lens_B, caches: TargetCaches, key, *, sampling: SamplingParams = GREEDY, **kw):
        """(drafts [B,T], draft logits [B,T,V], confidence [B,T], caches): see `propose_fn`."""
        return self._call("propose", self._t_leaves, self._d_leaves, x0_B, lens_B, caches, key,
                          serving=self.serving, draft_head=self.draft_head, sampling=sampling.rows(len(x0_B)),
                          sampled=sampling.sampled, **kw)

    def step(self, x0_B, lens_B, active_B, max_len, caches: TargetCaches, key, *, drafts_BT=None,
             sampling: SamplingParams = GREEDY, tag=None, **kw):
        """(accepted [B], emitted [B,T+1], caches): see `step_fn`. `tag`: what the caller calls this
        program (`programs_called`)."""
        return self._call("step", self._t_leaves, self._d_leaves, x0_B, drafts_BT, lens_B, active_B, max_len,
                          caches, key, serving=self.serving, draft_head=self.draft_head, tag=tag,
                          sampling=sampling.rows(len(x0_B)), sampled=sampling.sampled, **kw)

    @contextlib.contextmanager
    def compile_only(self):
        """Inside: `prefill`/`propose`/`step` compile their program for these arguments without
        running it (the warm-up: a long prefill would take minutes to run on a CPU) and return
        zeros of its outputs with the caches as given. A later call with arguments of the same
        shapes runs the compiled program: jit keeps what `lower(...).compile()` built."""
        self._compiling = True
        try:
            yield
        finally:
            self._compiling = False

    _compiling = False

    def program(self, name: str, args: tuple, kw: dict, tag=None):
        """(the jit a call of program `name` with these arguments runs, whether it is new): one per
        static setting and argument shapes, in `programs`."""
        static = self._jit_kw[name]["static_argnames"]
        key = (name, *map(_signature, args), *((k, v if k in static else _signature(v)) for k, v in kw.items()))
        return self.programs.get(key, getattr(self, f"{name}_fn"), self._jit_kw[name], tag)

    def _call(self, name, *args, tag=None, **kw):
        program, new = self.program(name, args, kw, tag)
        if not self._compiling:
            out = program(*args, **kw)
        else:
            info = program.lower(*args, **kw).compile().out_info
            caches = next(a for a in args if isinstance(a, TargetCaches))
            out = (*jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), info[:-1]), caches)
        if new:
            self.programs.trim()
        return out

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
    def new_caches(self, batch: int, max_len: int) -> TargetCaches:
        rows, width = pool_geometry(self.target, self.draft)
        pool = PagedPool.create(rows, batch, max_len, self.page_size, width, self.store_dtype)
        caches = TargetCaches(pool, self.target.new_kda_states(batch, self.compute_dtype))
        return caches if self.mesh is None else jax.device_put(caches, self._cache_shardings(caches))

    def _cache_shardings(self, caches: TargetCaches):
        axes = TargetCaches(caches.pool.logical_axes(),
                                  None if caches.kda is None else caches.kda.logical_axes())

        def named(ax, x):
            spec = list(logical_to_spec(ax, x.shape, self.mesh))
            while spec and spec[-1] is None:     # the form XLA gives outputs: P(None, None) is P()
                spec.pop()
            return NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))

        return jax.tree.map(named, axes, caches,
                            is_leaf=lambda t: isinstance(t, tuple) and all(a is None or isinstance(a, str) for a in t))

    def _pinned(self, caches: TargetCaches) -> TargetCaches:
        """The steps return the caches in exactly `new_caches`' placement: a different output
        sharding would make the next call (its input) compile the step a second time."""
        if self.mesh is None:
            return caches
        return jax.lax.with_sharding_constraint(caches, self._cache_shardings(caches))

    # -- jitted bodies ----------------------------------------------------------------------
    def merge(self, t_state, d_state):
        """The (target, draft) modules of these states, or of their leaf lists (inside a program)."""
        if isinstance(t_state, list):
            t_state = jax.tree.unflatten(self._t_def, t_state)
        if isinstance(d_state, list):
            d_state = jax.tree.unflatten(self._d_def, d_state)
        target = nnx.merge(self.t_graph, t_state)
        draft = nnx.merge(self.d_graph, d_state) if self.d_graph is not None else None
        return target, draft

    def prefill_fn(self, t_state, d_state, tokens_PS, lens_P, slots_P, caches, key, *, starts_P=None, serving=None,
                   sampling: SamplingParams = GREEDY, sampled: bool = False):
        """Prefill P sequences' prompt chunks into cache slots `slots_P` (padding rows: slot =
        number of slots, length 0) while the other slots keep their state: only these rows run.
        Row p holds `lens_P[p]` tokens at positions `starts_P[p]`.. (None: every row from 0, a
        whole prompt). A row starting at 0 starts from zero KDA state (whatever the slot held
        before); a later chunk continues from the state its slot holds, and attends to the rows
        the earlier chunks wrote. The rows see the pool through their own block-table rows; their
        new KDA states are scattered back into their slots. The token sampled after a row's last
        token is its first generated token when the chunk ends the prompt (meaningless otherwise);
        drawn at the row's `sampling` when `sampled`, else greedy."""
        target, draft = self.merge(t_state, d_state)
        p, s = tokens_PS.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
        if starts_P is not None:
            positions = positions + starts_P[:, None]
        valid = jnp.arange(s, dtype=jnp.int32)[None] < lens_P[:, None]
        full_table = caches.pool.block_table
        table = rows_table(caches.pool, slots_P)
        kda = target.new_kda_states(p, self.compute_dtype)
        if kda is not None and starts_P is not None:
            # a padding row reads a real slot's state (take clips): it is inactive and dropped by `put`
            def go_on(held, zero):      # [n_kda, P, ...]
                return jnp.where((starts_P > 0).reshape((1, p) + (1,) * (zero.ndim - 2)), held, zero)
            kda = jax.tree.map(go_on, caches.kda.take(slots_P), kda)
        sub = TargetCaches(caches.pool._replace(block_table=table), kda)
        last_P = jnp.maximum(lens_P - 1, 0)
        # the lm_head on the last row of the chunk alone, not on all S rows
        out, sub, _ = steps.target_forward(target, tokens_PS, positions, valid, sub, self.aux_ids, verify=False,
                                           weights=serving, logits_rows_BR=last_P[:, None])
        first = sample_tokens(out.logits[:, 0], sampling, key if sampled else None)
        pool = sub.pool
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, pool, target.attention_rows)
        kda = caches.kda
        if kda is not None:   # padding rows (slot out of range) are dropped
            kda = kda.put(slots_P, sub.kda)
        return first, self._pinned(TargetCaches(pool._replace(block_table=full_table), kda))

    def propose_fn(self, t_state, d_state, x0_B, lens_B, caches, key, *, rows_B=None, serving=None,
                   draft_head=None, sampling: SamplingParams = GREEDY, sampled: bool = False):
        """The draft's block pass alone (profiling times it on its own).
        `rows_B`: the slot of each row (`step_fn`). `draft_head`: the draft's lm_head rows when
        its vocabulary is reduced (else the target's)."""
        target, draft = self.merge(t_state, d_state)
        full_table = caches.pool.block_table
        pool = caches.pool._replace(block_table=rows_table(caches.pool, rows_B))
        embed, head = embed_and_head(target)
        prop = steps.draft_block(draft, embed, head if draft_head is None else draft_head, x0_B, lens_B, pool,
                                 target.attention_rows, self.t,
                                 sampling=sampling, key=key if sampled else None)
        caches = caches._replace(pool=prop.pool._replace(block_table=full_table))
        return prop.tokens_BT, prop.logits_BTV, prop.confidence_BT, self._pinned(caches)

    def step_fn(self, t_state, d_state, x0_B, given_drafts_BT, lens_B, active_B, max_len, caches, key, *,
                rows_B=None, serving=None, draft_head=None, sampling: SamplingParams = GREEDY, sampled: bool = False,
                width: int | None = None):
        """One propose/verify step over B rows; inactive rows write nothing and keep their KDA
        state. `rows_B`: the cache slot of each row (padding rows: the number of slots, inactive),
        so a step computes the running sequences only, padded to a batch bucket; None: row b is
        slot b, over every slot. `given_drafts_BT` (their width is the step's L) replaces the
        draft model's block pass: an external proposer's drafts (greedy only), or none (width 0:
        a one-token step). `width`: drafts verified from the draft's block (None: all T), drafted
        by a block of that many rows (`steps.draft_block`). `sampled`: some rows sample (at their
        `sampling`; rows at temperature 0 stay greedy); False: every row is greedy."""
        target, draft = self.merge(t_state, d_state)
        full_table, full_kda = caches.pool.block_table, caches.kda
        caches = TargetCaches(caches.pool._replace(block_table=rows_table(caches.pool, rows_B)),
                              full_kda if full_kda is None or rows_B is None else full_kda.take(rows_B))
        k_draft, k_acc = jax.random.split(key)
        b = x0_B.shape[0]
        draft_logits = None
        if given_drafts_BT is not None:
            drafts = given_drafts_BT
        elif draft is not None:
            embed, head = embed_and_head(target)
            prop = steps.draft_block(draft, embed, head if draft_head is None else draft_head, x0_B, lens_B,
                                     caches.pool, target.attention_rows, self.t,
                                     sampling=sampling, key=k_draft if sampled else None, active_B=active_B,
                                     width=width)
            drafts, draft_logits = prop.tokens_BT, prop.logits_BTV
            # on with the pool holding the block's draft rows (draft_context overwrites them below):
            # going on from the pool before them would keep two versions of the whole pool alive,
            # a copy of it in every step
            caches = caches._replace(pool=prop.pool)
        else:
            drafts = jnp.zeros((b, 0), x0_B.dtype)
        t = drafts.shape[1]
        tokens = jnp.concatenate([x0_B[:, None], drafts], 1)
        positions = lens_B[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None]
        valid = active_B[:, None] & (positions < max_len)
        out, caches, snaps = steps.target_forward(target, tokens, positions, valid, caches, self.aux_ids,
                                                  verify=True, weights=serving)
        limit = jnp.maximum(max_len - lens_B - 1, 0)
        if sampled and draft_logits is not None and t > 0:
            acc = steps.accept_sampling(out.logits, draft_logits, drafts, sampling, k_acc, limit_B=limit)
        elif sampled:
            tok = sample_tokens(out.logits[:, 0], sampling, k_acc)
            acc = steps.Acceptance(jnp.zeros((b,), jnp.int32), tok[:, None])
        else:
            acc = steps.accept_greedy(out.logits, drafts, limit_B=limit)
        n = jnp.where(active_B, acc.num_accepted_B, 0)
        kda = caches.kda
        if snaps is not None:
            # inactive rows: every snapshot equals the old state (nothing valid), so this keeps it
            kda = steps.commit_kda(kda, snaps, n)
            if rows_B is not None:     # back into the rows' slots; padding rows are dropped
                kda = full_kda.put(rows_B, kda)
        pool = caches.pool
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, pool, target.attention_rows)
        return n, acc.emitted_BT1, self._pinned(TargetCaches(pool._replace(block_table=full_table), kda))


def _signature(x):
    """What tells one program's argument from another's, cheaply: shapes of arrays, the pools'
    and states' shapes in caches, lengths of weight lists (one engine's weights keep their
    structure), None, else the type. A coarser key only groups programs under one jit."""
    if x is None:
        return None
    if hasattr(x, "shape"):
        return x.shape
    if isinstance(x, tuple) and hasattr(x, "_fields"):        # TargetCaches, PagedPool, KDAStates
        return tuple(map(_signature, x))
    if isinstance(x, (list, tuple, dict)):
        return len(x)
    return type(x)


def cast_floating(state, dtype):
    """Floating-point leaves of a state tree in `dtype` (integer leaves as they are)."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
    return jax.tree.map(cast, state)


def rows_table(pool: PagedPool, rows_B):
    """The block-table rows of slots `rows_B` (None: every slot). A padding row (slot out of range)
    gets page numbers past the pool: its writes are dropped (`PagedPool.write`) and its reads
    clamped, so it can never touch a sequence's pages."""
    if rows_B is None:
        return pool.block_table
    return jnp.take(pool.block_table, rows_B, axis=0, mode="fill", fill_value=pool.pages.shape[1])

