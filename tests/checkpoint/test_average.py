"""Averaging a run's exported drafts (`dspark_jax.checkpoint.average`, `train.average`) and the
trainer keeping its last exports (`keep_exports`): tiny drafts, seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.average import average_torch_drafts
from dspark_jax.checkpoint.draft_io import load_draft, open_torch_draft, save_torch_draft
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.train import batches, loop
from dspark_jax.train import loss as L
from dspark_jax.train import trainer as T
from tests.gen_utils import answer_samples, tiny_draft, tiny_llama

REPO = Path(__file__).resolve().parents[2]
KEPT = list(range(0, 96, 2)) + [95]          # a reduced vocabulary (the map must survive averaging)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _save(target, seed: int, dst: Path, *, kept=KEPT, markov_rank: int = 8) -> Path:
    draft = tiny_draft(target, seed=seed, kept_ids=kept, markov_rank=markov_rank)
    cfg = dict(draft.cfg.raw, torch_dtype="bfloat16")
    save_torch_draft(draft, cfg, dst)
    return dst


def test_the_average_is_the_mean_of_the_loaded_weights_rounded_once(target, tmp_path):
    srcs = [_save(target, seed, tmp_path / f"d{seed}") for seed in (1, 2, 3)]
    out = average_torch_drafts(srcs, tmp_path / "avg")
    loaded = [params_lib.flat_params(load_draft(p, dtype=jnp.float32)) for p in srcs]
    got = params_lib.flat_params(load_draft(tmp_path / "avg", dtype=jnp.float32))
    assert set(got) == set(loaded[0])
    moved = 0
    for name, p in got.items():
        vals = [np.asarray(m[name].get_value(), np.float64) for m in loaded]    # bf16 values, exact in f64
        want = (sum(vals) / 3).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(p.get_value()), want, err_msg=name)
        moved += int(not np.array_equal(want, vals[0]))
    assert moved == len(got)                     # every tensor is a new value, not a copy of one input
    avg = load_draft(tmp_path / "avg", dtype=jnp.float32)
    assert np.asarray(avg.draft_token_ids()).tolist() == KEPT
    assert out.config_bytes == open_torch_draft(srcs[0]).config_bytes


def test_averaging_one_draft_with_itself_writes_the_same_file(target, tmp_path):
    src = _save(target, 1, tmp_path / "d")
    average_torch_drafts([src, src, src], tmp_path / "avg")
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "avg" / f).read_bytes() == (src / f).read_bytes(), f


def test_drafts_that_differ_in_config_or_map_are_refused_and_nothing_is_written(target, tmp_path):
    a = _save(target, 1, tmp_path / "a")
    other_map = _save(target, 2, tmp_path / "b", kept=sorted(list(range(1, 96, 2)) + [94]))
    with pytest.raises(CheckpointError, match="tensor 'd2t' differs"):
        average_torch_drafts([a, other_map], tmp_path / "avg")
    other_cfg = _save(target, 3, tmp_path / "c", markov_rank=4)
    with pytest.raises(CheckpointError, match=r"config.json: differs .* in \['markov_rank'\]"):
        average_torch_drafts([a, other_cfg], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".avg")] == []   # no staging left
    with pytest.raises(ValueError, match="no drafts"):
        average_torch_drafts([], tmp_path / "avg")


def test_trainer_keeps_its_last_exports_and_the_program_averages_them(target, tmp_path):
    draft = tiny_draft(target, seed=1)
    run_dir = tmp_path / "run"
    cfg = T.TrainConfig(run_dir=str(run_dir), total_steps=4, global_batch=4, micro_batch=2, max_len=48, lr=3e-3,
                        compute_dtype="float32", save_every=1, keep_exports=3, loss=L.LossConfig(num_anchors=16))
    trainer = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft, log=lambda m: None)
    loop.run(trainer, batches.SampleSource(answer_samples(target, max_new_tokens=24), 0))
    exports = sorted(p.name for p in (run_dir / "export").iterdir())
    assert exports == ["step_0000002", "step_0000003", "step_0000004"]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "train.average", f"--drafts={run_dir / 'export' / 'step_*'}", "--last=2",
           f"--out={tmp_path / 'avg'}"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "averaged 2 drafts" in res.stdout and "step_0000002" not in res.stdout
    want = average_torch_drafts([run_dir / "export" / e for e in exports[1:]], tmp_path / "avg_lib")
    assert (tmp_path / "avg" / "model.safetensors").read_bytes() == want.file.path.read_bytes()
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "destination exists" in again.stderr
    missing = subprocess.run(cmd[:3] + [f"--drafts={run_dir / 'export' / 'step_0000002'},{tmp_path / 'nothing'}",
                                        f"--out={tmp_path / 'avg2'}"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode != 0 and "--drafts: no draft directory at" in missing.stderr
    assert not (tmp_path / "avg2").exists()
    assert json.loads((tmp_path / "avg" / "config.json").read_text())["markov_rank"] == draft.cfg.raw["markov_rank"]


def test_drafts_with_different_maps_average_once_moved_to_one_vocabulary(target, tmp_path):
    """`draft_vocab` (`train.average --draft_vocab`): a full draft and a reduced one average on one
    map; each is moved first (`remap_vocabulary`: the Markov rows of the ids it held, zero rows for
    the others), then the mean rounded once. The program reads the map from a train.vocab file."""
    from dspark_jax.models.draft_surgery import remap_vocabulary
    full = _save(target, 1, tmp_path / "full", kept=None)
    reduced = _save(target, 2, tmp_path / "reduced")                  # KEPT: even ids and 95
    new = sorted(set(range(0, 96, 3)) | {95})                          # shares some ids with KEPT
    out = average_torch_drafts([full, reduced], tmp_path / "avg", draft_vocab=new)
    got = load_draft(tmp_path / "avg", dtype=jnp.float32)
    assert np.asarray(got.draft_token_ids()).tolist() == new
    assert json.loads(out.config_bytes)["draft_vocab_size"] == len(new)
    moved = [params_lib.flat_params(remap_vocabulary(load_draft(p, dtype=jnp.float32), np.asarray(new)))
             for p in (full, reduced)]
    w2 = np.asarray(moved[1]["markov_head.markov_w2.weight"].get_value())
    lacked = [i for i, t in enumerate(new) if t not in KEPT]
    assert lacked and not np.any(w2[lacked]) and np.any(w2)           # ids the reduced draft lacked: zero
    for name, p in params_lib.flat_params(got).items():
        want = sum(np.asarray(m[name].get_value(), np.float64) for m in moved) / 2
        np.testing.assert_array_equal(np.asarray(p.get_value()), want.astype(ml_dtypes.bfloat16).astype(np.float32),
                                      err_msg=name)
    with pytest.raises(CheckpointError, match="ascending, distinct ids"):
        average_torch_drafts([full], tmp_path / "bad", draft_vocab=[3, 2])
    assert not (tmp_path / "bad").exists()
    # the program: the same file, the map read from a vocabulary file (train.vocab's keys)
    (tmp_path / "vocab.json").write_text(json.dumps({"draft_vocab_size": len(new), "token_ids": new}))
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-m", "train.average", f"--drafts={full},{reduced}",
                          f"--draft_vocab={tmp_path / 'vocab.json'}", f"--out={tmp_path / 'avg_cli'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "each moved to a vocabulary of" in res.stdout
    assert (tmp_path / "avg_cli" / "model.safetensors").read_bytes() == out.file.path.read_bytes()
