"""`generate()`: the library's batched generation call, and the request helpers it
shares with the server, the benchmark and answer generation (prompt encoding, end-of-sequence
ids, stop strings, output text).

It validates the call, builds (or reuses) the `Engine` for its setting and runs every prompt
through one `Scheduler`. `draft=None` or `num_speculative_tokens=0` is plain decoding through the
same code (`EngineConfig.for_pair`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

from dspark_jax.api import load_draft, load_target
from dspark_jax.decode.buckets import pow2
from dspark_jax.decode.config import EngineConfig, SchedulerConfig, check_prompt, position_limit
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.requests import encode_prompt, eos_ids, output_text, stop_checker, tokenizer_for
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.decode.spec_length import StepCosts
from dspark_jax.decode.stats import SpecStats
from dspark_jax.errors import RequestError
from dspark_jax.kernels.dispatch import kernel_mode, mla_paged_min_keys
from dspark_jax.sampling import SamplingParams


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
    length (`buckets.prefill_groups`; the server's default is 2048).
    `max_num_seqs`: sequences decoded at once (cache slots); a prompt waits for a slot, taken as
    soon as a sequence finishes (continuous batching, as the server does), so a cache for this
    many sequences is allocated rather than one for every prompt. None (the default): all prompts at once.
    Returns `result.outputs[i].text / .token_ids / .finish_reason / .stats` and aggregate
    `result.stats` (ATOM mtp_stats schema plus per-position acceptance)."""

    if isinstance(target, str) or hasattr(target, "__fspath__"):
        target = load_target(target, dtype=dtype)
    if draft is not None and (isinstance(draft, str) or hasattr(draft, "__fspath__")):
        draft = load_draft(draft, dtype=target.dtype)
    config = EngineConfig(num_speculative_tokens=num_speculative_tokens, kv_cache_dtype=kv_cache_dtype,
                          page_size=page_size)
    scheduling = SchedulerConfig(max_num_seqs=max_num_seqs or 1, max_model_len=max_model_len,
                                 speculative_length=speculative_length, step_costs=step_costs,
                                 max_num_batched_tokens=max_num_batched_tokens)
    if max_num_seqs is not None and max_num_seqs < 1:
        raise RequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    draft, config = config.for_pair(draft, proposer=proposer)
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

    t = config.num_speculative_tokens
    longest = max(len(p) for p in ids)
    limit = max_model_len or position_limit(target)
    for i, p in enumerate(ids):
        check_prompt(len(p), t, limit, f"prompts[{i}]")
    # bucketed (powers of two) so repeated calls reuse compiled steps
    max_len = min(limit, max(128, pow2(longest + max_new_tokens + t + 1)))
    eos = frozenset(eos_ids(target, tokenizer))
    stops = list(stop or [])
    check = stop_checker(stops, tokenizer)

    if engine is None:
        engine = engine_for(target, draft, config)
    scheduling = scheduling.replace(max_num_seqs=min(max_num_seqs or len(ids), len(ids)), max_model_len=max_len)
    scheduler = Scheduler(engine, scheduling, seed=seed, proposer=proposer)
    reqs = scheduler.run([Request(p, max_new_tokens, SamplingParams(temperature, top_p), eos, check, index=i)
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
    key = (id(draft), config, kernel_mode(), mla_paged_min_keys())
    eng = per_target.get(key)
    if eng is None or eng.draft is not draft:
        eng = per_target[key] = Engine(target, draft, config)
    return eng
