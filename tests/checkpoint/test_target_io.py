"""Kimi-family target HF -> Orbax (`convert.target`) and `load_kimi_orbax`: the same logits as the
HF load on one device and restored into an 8-device sharding, storage chunks aligned with the
shards, and the loader's failure classes reported by name with nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.checkpoint import orbax_io, target_io
from dspark_jax.checkpoint.loader import load_kimi
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.models.kimi import KimiLinearModel
from tests.gen_utils import randomize
from tests.kimi_configs import tiny_k3_dict, write_k3_checkpoint

ROOT = Path(__file__).resolve().parents[2]
Q_PROJ = "language_model.model.layers.1.self_attn.q_proj.weight"


def _config() -> dict:
    """Tiny K3 (every extension, MXFP4 experts) with 8 heads and 8 experts so that an 8-way
    tensor axis shards heads, experts and vocab; stored in float32."""
    d = tiny_k3_dict(quantized=True)
    t = d["text_config"]
    t.update(num_attention_heads=8, num_key_value_heads=8, num_experts=8, dtype="float32",
             linear_attn_config=dict(t["linear_attn_config"], num_heads=8))
    return d


def _write_hf(path: Path, model: KimiLinearModel, config: dict, **defect) -> Path:
    write_k3_checkpoint(model, path, config, **defect)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, HF dir, Orbax dir) converted once for the module."""
    cfg = KimiConfig.from_dict(_config())
    model = KimiLinearModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    randomize(model, 0)
    root = tmp_path_factory.mktemp("target")
    hf = _write_hf(root / "hf", model, _config())
    orbax_dir = target_io.convert_target(hf, root / "orbax")
    return model, hf, orbax_dir


def _leftovers(dst: Path) -> list[Path]:
    return list(dst.parent.glob(f".{dst.name}*"))


# one jitted function for the module: models of one structure and sharding share its compiled
# program (a fresh jit per call would compile the same program once per model)
_LOGITS = jax.jit(lambda m, x: m.forward(x).logits)


def _logits(model, ids):
    return np.asarray(_LOGITS(model, ids))


def _spec(p: nnx.Param) -> tuple:
    return tuple(p.get_value().sharding.spec)


def test_orbax_load_equals_hf_load_on_one_and_eight_devices(tiny):
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    model, hf, orbax_dir = tiny
    assert target_io.is_orbax_target_dir(orbax_dir) and not target_io.is_orbax_target_dir(hf)
    assert not _leftovers(orbax_dir)
    assert (orbax_dir / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    assert (orbax_dir / "tokenizer_config.json").is_file()
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 96, size=(2, 12)))

    # one device: the same weights bit for bit, so the same logits exactly
    from_hf = load_kimi(hf)
    from_orbax = target_io.load_kimi_orbax(orbax_dir)
    for name, p in params_lib.flat_params(from_hf).items():
        q = params_lib.flat_params(from_orbax)[name].get_value()
        assert q.dtype == p.get_value().dtype, name
        np.testing.assert_array_equal(np.asarray(q), np.asarray(p.get_value()), err_msg=name)
    packed = from_orbax.model.layers[1].block_sparse_moe.experts.w1.weight_packed.get_value()
    assert packed.dtype == jnp.uint8 and packed.shape == (8, 32, 16)      # MXFP4 stays packed, stacked
    one = _logits(from_orbax, ids)
    np.testing.assert_array_equal(one, _logits(from_hf, ids))
    np.testing.assert_array_equal(one, _logits(model, ids))

    # eight devices: restored straight into the rules table's shardings
    mesh = sharding.make_mesh(tensor=8)
    sharded = target_io.load_kimi_orbax(orbax_dir, mesh=mesh)
    layer1 = sharded.model.layers[1]
    assert _spec(layer1.self_attn.q_proj.weight) == ("tensor", None)
    assert _spec(layer1.block_sparse_moe.experts.w1.weight_packed) == ("tensor", None, None)
    assert _spec(layer1.block_sparse_moe.experts.w2.weight_scale) == ("tensor", None, None)
    assert _spec(sharded.lm_head.weight) == ("tensor", None)
    assert _spec(sharded.model.layers[4].self_attn.kv_b_proj.weight) == ("tensor", None)
    for p in params_lib.flat_params(sharded).values():
        assert len(p.get_value().sharding.device_set) == 8
    shard0 = layer1.block_sparse_moe.experts.w1.weight_packed.get_value().addressable_shards[0]
    assert shard0.data.shape == (1, 32, 16)                               # one expert per device
    eight = _logits(sharded, ids)
    # the same sharded program as the HF load into the same mesh: identical
    np.testing.assert_array_equal(eight, _logits(load_kimi(hf, mesh=mesh), ids))
    # vs one device: only the f32 reduction order of sharded matmuls and the EP psum differs,
    # through 5 layers (measured max 3.2e-5 on O(1) logits)
    np.testing.assert_allclose(eight, one, rtol=1e-4, atol=1e-4)


