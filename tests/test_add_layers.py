"""`add_layers` (train.distill --init_from DIR --add_layers N): a deeper draft that drafts exactly
as the original until trained, whose new layers are wired in, and that saves and loads as a
draft with the larger num_hidden_layers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.draft_io import load_draft, save_torch_draft
from dspark_jax.checkpoint.draft_layout import add_layers
from tests.test_draft_vocab import KEPT_TINY, make_reduced_torch_draft
from tests.test_dspark_draft import TINY, _inputs


def _block(draft, seed: int):
    aux, lm_head = _inputs(seed)
    embed = np.random.default_rng(seed + 1).standard_normal((96, TINY["hidden_size"])).astype(np.float32)
    return [None if x is None else np.asarray(x) for x in draft.block_forward(aux, 17, embed, lm_head)]


def test_added_layers_draft_as_before_until_trained(tmp_path):
    make_reduced_torch_draft(tmp_path / "d", dtype=torch.float32, seed=11)
    old = load_draft(tmp_path / "d", dtype=jnp.float32)
    deep = add_layers(old, 2)
    n = old.cfg.num_hidden_layers
    assert deep.cfg.num_hidden_layers == n + 2 and len(deep.layers) == n + 2
    np.testing.assert_array_equal(np.asarray(deep.draft_token_ids()), KEPT_TINY)
    got, src = params_lib.flat_params(deep), params_lib.flat_params(old)
    for name, p in got.items():
        parts = name.split(".", 2)
        if parts[0] != "layers" or int(parts[1]) < n:
            np.testing.assert_array_equal(np.asarray(p.get_value()), np.asarray(src[name].get_value()), name)
        elif parts[2] in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert not np.any(np.asarray(p.get_value())), name
        else:    # a copy of the last layer
            np.testing.assert_array_equal(np.asarray(p.get_value()),
                                          np.asarray(src[f"layers.{n - 1}.{parts[2]}"].get_value()), name)
    for seed in (0, 1):
        for a, b in zip(_block(old, seed), _block(deep, seed)):
            np.testing.assert_array_equal(a, b)
    # the new layers are in the forward pass: a non-zero output projection changes the logits
    w = deep.layers[n + 1].self_attn.o_proj.weight
    w.set_value(jnp.asarray(np.random.default_rng(3).standard_normal(w.get_value().shape), jnp.float32))
    assert not np.array_equal(_block(old, 0)[0], _block(deep, 0)[0])
    # saved and loaded as a deeper draft of the same vocabulary
    save_torch_draft(deep, {**deep.cfg.raw}, tmp_path / "deep")
    back = load_draft(tmp_path / "deep", dtype=jnp.float32)
    assert back.cfg.num_hidden_layers == n + 2
    for a, b in zip(_block(deep, 1), _block(back, 1)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="n must be >= 1"):
        add_layers(old, 0)
