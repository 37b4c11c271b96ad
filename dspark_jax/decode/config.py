"""The engine's and the scheduler's settings, each validated once, before any model loads.

`EngineConfig` holds what shapes the compiled programs and the caches: drafts per verify step T,
cache storage dtype, page size. `SchedulerConfig` holds what the scheduler decides with: slots,
sequence capacity, the prefill token budget per step and how each step's speculation length is
chosen (`speculative_length`: adaptive from measured costs, or always T;
`dspark_jax.decode.spec_length`). `define_flags()` declares the command-line flags of both (one
definition, one set of defaults) for every program; `from_flags()` builds and validates them.

The plain-decoding rule lives here: speculation needs both a proposer (a draft model, or an
external proposer in tests) and T > 0; otherwise the engine decodes plainly (`for_pair`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from absl import flags

from dspark_jax.cache import storage_dtype
from dspark_jax.decode.spec_length import SPECULATIVE_LENGTHS, StepCosts
from dspark_jax.errors import RequestError

KV_CACHE_DTYPES = ("auto", "bf16", "fp32", "fp8")

# Prompt tokens one prefill call computes per engine step (vLLM's name; its default for online
# serving). It bounds how long a long prompt stalls the running streams (one chunk per step, not
# the whole prompt) and the prefill program's activation memory (a whole 16K-token prompt does not
# fit Kimi-K3 on 8 x 288 GB); larger chunks amortise the weight reads of a prefill better.
MAX_NUM_BATCHED_TOKENS = 2048


# --dtype of the entry points (serving.pair.resolve_dtype): the compute dtype the pair is loaded in
DTYPE_CHOICES = ("checkpoint", "float32", "bfloat16", "auto")
DTYPE_HELP = ("Target compute dtype (the draft follows it): auto = bfloat16 on GPUs/TPUs and on CPUs whose XLA "
              "runs bf16 GEMMs natively (AVX-512 BF16 / AMX; numerics.native_bf16_gemm), else as stored; "
              "checkpoint = as stored; float32 / bfloat16 = cast to it.")


@dataclass(frozen=True)
class EngineConfig:
    """What shapes the compiled programs and the caches' storage."""

    num_speculative_tokens: int = 7          # T: drafts per verify step (each step verifies T + 1)
    kv_cache_dtype: str = "auto"             # paged-pool storage: auto (model dtype), bf16, fp32, fp8
    page_size: int = 16                      # tokens per cache page (ATOM's --block_size)

    def __post_init__(self):
        if self.num_speculative_tokens < 0:
            raise RequestError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        try:
            storage_dtype(self.kv_cache_dtype, "float32")
        except ValueError as e:
            raise RequestError(str(e)) from None
        if self.page_size < 1:
            raise RequestError(f"page_size (--block_size) must be >= 1, got {self.page_size}")

    @property
    def speculative(self) -> bool:
        return self.num_speculative_tokens > 0

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def for_pair(self, draft, *, proposer=None) -> tuple[object, "EngineConfig"]:
        """(draft, config) as the engine runs them: without a draft (and without an external
        proposer) T is 0; with no drafts per step the draft is not used."""
        if draft is None and proposer is None:
            return None, self.replace(num_speculative_tokens=0)
        if not self.speculative:
            return None, self
        return draft, self


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler decides with: its slots and their capacity, the prefill token budget and
    how each step's speculation length is chosen. Validated once, here."""

    max_num_seqs: int = 8                    # cache slots: sequences decoded together
    max_model_len: int | None = None         # tokens per sequence; None: from the target (`max_len_for`)
    # "adaptive": each step verifies the L in 0..T of most expected tokens per second, from the
    # acceptance measured so far and the measured cost of a step at its batch size (where a verify
    # of T+1 tokens a row is compute-bound, a CPU at batch 8, L shrinks, down to one-token steps);
    # "fixed": always T (the compiled programs take L as a static width)
    speculative_length: str = "adaptive"
    # the step-cost model for "adaptive" (None: measured on the host it runs on and cached on disk,
    # spec_length.costs_for); compared by identity
    step_costs: StepCosts | None = None
    # prompt tokens per engine step: longer prompts are prefilled chunk by chunk, interleaved with
    # the decode steps of the running sequences. None: no bound, whole prompts all at once
    # (offline batches, `generate()`'s default; the server's flag defaults to MAX_NUM_BATCHED_TOKENS)
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise RequestError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.speculative_length not in SPECULATIVE_LENGTHS:
            raise RequestError(f"speculative_length must be one of {', '.join(SPECULATIVE_LENGTHS)}, "
                               f"got {self.speculative_length!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise RequestError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise RequestError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def replace(self, **changes) -> "SchedulerConfig":
        return dataclasses.replace(self, **changes)

    def max_len_for(self, target) -> int:
        """The sequence capacity: `max_model_len`, else the target's position limit capped at 4096."""
        return self.max_model_len or min(position_limit(target), 4096)


def position_limit(target) -> int:
    """The target's position limit (max_position_embeddings; 4096 when the config has none)."""
    return int(getattr(target.cfg, "max_position_embeddings", 0) or 4096)


def check_prompt(num_tokens: int, t: int, max_len: int, where: str = "prompt") -> None:
    """Raise RequestError unless a prompt of `num_tokens` and one verify step of T + 1 fit a
    sequence of `max_len` tokens (the one place the prompt length is checked)."""
    if num_tokens + t + 1 > max_len:
        raise RequestError(f"{where}: {num_tokens} tokens (+{t + 1} for one verify step) exceed "
                           f"max_model_len={max_len}")


def define_flags(flag_values=None, **defaults) -> None:
    """Declare --num_speculative_tokens, --kv_cache_dtype, --block_size, --max_num_seqs,
    --max_model_len (ATOM's names), --speculative_length and --max_num_batched_tokens (vLLM's).
    `defaults`
    overrides a default where a program's purpose differs (serve.plan plans Kimi-K3 deployments at
    ATOM's page size and context)."""

    fv = flag_values or flags.FLAGS
    base, sched = EngineConfig(), SchedulerConfig()
    d = dict(num_speculative_tokens=base.num_speculative_tokens, kv_cache_dtype=base.kv_cache_dtype,
             block_size=base.page_size, max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len,
             speculative_length=sched.speculative_length, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    unknown = set(defaults) - set(d)
    if unknown:
        raise ValueError(f"unknown engine flags {sorted(unknown)}")
    d.update(defaults)
    flags.DEFINE_integer("num_speculative_tokens", d["num_speculative_tokens"],
                         "Drafts per step T (the block width; with --speculative_length adaptive the most "
                         "a step verifies); 0 = plain decoding.", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_enum("kv_cache_dtype", d["kv_cache_dtype"], list(KV_CACHE_DTYPES),
                      "Paged cache storage: auto (the model's dtype), bf16, fp32 or fp8 (e4m3fn, scale 1.0).",
                      flag_values=fv)
    flags.DEFINE_integer("block_size", d["block_size"], "Tokens per page of the paged cache.", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("max_num_seqs", d["max_num_seqs"], "Cache slots: sequences decoded together.",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("max_model_len", d["max_model_len"], "Tokens per sequence, prompt + output (default: "
                         "min(max_position_embeddings, 4096)).", lower_bound=2, flag_values=fv)
    flags.DEFINE_enum("speculative_length", d["speculative_length"], list(SPECULATIVE_LENGTHS),
                      "adaptive: each step verifies the L in 0..T of most expected tokens/s, from the measured "
                      "acceptance and step costs (measured once per host, model and dtype, cached beside the "
                      "compilation cache); fixed: always T.", flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", d["max_num_batched_tokens"],
                         "Prompt tokens prefilled per engine step: a longer prompt goes in chunk by chunk between "
                         "the running sequences' decode steps, so it stalls them for one chunk at a time; it also "
                         "bounds the prefill's activation memory (vLLM's online-serving default).",
                         lower_bound=1, flag_values=fv)


class ServingConfig(NamedTuple):
    """What the command-line flags set: the engine's settings and the scheduler's."""
    engine: EngineConfig
    scheduler: SchedulerConfig


def from_flags(flag_values=None) -> ServingConfig:
    """The engine's and the scheduler's settings of the parsed flags (raises RequestError on a bad
    combination, before any model loads)."""

    fv = flag_values or flags.FLAGS
    engine = EngineConfig(num_speculative_tokens=fv.num_speculative_tokens, kv_cache_dtype=fv.kv_cache_dtype,
                          page_size=fv.block_size)
    scheduler = SchedulerConfig(max_num_seqs=fv.max_num_seqs, max_model_len=fv.max_model_len,
                                speculative_length=fv.speculative_length,
                                max_num_batched_tokens=fv.max_num_batched_tokens)
    if scheduler.max_model_len is not None:
        check_prompt(1, engine.num_speculative_tokens, scheduler.max_model_len, "--max_model_len")
    return ServingConfig(engine, scheduler)
