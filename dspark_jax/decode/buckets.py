"""Shape buckets: the few padded shapes program calls take (batch rows, prompt chunks, step-time
context buckets), so a server compiles a handful of programs, not one per request shape."""

from __future__ import annotations

from typing import Sequence


def pow2(n: int) -> int:
    """The smallest power of two >= n (shape buckets: few compilations)."""
    return 1 << max(n - 1, 0).bit_length()


def time_bucket(n: int, max_len: int) -> int:
    """The bucket step times are kept by for a step whose longest row reaches `n` positions
    (powers of two from 64, at most max_len): its attention costs what that row holds."""
    return min(max(pow2(n), 64), max_len)


def batch_bucket(n: int, num_slots: int) -> int:
    """Rows of a program call over n sequences: powers of two, capped at the slot count."""
    return min(pow2(n), num_slots)


def batch_buckets(n: int, num_slots: int) -> list[int]:
    """The batch buckets of program calls over 1..n sequences, ascending."""
    return sorted({batch_bucket(k, num_slots) for k in range(1, n + 1)})


# What a prefill call costs beside its padded tokens (dispatch, a read of the weights), in tokens:
# demo pair, bf16, 2-core AMD EPYC (AVX-512 BF16, no AMX, XLA_FLAGS unset), 2026-12-07: a call of
# 1 x 64 tokens took 48 ms, of 8 x 64 210 ms and of 8 x 128 394 ms (0.4 ms a token, ~25 ms a call).
PREFILL_CALL_TOKENS = 64


def prefill_groups(lengths: Sequence[int], num_slots: int) -> list[list[int]]:
    """Whole prompts of `lengths` split into prefill calls (indices into `lengths`, longest first):
    a call pads its rows to a batch bucket and its prompts to the longest one's prompt bucket, so
    one call over prompts of very different lengths computes mostly padding, and so do padding rows.
    The split minimises the padded tokens plus `PREFILL_CALL_TOKENS` a call (fewer calls among
    equals)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    # best[i]: (cost, end of the first call) of the calls over order[i:], each padded to its longest
    # prompt. The rest costs no more the fewer prompts it holds, so a first call takes as many as its
    # batch bucket holds: its ends to try are i + 1, 2, 4, ... rows (and the last prompt, the slots).
    best = [(0, n)] * (n + 1)
    for i in range(n - 1, -1, -1):
        width = prefill_bucket(lengths[order[i]])
        ends, rows = {n, min(i + num_slots, n)}, 1
        while rows < min(num_slots, n - i):
            ends.add(i + rows)
            rows *= 2
        best[i] = min(((batch_bucket(j - i, num_slots) * width + PREFILL_CALL_TOKENS + best[j][0], j)
                       for j in ends if j - i <= num_slots), key=lambda c: (c[0], -c[1]))
    groups, i = [], 0
    while i < n:
        groups.append(order[i:best[i][1]])
        i = best[i][1]
    return groups


def chunk_bucket(n: int, budget: int | None) -> int:
    """Width of a prefill call whose longest chunk is n <= budget tokens: its prompt bucket, at
    most the budget (None: no bound)."""
    return prefill_bucket(n) if budget is None else min(prefill_bucket(n), budget)


def prefill_bucket(n: int) -> int:
    """Prefill length buckets: few compilations, bounded padding."""
    b = 16
    while b < n:
        b *= 2
    return b
