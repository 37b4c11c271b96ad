"""Model surgery on a DSpark draft: copies of it with another vocabulary (`remap_vocabulary`) or
more decoder layers (`add_layers`), and setting a reduced draft's kept ids (`set_vocab_map`).
The starting points `train.distill --init_from --draft_vocab / --add_layers` and
`train.average` build; the file form of the map lives in checkpoint/draft_layout.py."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax.config.draft import DraftConfig
from dspark_jax.models.dspark import K3DSparkModel, vocab_map_arrays


def set_vocab_map(draft: K3DSparkModel, target_ids) -> None:
    """Give a reduced-vocabulary draft its kept target ids (ascending, K of them)."""
    cfg = draft.cfg
    if not cfg.reduced_vocab:
        raise ValueError("the draft has the full vocabulary (config.json draft_vocab_size == vocab_size)")
    d2t, t2d = vocab_map_arrays(target_ids, cfg.vocab_size)
    if d2t.shape != (cfg.draft_vocab,):
        raise ValueError(f"{d2t.shape[0]} kept ids, config.json draft_vocab_size = {cfg.draft_vocab}")
    draft.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    draft.t2d.set_value(jnp.asarray(t2d))


def remap_vocabulary(draft: K3DSparkModel, target_ids) -> K3DSparkModel:
    """A copy of a draft with the draft vocabulary `target_ids` (K ascending target ids): every
    parameter as it is except the Markov head's output side `markov_w2`, whose row for a kept id is
    the draft's own row for that id where the draft has one (a full draft has one for every id) and
    zero where it has none (no bigram bias until trained); the map set (the lm_head rows come from
    the target at run time). From a full draft its drafts are the full draft's whenever those fall
    in the kept set."""
    cfg = draft.cfg
    ids = np.asarray(target_ids, np.int64)
    src = params_lib.flat_params(draft)
    dtype = next(iter(src.values())).get_value().dtype
    moved = K3DSparkModel(DraftConfig.from_dict({**cfg.raw, "draft_vocab_size": int(ids.size)}), dtype=dtype,
                          rngs=nnx.Rngs(0))
    set_vocab_map(moved, ids)
    # the draft's row index of each kept id (-1: not in its vocabulary)
    own = draft.draft_token_ids()
    row_of = np.full(cfg.vocab_size, -1, np.int64)
    row_of[np.arange(cfg.vocab_size) if own is None else np.asarray(own, np.int64)] = np.arange(cfg.draft_vocab)
    rows = row_of[ids]
    for name, p in params_lib.flat_params(moved).items():
        value = src[name].get_value()
        if name == "markov_head.markov_w2.weight":
            kept = jnp.take(value, jnp.asarray(np.maximum(rows, 0)), axis=0)
            value = jnp.where(jnp.asarray(rows >= 0)[:, None], kept, jnp.zeros((), value.dtype))
        p.set_value(value)
    return moved


# the tensors that write a decoder layer's result into the residual stream
_LAYER_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def add_layers(draft: K3DSparkModel, n: int) -> K3DSparkModel:
    """A copy of a draft with `n` more decoder layers after its last (num_hidden_layers + n), each
    a copy of the last layer with its residual outputs (`o_proj`, `down_proj`) zero: the new layers
    add nothing until trained, so the copy drafts exactly as the original does (depth grown as
    LoRA grows rank: the zero side gets the first gradient). Everything else is copied."""
    cfg = draft.cfg
    if n < 1:
        raise ValueError(f"add_layers: n must be >= 1, got {n}")
    src = params_lib.flat_params(draft)
    dtype = next(iter(src.values())).get_value().dtype
    deeper = K3DSparkModel(DraftConfig.from_dict({**cfg.raw, "num_hidden_layers": cfg.num_hidden_layers + n}),
                           dtype=dtype, rngs=nnx.Rngs(0))
    last = f"layers.{cfg.num_hidden_layers - 1}."
    for name, p in params_lib.flat_params(deeper).items():
        m = re.match(r"layers\.(\d+)\.(.+)", name)
        if m is None or int(m.group(1)) < cfg.num_hidden_layers:
            p.set_value(src[name].get_value())
        elif m.group(2) in _LAYER_OUTPUTS:
            p.set_value(jnp.zeros_like(src[last + m.group(2)].get_value()))
        else:
            p.set_value(src[last + m.group(2)].get_value())
    own = draft.draft_token_ids()
    if own is not None:
        set_vocab_map(deeper, np.asarray(own))
    return deeper
