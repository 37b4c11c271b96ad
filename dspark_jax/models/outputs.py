"""What every target model shares: the output it returns for the tokens it processes (DESIGN
§3.1) and its vocabulary head."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from dspark_jax.cache import KDAStates, TargetCaches
from dspark_jax.layers.linear import Linear


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


class TargetLM(nnx.Module):
    """A backbone at `model` (with `embed_tokens`) and the vocabulary projection: `lm_head`, or the
    embeddings themselves when the config ties them."""

    def __init__(self, cfg, backbone: nnx.Module, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = backbone
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"),
                                  dtype=dtype, rngs=rngs)

    # whether `forward_cached` takes `logits_rows_BR` (compute the lm_head on those rows only:
    # a prefill needs its last prompt row's logits, not all S rows')
    logits_rows_supported = False

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.get_value().dtype

    # -- the cached interface every family implements (steps.target_forward, engine.Engine) ----

    @property
    def attention_rows(self) -> int:
        """Rows of the paged pool this target's attention layers take (a draft's rows follow)."""
        raise NotImplementedError

    @property
    def row_width(self) -> int:
        """Width of one of its pool rows."""
        raise NotImplementedError

    def new_kda_states(self, batch: int, dtype) -> KDAStates | None:
        """Zero linear-attention states for `batch` sequences (None: the family has none)."""
        return None

    def forward_cached(self, tokens_BT: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                       caches: TargetCaches, aux_layer_ids: tuple[int, ...] = (), *, verify: bool):
        """(ForwardOutput, caches, KDA snapshots or None) for T tokens per sequence at their
        positions: see `steps.target_forward`."""
        raise NotImplementedError

    def logits(self, final_hidden: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.attend(final_hidden)
        return self.lm_head(final_hidden)