def test_dtype_override_casts_floats_and_keeps_packed(tiny):
    _, _, orbax_dir = tiny
    m = target_io.load_kimi_orbax(orbax_dir, dtype=jnp.bfloat16)
    layer1 = m.model.layers[1]
    assert layer1.self_attn.q_proj.weight.get_value().dtype == jnp.bfloat16
    assert layer1.self_attn.A_log.get_value().dtype == jnp.float32          # F32 in the checkpoint
    assert layer1.block_sparse_moe.experts.w1.weight_packed.get_value().dtype == jnp.uint8


def test_storage_chunks_follow_the_tensor_sharding(tmp_path, monkeypatch):
    """With chunks smaller than the tiny tensors: every chunk lies inside one 8-way shard of the
    rules table's sharding (so a TP/EP-8 host restoring its shards reads no other host's bytes),
    and a chunk never spans two experts."""
    import orbax.checkpoint.experimental.v1 as ocp

    monkeypatch.setattr(target_io, "CHUNK_BYTES", 256)
    cfg = KimiConfig.from_dict(_config())
    model = KimiLinearModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dst = target_io.convert_target(_write_hf(tmp_path / "hf", model, _config()), tmp_path / "orbax")
    meta = orbax_io.flatten(ocp.metadata(dst / "params").metadata)
    mesh = sharding.make_mesh(tensor=8)
    checked = 0
    for name, p in params_lib.flat_params(model).items():
        shape = p.get_value().shape
        spec = sharding.logical_to_spec(params_lib.logical_axes(p), shape, mesh)
        chunk = meta[name].storage_metadata.chunk_shape
        assert np.prod(chunk) * np.dtype(p.get_value().dtype).itemsize <= 256 or chunk == shape, name
        if ".experts." in name:
            assert chunk[0] == 1, (name, chunk)
        for dim, axis in enumerate(spec):
            if axis == "tensor":
                assert (shape[dim] // 8) % chunk[dim] == 0, (name, shape, chunk)
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("kind", ["missing", "extra", "shape", "dtype", "truncated"])
def test_bad_hf_input_is_named_and_leaves_nothing(tmp_path, kind):
    cfg = KimiConfig.from_dict(_config())
    model = KimiLinearModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kw = {"missing": dict(drop=Q_PROJ), "extra": dict(extra="language_model.model.bogus.weight"),
          "shape": dict(reshape=Q_PROJ), "dtype": dict(retype=Q_PROJ), "truncated": {}}[kind]
    hf = _write_hf(tmp_path / "hf", model, _config(), **kw)
    if kind == "truncated":
        shard = hf / "model-00002-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    dst = tmp_path / "orbax"
    with pytest.raises(CheckpointError) as e:
        target_io.convert_target(hf, dst)
    want = {"missing": Q_PROJ, "extra": "bogus", "shape": Q_PROJ, "dtype": Q_PROJ,
            "truncated": "model-00002-of-00002.safetensors"}[kind]
    assert want in str(e.value), str(e.value)
    assert not dst.exists() and not _leftovers(dst)


def test_bad_orbax_input_is_named(tiny, tmp_path):
    import shutil

    _, hf, orbax_dir = tiny
    with pytest.raises(CheckpointError, match="target_layout.json"):
        target_io.load_kimi_orbax(hf)
    # a config.json that no longer matches the stored params: every mismatch is named
    bad = tmp_path / "edited"
    shutil.copytree(orbax_dir, bad)
    doc = json.loads((bad / "config.json").read_text())
    doc["text_config"]["vocab_size"] = 100
    (bad / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' has shape \[96, 32\]"):
        target_io.load_kimi_orbax(bad)
    # stored float32 where config.json says bfloat16: strict unless a dtype is asked for
    doc["text_config"].update(vocab_size=96, dtype="bfloat16")
    (bad / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="is float32, the model expects bfloat16"):
        target_io.load_kimi_orbax(bad)
    assert target_io.load_kimi_orbax(bad, dtype=jnp.float32) is not None
    # a damaged Orbax tree: named before any restore starts
    (bad / "params" / "state" / "_METADATA").unlink()
    with pytest.raises(CheckpointError, match="params: not a readable Orbax checkpoint"):
        target_io.load_kimi_orbax(bad, dtype=jnp.float32)


def test_cli_converts_and_reports_errors(tiny, tmp_path):
    _, hf, _ = tiny
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    run = lambda src, dst: subprocess.run([sys.executable, "-m", "convert.target", "--src", str(src),
                                           "--dst", str(dst)], cwd=ROOT, env=env, capture_output=True,
                                          text=True, timeout=120)
    ok = run(hf, tmp_path / "out")
    assert ok.returncode == 0, ok.stderr
    assert target_io.is_orbax_target_dir(tmp_path / "out")
    bad = run(tmp_path / "nowhere", tmp_path / "out2")
    assert bad.returncode == 1 and "nowhere" in bad.stderr and not (tmp_path / "out2").exists()
