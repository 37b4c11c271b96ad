"""What every target model shares: the output it returns for the tokens it processes (logits, the
draft's aux hidden states, the post-final-norm hidden state; docs/architecture.md §2) and its
vocabulary head."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.cache import KDAStates, TargetCaches
from dspark_jax.layers.linear import Linear, linear_io

if TYPE_CHECKING:
    from dspark_jax.layers.kda import KDASnapshots


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
    """The contract every target family implements, with these signatures (a family may ignore an
    option, never refuse it): a backbone at `model` (with `embed_tokens`) and the vocabulary
    projection (`lm_head`, or the embeddings themselves when the config ties them).

    A family file defines: its decoder layers and backbone; `run` (embeddings -> layers with the
    attention supplied by the caller -> final hidden, aux capture, `head`); the cacheless `forward`;
    the cached interface (`attention_rows`, `row_width`, `new_kda_states`, `forward_cached`);
    optionally `serving_weights`; and its loader. Its config class and the `model_type` switch in
    `config.load_config` / `api.load_target` make it loadable."""

    def __init__(self, cfg, backbone: nnx.Module, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = backbone
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"),
                                  dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.get_value().dtype

    def forward(self, token_ids_BS: jax.Array, aux_layer_ids: Sequence[int] = (), *,
                positions_BS: jax.Array | None = None, valid_BS: jax.Array | None = None) -> ForwardOutput:
        """Cacheless causal forward over whole sequences (tests, parity checks, the teacher): token j
        attends to tokens i <= j with `valid_BS[i]`; `positions_BS` (default 0..S-1) are the tokens'
        positions where the family's attention uses them."""
        raise NotImplementedError

    def __call__(self, token_ids_BS: jax.Array, aux_layer_ids: Sequence[int] = (), **kw) -> ForwardOutput:
        return self.forward(token_ids_BS, aux_layer_ids, **kw)

    # -- the cached interface (steps.target_forward, engine.Engine) ----------------------------

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

    def serving_weights(self) -> dict | None:
        """Copies of the weights in a layout the backend runs faster, built once per engine and
        passed back to `forward_cached` as `weights` (None: the family has no such layout)."""
        return None

    def forward_cached(self, tokens_BT: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
                       caches: TargetCaches, aux_layer_ids: tuple[int, ...] = (), *, verify: bool,
                       weights: dict | None = None, logits_rows_BR: jax.Array | None = None
                       ) -> tuple[ForwardOutput, TargetCaches, KDASnapshots | None]:
        """(ForwardOutput, caches, KDA snapshots or None) for T tokens per sequence at their
        positions: see `steps.target_forward`. `weights`: `serving_weights()`, or None for the
        declared params. `logits_rows_BR`: the lm_head on these rows only (`logits` [B,R,V]; a
        prefill needs the last prompt row's)."""
        raise NotImplementedError

    def head(self, final_BTD: jax.Array, logits_rows_BR: jax.Array | None = None,
             head_weight_DV: jax.Array | None = None) -> jax.Array:
        """The logits of `final_BTD` (of its rows `logits_rows_BR` only, when given), through
        `head_weight_DV` (a serving layout's [in, out] copy) when given."""
        if logits_rows_BR is not None:
            final_BTD = jnp.take_along_axis(final_BTD, logits_rows_BR[..., None], axis=1)
        if head_weight_DV is not None:
            return linear_io(final_BTD, head_weight_DV)
        return self.logits(final_BTD)

    def logits(self, final_hidden: jax.Array) -> jax.Array:
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.attend(final_hidden)
        return self.lm_head(final_hidden)
