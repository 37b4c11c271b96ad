"""The output every target model returns for the tokens it processes (DESIGN §3.1)."""

from __future__ import annotations

from typing import NamedTuple

import jax


class ForwardOutput(NamedTuple):
    """What a target forward step yields, in this order.

    - `logits` [B, S, V]: `lm_head(final_hidden)`.
    - `aux_hidden` [B, S, n·H]: for each requested aux layer id L, in the order given, the value
      decoder layer L returns (HF `hidden_states[L+1]` for every layer but the last, whose HF
      entry is already normed), concatenated on the last axis; None when no ids were requested.
      This is what the DSpark draft reads.
    - `final_hidden` [B, S, H]: the post-final-norm hidden state fed to `lm_head`.
    """
    logits: jax.Array
    aux_hidden: jax.Array | None
    final_hidden: jax.Array
