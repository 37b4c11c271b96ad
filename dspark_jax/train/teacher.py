"""Teacher hidden states for distillation: online (inside the training step) or offline (shards).

Both paths hand the loss the same two arrays per sequence: the concatenated aux hidden states of
the draft's `target_layer_ids` [S, n_aux*H] and the target's post-final-norm hidden state [S, H]
(docs/architecture.md §2, §4), computed by the same jitted `teacher_outputs` on right-padded [B, S] batches.

The offline path's shard format (writer, reader, checks) is `teacher_shards`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.train.fp8_rows import quantize_rows_jax
from dspark_jax.train.regen import Sample


class TeacherOutputs(NamedTuple):
    aux_BSA: jax.Array            # concatenated aux hidden states of the draft's target layers
    final_hidden_BSH: jax.Array   # post-final-norm hidden state (the lm_head input)


def teacher_outputs(target, input_ids_BS: jax.Array, valid_BS: jax.Array,
                    aux_layer_ids: Sequence[int]) -> TeacherOutputs:
    """The teacher's prefill (cacheless target forward over right-padded rows), no gradient."""
    out = target.forward(input_ids_BS, tuple(aux_layer_ids), valid_BS=valid_BS)
    return TeacherOutputs(jax.lax.stop_gradient(out.aux_hidden), jax.lax.stop_gradient(out.final_hidden))


class StoredRows(NamedTuple):
    """Hidden states as a shard stores them: in the directory's aux_dtype, with the float32
    per-row scales when that is float8 (None otherwise)."""
    aux: Any                  # [..., n_aux*H]
    final: Any                # [..., H]
    aux_scale: Any = None     # [..., n_aux]
    final_scale: Any = None   # [..., 1]


def stored_rows(aux_A, final_H, meta, quantize: Callable) -> StoredRows:
    """aux [..., n_aux*H] and final [..., H] in storage form; `quantize`: `quantize_rows` on the
    host, `quantize_rows_jax` on the device (the same bits)."""
    if not meta.scaled:
        dt = np.dtype(jnp.dtype(meta.aux_dtype))
        return StoredRows(aux_A.astype(dt), final_H.astype(dt))
    lead, g, h = aux_A.shape[:-1], len(meta.aux_layer_ids), meta.hidden_size
    aux_q, aux_s = quantize(aux_A.reshape(*lead, g, h))
    final_q, final_s = quantize(final_H.reshape(*lead, 1, h))
    return StoredRows(aux_q.reshape(*lead, g * h), final_q.reshape(*lead, h), aux_s, final_s)


def stored_outputs(target, input_ids_BS: jax.Array, valid_BS: jax.Array, meta) -> StoredRows:
    """The teacher's prefill with its hidden states put in storage form on the device (float8:
    half the bytes to copy to the host, and the host does no per-value work)."""
    out = teacher_outputs(target, input_ids_BS, valid_BS, meta.aux_layer_ids)
    return stored_rows(out.aux_BSA, out.final_hidden_BSH, meta, quantize_rows_jax)


def frozen_tables(target) -> tuple[jax.Array, jax.Array]:
    """The target's embedding table and lm_head [V, D] (the same array when tied)."""
    embed = target.model.embed_tokens.weight.get_value()
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight.get_value()
    return embed, head


def pad_batch(samples: Sequence[Sample], max_len: int,
              batch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded (input_ids int32, loss_mask bool, valid bool), each [batch, max_len]; rows
    past len(samples) are empty (all padding)."""
    b = batch or len(samples)
    ids = np.zeros((b, max_len), np.int32)
    mask = np.zeros((b, max_len), bool)
    valid = np.zeros((b, max_len), bool)
    for i, s in enumerate(samples):
        n = min(len(s.input_ids), max_len)
        ids[i, :n] = s.input_ids[:n]
        mask[i, :n] = s.loss_mask[:n]
        valid[i, :n] = True
    return ids, mask, valid
