"""`generate()`: the library's batched generation call, and the request helpers it
shares with the server, the benchmark and answer generation (prompt encoding, end-of-sequence
ids, stop strings, output text).

It validates the call, builds (or reuses) the `Engine` for its setting and runs every prompt
through one `Batcher`. `draft=None` or `num_speculative_tokens=0` is plain decoding through the
same code (`EngineConfig.for_pair`).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dspark_jax.batcher import Batcher, Request, pow2
from dspark_jax.engine import Engine
from dspark_jax.engine_config import EngineConfig
from dspark_jax.errors import RequestError
from dspark_jax.kernels.dispatch import kernel_mode, mla_paged_min_keys
from dspark_jax.spec_length import StepCosts
from dspark_jax.sources import source_of
from dspark_jax.stats import SpecStats


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


def generate(target, draft=None, prompts: Sequence[Any] = (), max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, num_speculative_tokens: int = 7,
             stop: Sequence[str] | None = None, seed: int = 0, chat: bool = True, *,
             tokenizer=None, max_model_len: int | None = None, kv_cache_dtype: str = "auto",
             page_size: int = 16, engine: Engine | None = None, proposer=None,
             speculative_length: str = "adaptive", step_costs: StepCosts | None = None,
             max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
             dtype="auto") -> GenerateResult:
    """Generate continuations for a batch of prompts.

    `target`/`draft` are loaded models or anything `load_target`/`load_draft` accept (a directory
    or a preset name); one given by name is loaded in `dtype` (`load_target`'s meaning: "auto" is
    bfloat16 where it runs fast, else the checkpoint's), a draft given by name in the target's dtype.
    `prompts`: strings, chat message lists (`[{"role","content"}]`) or token-id
    lists. With `chat=True` strings are wrapped as one user turn and rendered with the target's
    chat template. `draft=None` or `num_speculative_tokens=0` decodes without speculation.
    `speculative_length="adaptive"` (the default) lets each step verify the L in 0..T drafts of
    most expected tokens per second, from the acceptance measured so far and the step costs
    measured on the host it runs on (the first call at a new batch size measures them, once per host, model
    and dtype; docs/profile.md); `"fixed"` always verifies T. `step_costs`: a `StepCosts` to use
    instead of measured ones. Output is the same either way.
    `max_num_batched_tokens`: prompt tokens prefilled per engine step (longer prompts go in chunk
    by chunk, between the decode steps of those already in; output is unchanged); None (the
    default): every prompt whole, all before the first decode step, in calls of prompts of like
    length (`batcher.prefill_groups`; the server's default is 2048).
    `max_num_seqs`: sequences decoded at once (cache slots); a prompt waits for a slot, taken as
    soon as a sequence finishes (continuous batching, as the server does), so a cache for this
    many sequences is allocated rather than one for every prompt. None (the default): all prompts at once.
    Returns `result.outputs[i].text / .token_ids / .finish_reason / .stats` and aggregate
    `result.stats` (ATOM mtp_stats schema plus per-position acceptance)."""
    from dspark_jax.api import load_draft, load_target

    if isinstance(target, str) or hasattr(target, "__fspath__"):
        target = load_target(target, dtype=dtype)
    if draft is not None and (isinstance(draft, str) or hasattr(draft, "__fspath__")):
        draft = load_draft(draft, dtype=target.dtype)
    config = EngineConfig(num_speculative_tokens=num_speculative_tokens, kv_cache_dtype=kv_cache_dtype,
                          page_size=page_size, max_model_len=max_model_len, speculative_length=speculative_length,
                          step_costs=step_costs, max_num_batched_tokens=max_num_batched_tokens)
    draft, config = config.for_pair(draft, proposer=proposer)
    if proposer is not None and temperature > 0:
        raise RequestError("an external proposer supports greedy verification only (temperature=0)")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise RequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
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

    t = config.num_speculative_tokens
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

    if engine is None:
        engine = engine_for(target, draft, config)
    batcher = Batcher(engine, min(max_num_seqs or len(ids), len(ids)), max_len, seed=seed, proposer=proposer,
                      speculative_length=config.speculative_length, step_costs=config.step_costs,
                      max_num_batched_tokens=config.max_num_batched_tokens)
    reqs = batcher.run([Request(p, max_new_tokens, temperature, top_p, eos, check, index=i)
                        for i, p in enumerate(ids)])
    outputs, total = [], SpecStats(engine.t)
    for r in reqs:
        total.merge(r.stats)
        text = output_text(r.tokens, tokenizer, eos, stops) if tokenizer is not None else None
        outputs.append(RequestOutput(text, r.tokens, r.finish_reason, r.prompt, r.stats.to_dict()))
    return GenerateResult(outputs, total.to_dict())


# compiled engines of the most recently used targets, so repeated generate() calls do not
# recompile. An engine holds its target, so a mapping weakly keyed by the target would never drop
# an entry (each target ever passed would stay alive, with its engines and their programs); the
# cache holds the engines of the last few targets instead.
MAX_CACHED_TARGETS = 4
_ENGINES: "collections.OrderedDict[int, tuple[Any, dict]]" = collections.OrderedDict()


def engine_for(target, draft, config: EngineConfig) -> Engine:
    """The Engine for one setting, kept per target (the last `MAX_CACHED_TARGETS`), so repeated
    `generate()` calls (and regen, benchmarks) reuse its compiled programs, whatever their sampling."""
    entry = _ENGINES.get(id(target))
    if entry is None or entry[0] is not target:
        entry = _ENGINES[id(target)] = (target, {})
    _ENGINES.move_to_end(id(target))
    while len(_ENGINES) > MAX_CACHED_TARGETS:
        _ENGINES.popitem(last=False)
    per_target = entry[1]
    programs = config.replace(max_num_seqs=1, max_model_len=None, speculative_length="adaptive", step_costs=None,
                              max_num_batched_tokens=None)
    key = (id(draft), programs, kernel_mode(), mla_paged_min_keys())
    eng = per_target.get(key)
    if eng is None or eng.draft is not draft:
        eng = per_target[key] = Engine(target, draft, config)
    return eng


# ---------------------------------------------------------------------------------------------
# request helpers shared with the server and the benchmark


# tokenizers per target: loading SmolLM2's tokenizer.json took ~130 ms, paid by every generate()
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def tokenizer_for(target):
    """The tokenizer of a target loaded with `load_target` (None if its directory is unknown),
    loaded once per target and directory."""
    source = source_of(target)
    if source is None:
        return None
    cached = _TOKENIZERS.get(target)
    if cached is not None and cached[0] == source:
        return cached[1]
    from dspark_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(source)
    _TOKENIZERS[target] = (source, tok)
    return tok


def eos_ids(target, tokenizer) -> set[int]:
    """Every token id that ends generation: the config's and the tokenizer's."""
    eos = {int(i) for i in target.cfg.eos_token_ids}
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
