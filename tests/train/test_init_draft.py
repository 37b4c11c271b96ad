"""The starting draft of a distillation run (dspark_jax/train/init_draft.py): flag combinations
refused by name, --draft_config's fresh draft, --init_from's draft deepened and moved to a reduced
vocabulary, the vocabulary pinned to the run directory, and a fresh reduced draft given its map."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.train.init_draft import DraftInit, DraftInitError, InitialDraft, finish, prepare
from tests.draft_utils import KEPT_TINY, TINY, make_torch_draft


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(tensor=1, data=1, devices=jax.devices()[:1])


def _vocab_file(path: Path, ids) -> str:
    ids = [int(i) for i in ids]
    path.write_text(json.dumps({"draft_vocab_size": len(ids), "token_ids": ids}) + "\n")
    return str(path)


def _config_file(path: Path) -> str:
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize("init, flag", [
    (DraftInit(init_from="d", warm_start=True), "cannot be combined with --init_from"),
    (DraftInit(draft_config="c.json", add_layers=2), "--add_layers grows --init_from's draft"),
    (DraftInit(), "--draft_config or --init_from is required"),
])
def test_impossible_combinations_are_refused_by_flag(init, flag):
    with pytest.raises(DraftInitError, match=flag):
        init.check()


def test_a_config_alone_leaves_the_init_to_the_trainer(tmp_path, mesh):
    init = DraftInit(draft_config=_config_file(tmp_path / "draft.json"))
    initial = prepare(init, tmp_path / "run", mesh, log=lambda _: None)
    assert initial.model is None and initial.kept_ids is None
    assert initial.cfg.num_hidden_layers == TINY["num_hidden_layers"] and not initial.cfg.reduced_vocab
    assert finish(initial, init, target=None, mesh=mesh) is None
    assert not (tmp_path / "run").exists()          # nothing pinned without --draft_vocab


def test_init_from_deepened_and_moved_to_a_reduced_vocabulary(tmp_path, mesh):
    make_torch_draft(tmp_path / "src", seed=2)
    init = DraftInit(init_from=str(tmp_path / "src"), add_layers=1,
                     draft_vocab=_vocab_file(tmp_path / "vocab.json", KEPT_TINY))
    logged = []
    initial = prepare(init, tmp_path / "run", mesh, log=logged.append)
    assert initial.model.cfg.num_hidden_layers == TINY["num_hidden_layers"] + 1
    assert initial.cfg.draft_vocab == len(KEPT_TINY) and initial.cfg.reduced_vocab
    np.testing.assert_array_equal(np.asarray(initial.model.draft_token_ids()), KEPT_TINY)
    assert initial.kept_ids == KEPT_TINY.tolist()
    assert any("decoder layers" in m for m in logged) and any("reduced draft vocabulary" in m for m in logged)
    # the map is pinned to the run: a resume must give the same file
    assert json.loads((tmp_path / "run" / "vocab.json").read_text())["token_ids"] == KEPT_TINY.tolist()
    assert finish(initial, init, target=None, mesh=mesh) is initial.model
    other = DraftInit(init_from=init.init_from, draft_vocab=_vocab_file(tmp_path / "other.json", KEPT_TINY[:-1]))
    with pytest.raises(DraftInitError, match="differs from the vocabulary this run started with"):
        prepare(other, tmp_path / "run", mesh, log=lambda _: None)


def test_a_vocabulary_that_does_not_reduce_is_refused(tmp_path, mesh):
    init = DraftInit(draft_config=_config_file(tmp_path / "draft.json"),
                     draft_vocab=_vocab_file(tmp_path / "vocab.json", range(TINY["vocab_size"])))
    with pytest.raises(DraftInitError, match="do not reduce the target's vocabulary of 96"):
        prepare(init, tmp_path / "run", mesh, log=lambda _: None)


def test_a_fresh_reduced_draft_is_the_trainers_init_with_the_map(tmp_path, mesh):
    init = DraftInit(draft_config=_config_file(tmp_path / "draft.json"), seed=5,
                     draft_vocab=_vocab_file(tmp_path / "vocab.json", KEPT_TINY))
    initial = prepare(init, tmp_path / "run", mesh, log=lambda _: None)
    assert isinstance(initial, InitialDraft) and initial.model is None
    model = finish(initial, init, target=None, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(model.draft_token_ids()), KEPT_TINY)
    # the same random init the Trainer draws from the seed: only the map is added
    want = sharding.create_sharded(lambda: K3DSparkModel(initial.cfg, dtype=jnp.float32, rngs=nnx.Rngs(5)), mesh)
    got = params_lib.flat_params(model)
    for name, p in params_lib.flat_params(want).items():
        np.testing.assert_array_equal(np.asarray(got[name].get_value()), np.asarray(p.get_value()), err_msg=name)
