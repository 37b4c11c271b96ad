"""Drawing tokens from logits: greedy or temperature + top-p sampling, and the draft's Markov
head drafting left to right (docs/architecture.md §3.3). Shared by the engine's programs, verification and the
draft's cacheless reference.

`SamplingParams` is the one bundle of sampling settings: a request carries one of numbers, a
program call one of per-row arrays [B] (`SamplingParams.batch`), passed as one argument from the
HTTP protocol through the scheduler and the engine to the step functions. A new option is a field
here (its default is what a greedy row and a padding row take), its use in `filter_logits` and the
protocol field that sets it; nothing between them names it."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.numerics import acc_dtype, argmax

# The Markov scan is unrolled (T is small and static): as a while loop, XLA:CPU hands the loop a
# float32 copy of the whole bf16 W1 table on every call (0.5 ms of a 3.8 ms draft pass at batch 1
# for SmolLM2's 49,152 x 32); unrolled, each row's conversion fuses into its gather.
_UNROLL_MARKOV = True


class SamplingParams(NamedTuple):
    """Sampling settings: numbers (one request, or one setting for every row) or per-row arrays
    [B] (a program call; traced, so rows of any settings share one compiled program)."""

    temperature: float | jax.Array = 0.0   # 0: greedy (the argmax)
    top_p: float | jax.Array = 1.0         # nucleus mass; 1: the full distribution

    @classmethod
    def batch(cls, settings: Sequence["SamplingParams"], rows: int) -> "SamplingParams":
        """Per-row host arrays [rows] of `settings` (one per leading row), the rows past them at the
        defaults (greedy)."""
        columns = []
        for name, default in cls._field_defaults.items():
            dtype = np.float32 if isinstance(default, float) else np.int32
            col = np.full(rows, default, dtype)
            col[:len(settings)] = [getattr(s, name) for s in settings]
            columns.append(col)
        out = cls(*columns)
        return out._replace(temperature=np.maximum(out.temperature, 0.0))

    def rows(self, n: int) -> "SamplingParams":
        """These settings as per-row host arrays [n] (numbers broadcast)."""
        return SamplingParams(*(np.broadcast_to(np.asarray(v, np.float32 if isinstance(d, float) else np.int32), (n,))
                                for v, d in zip(self, self._field_defaults.values())))

    @property
    def sampled(self) -> bool:
        """Whether any row samples (host values only): the programs' static flag."""
        return bool(np.any(np.asarray(self.temperature) > 0))


GREEDY = SamplingParams()


def markov_draft(draft, base_BTV: jax.Array, x0_B: jax.Array, sampling: SamplingParams = GREEDY,
                 key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The Markov head, left to right: logits_k = base_k + W1[prev_k] W2^T (fp32; float64 under
    x64), d_{k+1} drawn from them (argmax at temperature 0; `sampling` as in `sample_tokens`),
    prev_{k+1} = d_{k+1}. Returns drafts as target ids and the biased logits
    over the draft vocabulary [B,T,K] (K = V unless reduced: the drawn draft index is mapped to
    its target id, which is also the next previous token)."""
    t = base_BTV.shape[1]
    keys = jax.random.split(key, t) if key is not None else jnp.zeros((t, 2), jnp.uint32)

    def step(prev_B, xs):
        base_BV, k = xs
        logits_BV = base_BV.astype(acc_dtype(base_BV)) + draft.markov_bias(prev_B)
        idx_B = sample_tokens(logits_BV, sampling, k if key is not None else None)
        tok_B = draft.to_target_ids(idx_B).astype(prev_B.dtype)
        return tok_B, (tok_B, logits_BV)

    _, (tokens_TB, logits_TBV) = jax.lax.scan(step, x0_B, (jnp.swapaxes(base_BTV, 0, 1), keys),
                                              unroll=_UNROLL_MARKOV)
    return jnp.swapaxes(tokens_TB, 0, 1), jnp.swapaxes(logits_TBV, 0, 1)


def filter_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Temperature + top-p applied identically to draft and target distributions (log-probs).
    `sampling`: Python numbers (one setting, fixed in the program) or per-row arrays [B] over
    logits [B, ..., V] (traced: one program serves every setting). A row at temperature 0 is
    computed at temperature 1 (its token is the argmax: `sample_tokens`, `accept_sampling`); a
    row at top_p 1 keeps its full distribution, bit for bit."""
    temperature, top_p = sampling.temperature, sampling.top_p
    if not _per_row(temperature) and not _per_row(top_p):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        return logp if top_p >= 1.0 else _nucleus(logp, top_p)
    t = _row_values(temperature, logits)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0), axis=-1)
    p = _row_values(top_p, logits)
    # the sort over the vocabulary runs only in steps where some row asks for a nucleus
    return jax.lax.cond(jnp.any(p < 1.0), lambda lp: jnp.where(p >= 1.0, lp, _nucleus(lp, p)), lambda lp: lp, logp)


def _per_row(x) -> bool:
    return not isinstance(x, (int, float))


def _row_values(x, like: jax.Array) -> jax.Array:
    """Per-row values [B] (or a number) shaped to broadcast over `like` [B, ..., V]."""
    x = jnp.asarray(x, jnp.float32)
    return x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


def _nucleus(logp: jax.Array, top_p) -> jax.Array:
    """The smallest set of most probable tokens whose mass reaches top_p, renormalised."""
    order = jnp.argsort(-logp, axis=-1)
    sorted_p = jnp.exp(jnp.take_along_axis(logp, order, axis=-1))
    keep_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p      # always keeps the top token
    keep = _unsort(keep_sorted, order)
    logp = jnp.where(keep, logp, -jnp.inf)
    return jax.nn.log_softmax(logp, axis=-1)


def _unsort(values, order):
    """Inverse of `take_along_axis(x, order, -1)` on the last axis."""
    flat_v = values.reshape(-1, values.shape[-1])
    flat_o = order.reshape(-1, order.shape[-1])
    out = jnp.zeros_like(flat_v).at[jnp.arange(flat_v.shape[0])[:, None], flat_o].set(flat_v)
    return out.reshape(values.shape)


def sample_tokens(logits_BV: jax.Array, sampling: SamplingParams, key: jax.Array | None) -> jax.Array:
    """A token per row: argmax where the row's temperature is 0 (or no key is given), else drawn
    from the row's filtered distribution (`filter_logits`: numbers or per-row arrays)."""
    greedy = argmax(logits_BV)
    temperature = sampling.temperature
    if key is None or (not _per_row(temperature) and temperature <= 0):
        return greedy
    drawn = jax.random.categorical(key, filter_logits(logits_BV, sampling), axis=-1).astype(jnp.int32)
    return drawn if not _per_row(temperature) else jnp.where(jnp.asarray(temperature) > 0, drawn, greedy)
