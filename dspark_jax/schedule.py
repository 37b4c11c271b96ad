"""Confidence-scheduled verify length (docs/architecture.md §5.6, Algorithm 1 of ATOM's DSpark scheduler).

The draft's confidence head gives c_rk = P(draft k of row r is accepted | drafts < k were). Before
verifying, the scheduler picks how many drafts L_r of each row to verify, from the confidences
alone (non-anticipating: it never looks at the target's verdict, which is why truncating the
drafts keeps speculative decoding lossless). With survival a_rk = c_r1 * ... * c_rk (the
probability that draft k gets accepted), a step that verifies B tokens emits on average
tau = R + sum of the admitted a_rk tokens and takes time fixed + per_token * B. Draft positions
are admitted in decreasing survival while tau / time still grows; a_rk never increases along k,
so what is admitted is a prefix of every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerifyCost:
    """Step time model t(B) = fixed + per_token * B for B verified tokens (any unit; only the
    ratio matters). `benchmarks.decode_speed` measures it for a model pair."""

    fixed: float = 1.0
    per_token: float = 0.05

    def __post_init__(self):
        if self.fixed <= 0 or self.per_token < 0:
            raise ValueError(f"VerifyCost needs fixed > 0 and per_token >= 0, got {self}")


def verify_lengths(confidence_RT: np.ndarray, cost: VerifyCost) -> np.ndarray:
    """Drafts to verify per row, [R] int in 0..T, maximizing expected tokens per unit time."""
    conf = np.clip(np.asarray(confidence_RT, np.float64), 0.0, 1.0)
    r, t = conf.shape
    survival = np.cumprod(conf, axis=1)
    # decreasing survival; among equals, earlier positions first (keeps each row a prefix)
    order = np.lexsort((np.tile(np.arange(t), r), -survival.ravel()))
    lengths = np.zeros(r, np.int64)
    tau, tokens = float(r), float(r)          # every row verifies its anchor: one token each
    for idx in order:
        a = survival.flat[idx]
        if (tau + a) * (cost.fixed + cost.per_token * tokens) <= tau * (cost.fixed + cost.per_token * (tokens + 1)):
            break                              # admitting a lower survival can only do worse
        tau, tokens = tau + a, tokens + 1
        lengths[idx // t] += 1
    return lengths
