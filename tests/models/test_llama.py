"""Llama target against transformers' LlamaForCausalLM, the dense-cache step, and the generic
streaming loader (errors, stacked experts, sharding)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspark_jax import sharding
from dspark_jax.checkpoint import safetensors_io
from dspark_jax.checkpoint.loader import expert_tensor_name, load_llama, load_state
from dspark_jax.models.llama import LlamaModel
from dspark_jax.models.target import TargetLM
from dspark_jax.params import flat_params, param
from tests.float64 import TorchFloat64, assert_close, share_rope_table, x64

N_LAYERS, VOCAB = 3, 64


def _save_hf(directory, tied: bool, seed: int) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1000.0,
        max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # HF's init (std 0.02, unit norms) makes attention nearly uniform and norms no-ops; larger
    # weights make rope, masking, GQA grouping and the norm weights visible in the outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tied" if request.param else "untied")
    return _save_hf(d, request.param, seed=int(request.param)), d


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    _save_hf(d, tied=False, seed=3)
    return d


def _jit_forward(model, tokens, aux_layer_ids=(), **kw):
    fn = nnx.jit(lambda m, t, kw: m.forward(t, aux_layer_ids, **kw))
    return fn(model, jnp.asarray(tokens), kw)


def _float64_pair(hf_model, d):
    """Our model loaded in float64 (call under x64) and a float64 copy of the torch model, sharing
    one float32 RoPE frequency table (tests/float64.py)."""
    model = load_llama(d, dtype=jnp.float64)
    assert isinstance(model, TargetLM)          # the contract every family implements
    ref = copy.deepcopy(hf_model).double()
    share_rope_table(ref.model.rotary_emb, model.model.layers[0].self_attn.rope)
    return model, ref


def test_matches_transformers(hf):
    """Float64 on both sides (tests/float64.py: transformers' RMSNorm, softmax and RoPE angles are
    float32 inside a double model; TorchFloat64 makes them float64)."""
    hf_model, d = hf
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 11))
    with x64():
        model, hf64 = _float64_pair(hf_model, d)
        assert ("lm_head.weight" in flat_params(model)) == (not hf_model.config.tie_word_embeddings)
        layer_outs = []
        for layer in hf64.model.layers:
            layer.register_forward_hook(
                lambda mod, args, out: layer_outs.append(out[0] if isinstance(out, tuple) else out))
        with torch.no_grad(), TorchFloat64():
            ref = hf64(torch.as_tensor(tokens), output_hidden_states=True)
        out = _jit_forward(model, tokens, tuple(range(N_LAYERS)))
        aux = np.asarray(out.aux_hidden).reshape(2, 11, N_LAYERS, 32)
        for l in range(N_LAYERS):
            assert_close(aux[:, :, l], layer_outs[l], f"layer {l}")
            if l < N_LAYERS - 1:   # HF's last hidden_states entry is post-norm, not the layer output
                assert_close(aux[:, :, l], ref.hidden_states[l + 1], f"hidden_states[{l + 1}]")
        assert_close(np.asarray(out.final_hidden), ref.hidden_states[-1], "final hidden")
        assert_close(np.asarray(out.logits), ref.logits, "logits")

        head = model.model.embed_tokens.weight if hf_model.config.tie_word_embeddings else model.lm_head.weight
        assert_close(np.asarray(out.final_hidden) @ np.asarray(head.get_value()).T, np.asarray(out.logits),
                     "final_hidden @ head")


def test_padded_forward_matches_transformers(hf):
    """Left padding through valid_BS + shifted positions equals HF with an attention mask (float64
    on both sides, tests/float64.py)."""
    hf_model, d = hf
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 8))
    valid = np.ones((2, 8), bool)
    valid[1, :3] = False
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    with x64():
        model, hf64 = _float64_pair(hf_model, d)
        with torch.no_grad(), TorchFloat64():
            ref = hf64(torch.as_tensor(tokens), attention_mask=torch.as_tensor(valid.astype(np.int64)),
                       position_ids=torch.as_tensor(positions)).logits.numpy()
        out = _jit_forward(model, tokens, positions_BS=jnp.asarray(positions), valid_BS=jnp.asarray(valid))
        assert_close(np.asarray(out.logits)[valid], ref[valid], "left-padded logits")


def test_paged_steps_match_cacheless(untied_dir):
    """Through the paged pool (page size 4, so rows cross pages): prefill of ragged rows, then
    token-by-token decode, then a 3-token verify step: every real token's logits/aux equal the
    cacheless forward."""
    from dspark_jax.cache import PagedPool, TargetCaches
    from dspark_jax.decode import steps

    model = load_llama(untied_dir)
    cfg = model.cfg
    rng = np.random.default_rng(2)
    lengths, n_decode, max_len = (7, 4), 3, 24
    full = [rng.integers(0, VOCAB, n + n_decode + 3) for n in lengths]
    aux_ids = (0, 2)
    step = nnx.jit(lambda m, t, p, v, c: steps.target_forward(m, t, p, v, c, aux_ids, verify=False)[:2])
    got = [dict() for _ in lengths]    # row -> {position: (logits, aux)}

    def run(tokens_BT, positions_BT, valid_BT, caches):
        out, caches = step(model, jnp.asarray(tokens_BT), jnp.asarray(positions_BT), jnp.asarray(valid_BT), caches)
        for b in range(len(lengths)):
            for t, p in enumerate(positions_BT[b]):
                if valid_BT[b, t]:
                    got[b][int(p)] = (np.asarray(out.logits[b, t]), np.asarray(out.aux_hidden[b, t]))
        return caches

    pool = PagedPool.create(cfg.num_hidden_layers, len(lengths), max_len, 4,
                            2 * cfg.num_key_value_heads * cfg.head_dim, jnp.float32)
    caches = TargetCaches(pool, None)
    t0 = max(lengths)
    tok = np.zeros((2, t0), np.int64)
    pos = np.tile(np.arange(t0), (2, 1))
    valid = pos < np.array(lengths)[:, None]
    for b, n in enumerate(lengths):
        tok[b, :n] = full[b][:n]
    caches = run(tok, pos, valid, caches)
    for i in range(n_decode):
        caches = run(np.array([[full[b][n + i]] for b, n in enumerate(lengths)]),
                     np.array([[n + i] for n in lengths]), np.ones((2, 1), bool), caches)
    cur = [n + n_decode for n in lengths]
    caches = run(np.stack([full[b][c:c + 3] for b, c in enumerate(cur)]),
                 np.stack([np.arange(c, c + 3) for c in cur]), np.ones((2, 3), bool), caches)

    for b, seq in enumerate(full):
        ref = _jit_forward(model, seq[None], aux_ids)
        assert sorted(got[b]) == list(range(len(seq)))
        for p, (logits, aux) in got[b].items():
            # same f32 math over a longer (masked) key axis: only summation order differs
            np.testing.assert_allclose(logits, ref.logits[0, p], rtol=1e-5, atol=1e-5, err_msg=f"row {b} pos {p}")
            np.testing.assert_allclose(aux, ref.aux_hidden[0, p], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# loader errors


def _tensors(d) -> dict[str, np.ndarray]:
    f = safetensors_io.SafetensorsFile(d / "model.safetensors")
    return {n: f.read(n) for n in f.keys()}


def _variant(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    arrays = _tensors(src)
    edit(arrays)
    safetensors_io.save_arrays(dst / "model.safetensors", arrays)
    return str(dst / "model.safetensors")


def test_loader_missing_tensor(untied_dir, tmp_path):
    _variant(untied_dir, tmp_path / "m", lambda a: a.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(safetensors_io.CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_llama(tmp_path / "m")


def test_loader_extra_tensor(untied_dir, tmp_path):
    f = _variant(untied_dir, tmp_path / "m", lambda a: a.update({"vision_tower.x.weight": np.zeros(3, np.float32)}))
    with pytest.raises(safetensors_io.CheckpointError, match=rf"{f}: unexpected tensor 'vision_tower\.x\.weight'"):
        load_llama(tmp_path / "m")
    cfg = load_llama(untied_dir).cfg
    abstract = nnx.eval_shape(lambda: LlamaModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    model = load_state(abstract, tmp_path / "m", ignore=[r"^vision_tower\."])
    np.testing.assert_array_equal(model.model.norm.weight.get_value(), _tensors(untied_dir)["model.norm.weight"])


def test_loader_wrong_shape(untied_dir, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    f = _variant(untied_dir, tmp_path / "m", lambda a: a.update({name: a[name][:-1]}))
    with pytest.raises(safetensors_io.CheckpointError,
                       match=rf"{f}: tensor '{name}' has shape \[47, 32\], the model expects \[48, 32\]"):
        load_llama(tmp_path / "m")


def test_loader_dtype_strict_and_cast(untied_dir, tmp_path):
    name = "model.layers.2.self_attn.o_proj.weight"
    f = _variant(untied_dir, tmp_path / "m", lambda a: a.update({name: a[name].astype(ml_dtypes.bfloat16)}))
    with pytest.raises(safetensors_io.CheckpointError, match=rf"{f}: tensor '{name}' is BF16, the model expects float32"):
        load_llama(tmp_path / "m")
    # cast: the f32 checkpoint into bf16 params, every value rounded once
    model = load_llama(untied_dir, dtype=jnp.bfloat16)
    ref = _tensors(untied_dir)
    for path, p in flat_params(model).items():
        assert p.get_value().dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(p.get_value()), ref[path].astype(ml_dtypes.bfloat16))


def test_loader_truncated_file(untied_dir, tmp_path):
    shutil.copytree(untied_dir, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(safetensors_io.CheckpointError, match=rf"{f}: truncated: tensor '[\w.]+'"):
        load_llama(tmp_path / "m")


class _Experts(nnx.Module):
    def __init__(self, rngs):
        self.w1 = param((8, 6, 4), jnp.float32, ("experts", "expert_mlp", "embed"), rngs)


class _Moe(nnx.Module):
    def __init__(self, rngs):
        self.experts = _Experts(rngs)
        self.gate = param((8, 4), jnp.float32, (None, None), rngs)


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.block_sparse_moe = _Moe(rngs)


def test_loader_stacked_experts_and_progress(tmp_path):
    """Per-expert tensors fill a stacked [E, ...] param; the experts axis is sharded on 8 devices
    (or 1), each device building its slice; progress reports every param."""
    rng = np.random.default_rng(4)
    experts = [rng.standard_normal((6, 4)).astype(np.float32) for _ in range(8)]
    gate = rng.standard_normal((8, 4)).astype(np.float32)
    arrays = {expert_tensor_name("p.block_sparse_moe.experts.w1.weight", e): w for e, w in enumerate(experts)}
    arrays["p.block_sparse_moe.gate.weight"] = gate
    safetensors_io.save_arrays(tmp_path / "model.safetensors", arrays)
    assert "p.block_sparse_moe.experts.5.w1.weight" in arrays

    def rename(path):   # these params are bare (`...gate`); the checkpoint names end in `.weight`
        return path + ".weight"

    mesh = sharding.make_mesh()
    calls = []
    model = load_state(lambda: _Tiny(nnx.Rngs(0)), tmp_path, mesh=mesh, rename=rename, prefix="p.",
                       progress=lambda i, n, name: calls.append((i, n, name)))
    w1 = model.block_sparse_moe.experts.w1.get_value()
    np.testing.assert_array_equal(np.asarray(w1), np.stack(experts))
    assert w1.sharding.spec == P("tensor" if len(jax.devices()) == 8 else None, None, None)
    np.testing.assert_array_equal(np.asarray(model.block_sparse_moe.gate.get_value()), gate)
    assert calls == [(1, 2, "block_sparse_moe.experts.w1"), (2, 2, "block_sparse_moe.gate")]

    # a checkpoint that already holds the stacked tensor loads too; a missing expert is named
    safetensors_io.save_arrays(tmp_path / "model.safetensors",
                               {"p.block_sparse_moe.experts.w1.weight": np.stack(experts),
                                "p.block_sparse_moe.gate.weight": gate})
    model = load_state(lambda: _Tiny(nnx.Rngs(0)), tmp_path, rename=rename, prefix="p.")
    np.testing.assert_array_equal(np.asarray(model.block_sparse_moe.experts.w1.get_value()), np.stack(experts))
    del arrays["p.block_sparse_moe.experts.5.w1.weight"]
    safetensors_io.save_arrays(tmp_path / "model.safetensors", arrays)
    with pytest.raises(safetensors_io.CheckpointError, match=r"missing tensor 'p\.block_sparse_moe\.experts\.5\.w1\.weight'"):
        load_state(lambda: _Tiny(nnx.Rngs(0)), tmp_path, rename=rename, prefix="p.")


# ------------------------------------------------------------------------------------------
# sharding


def test_sharded_matches_single_device(untied_dir, request):
    if jax.device_count() < 8:
        # the suite normally runs with 8 fake CPU devices (Makefile); without them, rerun this
        # test in a fresh process that has them
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            request.node.nodeid], cwd=request.config.rootpath, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        return
    mesh = sharding.make_mesh()   # tensor=8
    model = load_llama(untied_dir, mesh=mesh)
    layer = model.model.layers[1]
    assert layer.self_attn.q_proj.weight.get_value().sharding.spec == P("tensor", None)
    assert layer.self_attn.k_proj.weight.get_value().sharding.spec == P("tensor", None)
    assert layer.self_attn.o_proj.weight.get_value().sharding.spec == P(None, "tensor")
    assert layer.mlp.gate_proj.weight.get_value().sharding.spec == P("tensor", None)
    assert layer.mlp.down_proj.weight.get_value().sharding.spec == P(None, "tensor")
    assert model.lm_head.weight.get_value().sharding.spec == P("tensor", None)
    # no device holds a full copy: each of the 8 shards of q_proj is 1/8 of it
    shards = layer.self_attn.q_proj.weight.get_value().addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (4, 32) for s in shards)

    tokens = np.random.default_rng(5).integers(0, VOCAB, (2, 9))
    sharded = _jit_forward(model, tokens, (1,))
    single = _jit_forward(load_llama(untied_dir), tokens, (1,))
    # collectives change only the summation order of f32 contractions
    np.testing.assert_allclose(sharded.logits, single.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sharded.aux_hidden, single.aux_hidden, rtol=1e-5, atol=1e-5)
