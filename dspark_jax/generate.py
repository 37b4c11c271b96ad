"""Batched speculative generation (DESIGN §4, §5; spec E).

One loop for both plain and speculative decoding: prefill, then steps that (if a draft is
given) propose T drafts from the shared cache, verify `[x0, d_1..d_T]` in one target forward,
accept, commit the KDA snapshot of the last accepted token and write the verified tokens' draft
context rows. `draft=None` or `num_speculative_tokens=0` is plain decoding: T = 0, the same code.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import steps
from dspark_jax.cache import KDAStates, PagedPool, storage_dtype

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

    def update(self, n: int) -> None:
        """One verify step in which T drafts were scored and n accepted."""
        self.total_draft_tokens += self.num_speculative_tokens
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


def _embed_and_head(target):
    embed = target.model.embed_tokens.weight.get_value()
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight.get_value()
    return embed, head


def _attention_rows(target) -> int:
    cfg = target.cfg
    return len(cfg.full_attn_layers) if cfg.family == "kimi_linear" else cfg.num_hidden_layers


def _row_width(target) -> int:
    cfg = target.cfg
    if cfg.family == "kimi_linear":
        return cfg.kv_latent_dim
    return 2 * cfg.num_key_value_heads * cfg.head_dim


class Engine:
    """Holds split models and jitted prefill/step functions."""

    def __init__(self, target, draft, num_speculative_tokens: int, temperature: float, top_p: float,
                 kv_cache_dtype: str = "auto", page_size: int = 16):
        self.target, self.draft = target, draft
        self.t = num_speculative_tokens
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.page_size = page_size
        self.compute_dtype = target.dtype
        self.store_dtype = storage_dtype(kv_cache_dtype, self.compute_dtype)
        if draft is not None:
            self._check_pair(target, draft)
        self.aux_ids = tuple(draft.cfg.target_layer_ids) if draft is not None else ()
        self.t_graph, self.t_state = nnx.split(target)
        self.d_graph, self.d_state = nnx.split(draft) if draft is not None else (None, None)
        self._prefill = jax.jit(self._prefill_impl)
        self._step = jax.jit(self._step_impl)

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
        rows = _attention_rows(self.target) + (self.draft.cfg.num_hidden_layers if self.draft else 0)
        width = max(_row_width(self.target), self.draft.cfg.kv_latent_dim if self.draft else 0)
        pool = PagedPool.create(rows, batch, max_len, self.page_size, width, self.store_dtype)
        kda = None
        cfg = self.target.cfg
        if cfg.family == "kimi_linear" and cfg.kda_layers:
            p = cfg.kda_num_heads * cfg.kda_head_dim
            kda = KDAStates.create(len(cfg.kda_layers), batch, 3 * p, cfg.short_conv_kernel_size,
                                   cfg.kda_num_heads, cfg.kda_head_dim, self.compute_dtype)
        return steps.TargetCaches(pool, kda)

    # -- jitted bodies ----------------------------------------------------------------------
    def _models(self, t_state, d_state):
        target = nnx.merge(self.t_graph, t_state)
        draft = nnx.merge(self.d_graph, d_state) if self.d_graph is not None else None
        return target, draft

    def _prefill_impl(self, t_state, d_state, tokens_BS, lens_B, caches, key):
        target, draft = self._models(t_state, d_state)
        b, s = tokens_BS.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        valid = positions < lens_B[:, None]
        out, caches, _ = steps.target_forward(target, tokens_BS, positions, valid, caches, self.aux_ids,
                                              verify=False)
        last = jnp.take_along_axis(out.logits, (lens_B - 1)[:, None, None], axis=1)[:, 0]
        first = steps.sample_tokens(last, self.temperature, self.top_p, key)
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, caches.pool,
                                       _attention_rows(target))
            caches = caches._replace(pool=pool)
        return first, caches

    def _step_impl(self, t_state, d_state, x0_B, given_drafts_BT, lens_B, active_B, max_len, caches, key):
        """One propose/verify step. `given_drafts_BT` (an external proposer's drafts, greedy
        only) replaces the draft model's block pass."""
        target, draft = self._models(t_state, d_state)
        t = self.t
        k_draft, k_acc = jax.random.split(key)
        b = x0_B.shape[0]
        if given_drafts_BT is not None:
            drafts = given_drafts_BT
            tokens = jnp.concatenate([x0_B[:, None], drafts], 1)
        elif draft is not None:
            embed, head = _embed_and_head(target)
            prop = steps.draft_block(draft, embed, head, x0_B, lens_B, caches.pool, _attention_rows(target), t,
                                     temperature=self.temperature, top_p=self.top_p,
                                     key=k_draft if self.temperature > 0 else None)
            drafts = prop.tokens_BT
            tokens = jnp.concatenate([x0_B[:, None], drafts], 1)
        else:
            drafts = jnp.zeros((b, 0), x0_B.dtype)
            tokens = x0_B[:, None]
        positions = lens_B[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None]
        valid = active_B[:, None] & (positions < max_len)
        out, caches, snaps = steps.target_forward(target, tokens, positions, valid, caches, self.aux_ids,
                                                  verify=True)
        room = jnp.maximum(max_len - lens_B - 1, 0)
        if self.temperature > 0 and given_drafts_BT is None and draft is not None:
            acc = steps.accept_sampling(out.logits, prop.logits_BTV, drafts, self.temperature, self.top_p,
                                        k_acc, limit_B=room)
        elif self.temperature > 0:
            tok = steps.sample_tokens(out.logits[:, 0], self.temperature, self.top_p, k_acc)
            acc = steps.Acceptance(jnp.zeros((b,), jnp.int32), tok[:, None])
        else:
            acc = steps.accept_greedy(out.logits, drafts, limit_B=room)
        n = jnp.where(active_B, acc.num_accepted_B, 0)
        if snaps is not None:
            kda = steps.commit_kda(caches.kda, snaps, n)
            # inactive rows: snapshots equal the old state (nothing valid), so committing is a no-op
            caches = caches._replace(kda=kda)
        if draft is not None:
            pool = steps.draft_context(draft, out.aux_hidden, positions, valid, caches.pool,
                                       _attention_rows(target))
            caches = caches._replace(pool=pool)
        return n, acc.emitted_BT1, caches

    # -- host loop --------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], max_new_tokens: int, max_len: int, eos_ids: set[int],
            stop_check, seed: int, proposer=None) -> list[tuple[list[int], str, SpecStats]]:
        """`proposer(i, tokens_so_far, T) -> T token ids` (host side, greedy verification only)
        replaces the draft model, e.g. an oracle in tests."""
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        s = _bucket(int(lens.max()))
        tokens = np.zeros((b, s), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        caches = self.new_caches(b, max_len)
        key = jax.random.PRNGKey(seed)
        key, sub = jax.random.split(key)
        x0, caches = self._prefill(self.t_state, self.d_state, jnp.asarray(tokens), jnp.asarray(lens), caches, sub)
        x0 = np.array(x0)
        outs: list[list[int]] = [[int(x0[i])] for i in range(b)]
        stats = [SpecStats(self.t) for _ in range(b)]
        finish = [None] * b
        for i in range(b):
            finish[i] = self._finished(outs[i], max_new_tokens, eos_ids, stop_check)
        while not all(finish):
            active = np.array([f is None for f in finish])
            key, sub = jax.random.split(key)
            given = None
            if proposer is not None:
                given = jnp.asarray([proposer(i, outs[i], self.t) if active[i] else [0] * self.t
                                     for i in range(b)], jnp.int32).reshape(b, self.t)
            n, emitted, caches = self._step(self.t_state, self.d_state, jnp.asarray(x0), given,
                                            jnp.asarray(lens), jnp.asarray(active), jnp.int32(max_len),
                                            caches, sub)
            n, emitted = np.asarray(n), np.asarray(emitted)
            for i in range(b):
                if not active[i]:
                    continue
                if self.t:
                    stats[i].update(int(n[i]))
                new = [int(x) for x in emitted[i, :n[i] + 1]]
                lens[i] += n[i] + 1
                x0[i] = new[-1]
                for tok in new:
                    outs[i].append(tok)
                    finish[i] = self._finished(outs[i], max_new_tokens, eos_ids, stop_check)
                    if finish[i]:
                        break
                if finish[i] is None and lens[i] >= max_len:
                    finish[i] = "length"       # the next anchor has no cache position left
        self.last_caches = caches          # final cache state, for inspection in tests
        return [(outs[i], finish[i], stats[i]) for i in range(b)]

    @staticmethod
    def _finished(out, max_new_tokens, eos_ids, stop_check) -> str | None:
        if out[-1] in eos_ids or stop_check(out):
            return "stop"
        if len(out) >= max_new_tokens:
            return "length"
        return None


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
             page_size: int = 16, engine: Engine | None = None, proposer=None) -> GenerateResult:
    """Generate continuations for a batch of prompts.

    `target`/`draft` are loaded models or anything `load_target`/`load_draft` accept (a directory
    or a preset name). `prompts`: strings, chat message lists (`[{"role","content"}]`) or token-id
    lists. With `chat=True` strings are wrapped as one user turn and rendered with the target's
    chat template. `draft=None` or `num_speculative_tokens=0` decodes without speculation.
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
    if tokenizer is None and target in _SOURCES:
        from dspark_jax.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(_SOURCES[target])
    ids = [_encode(p, tokenizer, chat, i) for i, p in enumerate(prompts)]

    t = num_speculative_tokens if (draft is not None or proposer is not None) else 0
    longest = max(len(p) for p in ids)
    limit = max_model_len or _default_max_len(target)
    for i, p in enumerate(ids):
        if len(p) + t + 1 > limit:
            raise RequestError(f"prompts[{i}]: {len(p)} tokens (+{t + 1} for one verify step) exceed "
                               f"max_model_len={limit}")
    # bucketed so repeated calls reuse compiled steps
    max_len = min(limit, -(-(longest + max_new_tokens + t + 1) // 128) * 128)
    eos = set()
    if target.cfg.eos_token_id is not None:
        eos.add(int(target.cfg.eos_token_id))
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    stops = list(stop or [])

    def stop_check(out: list[int]) -> bool:
        if not stops or tokenizer is None:
            return False
        text = tokenizer.decode(out)
        return any(s in text for s in stops)

    if engine is None:
        engine = _engine(target, draft, t, temperature, top_p, kv_cache_dtype, page_size)
    results = engine.run(ids, max_new_tokens, max_len, eos, stop_check, seed, proposer)
    outputs, total = [], SpecStats(engine.t)
    for p, (toks, reason, st) in zip(ids, results):
        total.merge(st)
        text = None
        if tokenizer is not None:
            text = tokenizer.decode([x for x in toks if x not in eos])
            for s in stops:
                if s in text:
                    text = text[:text.index(s)]
        outputs.append(RequestOutput(text, toks, reason, p, st.to_dict()))
    return GenerateResult(outputs, total.to_dict())


# compiled engines per target, so repeated generate() calls do not recompile
_ENGINES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _engine(target, draft, t, temperature, top_p, kv_cache_dtype, page_size) -> Engine:
    per_target = _ENGINES.setdefault(target, {})
    key = (id(draft), t, float(temperature), float(top_p), kv_cache_dtype, page_size)
    eng = per_target.get(key)
    if eng is None or eng.draft is not draft:
        eng = per_target[key] = Engine(target, draft, t, temperature, top_p, kv_cache_dtype, page_size)
    return eng


def _default_max_len(target) -> int:
    cfg = target.cfg
    return int(getattr(cfg, "max_position_embeddings", 0) or 4096)


def _encode(prompt, tokenizer, chat: bool, i: int) -> list[int]:
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, (int, np.integer)) for x in prompt):
        return [int(x) for x in prompt]
    if tokenizer is None:
        raise RequestError(f"prompts[{i}]: text prompts need a tokenizer (pass tokenizer= or load the "
                           "target with load_target so its tokenizer is found)")
    if isinstance(prompt, str):
        if not chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        for j, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(f"prompts[{i}][{j}]: a message needs string 'role' and 'content'")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tokenizer.encode(text)
    raise RequestError(f"prompts[{i}]: expected a string, a list of messages or a list of token ids")
