"""`add_layers` (train.distill --init_from DIR --add_layers N): a deeper draft that drafts as the
original until trained, whose new layers are wired in, and that saves and loads as a draft with
the larger num_hidden_layers. The forward comparison runs in float64 (tests/float64.py): the two
graphs differ, so a float32 result could differ by one CPU's summation order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.draft_io import load_draft, save_torch_draft
from dspark_jax.models.draft_surgery import add_layers
from tests.draft_utils import KEPT_TINY, TINY, draft_inputs, make_reduced_torch_draft
from tests.float64 import assert_close, rel_err, x64


def _block(draft, seed: int):
    aux, lm_head = draft_inputs(seed)
    embed = np.random.default_rng(seed + 1).standard_normal((96, TINY["hidden_size"]))
    logits, tokens, conf = draft.block_forward(aux.astype(np.float64), 17, embed, lm_head.astype(np.float64))
    return np.asarray(logits), np.asarray(tokens), np.asarray(conf)


def _values(draft) -> dict[str, np.ndarray]:
    return {n: np.asarray(p.get_value()) for n, p in params_lib.flat_params(draft).items()}


def test_added_layers_draft_as_before_until_trained(tmp_path):
    make_reduced_torch_draft(tmp_path / "d", dtype=torch.float32, seed=11)
    with x64():
        old = load_draft(tmp_path / "d", dtype=jnp.float64)
        deep = add_layers(old, 2)
        n = old.cfg.num_hidden_layers
        assert deep.cfg.num_hidden_layers == n + 2 and len(deep.layers) == n + 2
        np.testing.assert_array_equal(np.asarray(deep.draft_token_ids()), KEPT_TINY)
        got, src = _values(deep), _values(old)
        for name, value in got.items():
            parts = name.split(".", 2)
            if parts[0] != "layers" or int(parts[1]) < n:
                np.testing.assert_array_equal(value, src[name], name)
            elif parts[2] in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                assert not np.any(value), name
            else:    # a copy of the last layer
                np.testing.assert_array_equal(value, src[f"layers.{n - 1}.{parts[2]}"], name)
        for seed in (0, 1):
            (l_old, t_old, c_old), (l_deep, t_deep, c_deep) = _block(old, seed), _block(deep, seed)
            assert_close(l_deep, l_old, "base logits")
            assert_close(c_deep, c_old, "confidence")
            np.testing.assert_array_equal(t_deep, t_old)
        # the new layers are in the forward pass: a non-zero output projection moves the logits
        w = deep.layers[n + 1].self_attn.o_proj.weight
        w.set_value(jnp.asarray(np.random.default_rng(3).standard_normal(w.get_value().shape)))
        assert rel_err(_block(deep, 0)[0], _block(old, 0)[0]) > 1e-3
    # saved and loaded as a deeper draft of the same vocabulary, every tensor as it was
    deep32 = add_layers(load_draft(tmp_path / "d", dtype=jnp.float32), 2)
    save_torch_draft(deep32, {**deep32.cfg.raw}, tmp_path / "deep")
    back = load_draft(tmp_path / "deep", dtype=jnp.float32)
    assert back.cfg.num_hidden_layers == n + 2
    np.testing.assert_array_equal(np.asarray(back.draft_token_ids()), KEPT_TINY)
    want, have = _values(deep32), _values(back)
    assert sorted(want) == sorted(have)
    for name in want:
        np.testing.assert_array_equal(have[name], want[name], name)
    with pytest.raises(ValueError, match="n must be >= 1"):
        add_layers(old, 0)
