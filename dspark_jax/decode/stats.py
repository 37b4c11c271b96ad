"""Speculative-decoding statistics in ATOM's /debug/mtp_stats schema (docs/architecture.md §5.5), plus
per-position acceptance, and the paired comparison of two drafts' acceptance on the same prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class SpecStats:
    num_speculative_tokens: int
    total_draft_tokens: int = 0
    total_accepted_tokens: int = 0
    distribution: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)   # drafts accepted at position k
    plain_steps: int = 0       # one-token steps (speculation length 0)
    length_counts: list[int] = field(default_factory=list)          # steps that verified L drafts, L = 0..T

    def __post_init__(self):
        t = self.num_speculative_tokens
        self.distribution = self.distribution or [0] * (t + 1)
        self.accepted_at_position = self.accepted_at_position or [0] * t
        self.length_counts = self.length_counts or [0] * (t + 1)

    def update(self, n: int, verified: int | None = None) -> None:
        """One verify step in which `verified` drafts (default T) were scored and n accepted."""
        verified = self.num_speculative_tokens if verified is None else verified
        self.total_draft_tokens += verified
        self.total_accepted_tokens += n
        self.distribution[n] += 1
        self.length_counts[verified] += 1
        for k in range(n):
            self.accepted_at_position[k] += 1

    def plain(self) -> None:
        """One step that verified no drafts (a one-token step of a speculative engine)."""
        self.plain_steps += 1
        self.length_counts[0] += 1

    def merge(self, other: "SpecStats") -> None:
        self.plain_steps += other.plain_steps
        self.length_counts = [a + b for a, b in zip(self.length_counts, other.length_counts)]
        self.total_draft_tokens += other.total_draft_tokens
        self.total_accepted_tokens += other.total_accepted_tokens
        self.distribution = [a + b for a, b in zip(self.distribution, other.distribution)]
        self.accepted_at_position = [a + b for a, b in zip(self.accepted_at_position, other.accepted_at_position)]

    @classmethod
    def from_dict(cls, d: dict) -> "SpecStats":
        """The statistics a `to_dict()` holds (a request's `stats` in `generate()`'s outputs)."""
        steps_n = d["num_verify_steps"]
        distribution = [d["distribution"][str(i)] for i in range(len(d["distribution"]))]
        # per-position acceptance is a count over the verify steps: the product is an integer
        at_position = [round(p * steps_n) for p in d["per_position_acceptance"]]
        lengths = d.get("verify_length_counts", {})
        return cls(len(distribution) - 1, d["total_draft_tokens"], d["total_accepted_tokens"], distribution,
                   at_position, d.get("num_plain_steps", 0), [lengths.get(str(i), 0) for i in range(len(distribution))])

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
            # steps that ran without drafts (not verify steps: they count in none of the above)
            "num_plain_steps": self.plain_steps,
            # the speculation length each step chose: steps (per sequence) that verified L drafts
            "verify_length_counts": {str(i): c for i, c in enumerate(self.length_counts)},
        }


def paired_difference(base: dict, other: dict, *, samples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """`other`'s aggregate tok/fwd minus `base`'s on one benchmark, and a paired bootstrap 95 %
    interval of it over the prompts (both rows from the same prompts, in the same order)."""
    steps = [np.asarray(r["per_prompt_verify_steps"], np.float64) for r in (base, other)]
    acc = [np.asarray(r["per_prompt_accepted"], np.float64) for r in (base, other)]
    n = steps[0].size
    if n == 0 or any(x.size != n for x in (*steps, *acc)):
        raise ValueError(f"paired_difference: {n} and {steps[1].size} prompts; the rows must hold the same prompts")
    diff = (acc[1].sum() / steps[1].sum()) - (acc[0].sum() / steps[0].sum())
    idx = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    boot = acc[1][idx].sum(1) / steps[1][idx].sum(1) - acc[0][idx].sum(1) / steps[0][idx].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(diff), float(lo), float(hi)


def paired_mean_difference(base: Sequence[float], other: Sequence[float], *, samples: int = 2000,
                           seed: int = 0) -> tuple[float, float, float]:
    """The mean over prompts of `other[i] - base[i]` (one value per prompt each, e.g. tok/fwd, the
    same prompts in the same order), and a paired bootstrap 95 % interval of it: the prompts
    resampled with replacement, the same draw for both."""
    diff = np.asarray(other, np.float64) - np.asarray(base, np.float64) if len(base) == len(other) else None
    if diff is None or diff.size == 0:
        raise ValueError(f"paired_mean_difference: {len(base)} and {len(other)} values; the same prompts needed")
    idx = np.random.default_rng(seed).integers(0, diff.size, size=(samples, diff.size))
    lo, hi = np.percentile(diff[idx].mean(axis=1), [2.5, 97.5])
    return float(diff.mean()), float(lo), float(hi)
