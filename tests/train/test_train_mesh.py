"""The training mesh (dspark_jax/train/train_mesh.py): a tensor axis splits the Kimi teacher as
serving does (loader, rules table, MXFP4 packed, routed EP) while the draft trains data-parallel
over the rest; one distillation step's losses and gradients on (data 2 x tensor 4) equal one
device's in float64 (the gradient the step hands AdamW: micro-batches accumulated, divided by
the pooled weight); the target's greedy answers (train.regen's path) equal one device's; and
impossible meshes are refused naming the flag and the numbers."""

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
from jax.sharding import PartitionSpec as P

from dspark_jax import params as params_lib
from dspark_jax.api import load_target
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.data import answer_cache
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.train import batches, regen, teacher_shards
from dspark_jax.train import loss as L
from dspark_jax.train import trainer as T
from dspark_jax.train.regen import Sample
from dspark_jax.train.train_mesh import TEACHER_RULES, MeshError, check_target, training_mesh
from tests.float64 import assert_close, x64
from tests.gen_utils import randomize
from tests.kimi_configs import tiny_k3_dict, tiny_k3_tp_dict, write_k3_checkpoint
from tests.train_utils import CharTokenizer

REPO = Path(__file__).resolve().parents[2]
# the shallowest tiny K3 that still holds every layer kind the split must handle (a dense first
# layer, MoE after it, KDA and MLA attention): each target program compiles in fewer layers
K3_LAYERS = 3
AUX_LAYERS = (0, 1, 2)


def draft_for(cfg: KimiConfig) -> K3DSparkModel:
    dcfg = DraftConfig.from_dict(dict(
        hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        vocab_size=cfg.vocab_size, target_hidden_size=cfg.hidden_size,
        target_num_hidden_layers=cfg.num_hidden_layers, target_layer_ids=list(AUX_LAYERS),
        mask_token_id=cfg.vocab_size - 1, markov_rank=8, enable_confidence_head=True,
        confidence_head_with_markov=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                             rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)))
    draft = K3DSparkModel(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    randomize(draft, 1)
    return draft


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory) -> Path:
    d = tiny_k3_tp_dict(K3_LAYERS)
    model = KimiLinearModel(KimiConfig.from_dict(d), dtype=jnp.float32, rngs=nnx.Rngs(0))
    randomize(model, 0)
    return write_k3_checkpoint(model, tmp_path_factory.mktemp("k3") / "target", d)


def _samples(n: int, length: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(3, vocab - 2, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[length // 4:] = True
        out.append(Sample(str(i), ids, mask))
    return out


def test_a_tensor_parallel_step_equals_one_device_in_float64(k3_dir):
    devices = jax.devices()
    assert len(devices) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = T.TrainConfig(run_dir="unused", total_steps=3, global_batch=4, micro_batch=2, max_len=32, lr=1e-3,
                        compute_dtype="float64", export=False, loss=L.LossConfig(num_anchors=8))
    batch = batches.collate([batches.Example(s) for s in _samples(4, 30, 96)], cfg, offline=False)
    out = {}
    with x64():
        for name, mesh in (("one", training_mesh(devices=devices[:1])), ("tp", training_mesh(tp=4, dp=2))):
            # the serving loader path: HF shards read tensor by tensor into the teacher layout
            target = load_target(k3_dir, dtype=jnp.float64, mesh=mesh, rules=TEACHER_RULES)
            draft = draft_for(target.cfg)
            tr = T.Trainer(cfg, draft.cfg, target, online=True, mesh=mesh, init_draft=draft)
            if name == "tp":
                assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
                flat = params_lib.flat_params(target)
                packed = flat["model.layers.2.block_sparse_moe.experts.w1.weight_packed"].get_value()
                assert packed.dtype == jnp.uint8 and packed.sharding.spec == P("tensor", None, None)
                # heads split over "tensor", the model width replicated: serving's layout
                for key, p in flat.items():
                    axes = {a for s in p.get_value().sharding.spec for a in ((s,) if isinstance(s, str) else s or ())}
                    assert axes <= {"tensor"}, (key, p.get_value().sharding.spec)
                assert any(p.get_value().sharding.spec != P() for p in flat.values())
                dev = tr.device_batch(batch)
                assert dev["input_ids"].sharding.spec == P(None, "data", None)
                jaxpr = str(jax.make_jaxpr(tr._gradients)(tr.state.params, dev, tr.frozen, tr.state.step))
                assert "shard_map" in jaxpr            # the routed MoE's EP path, not the dense one
            out[name] = tr.gradients(batch)
    (g1, s1), (g8, s8) = out["one"], out["tp"]
    assert s1.numerator > 0 and s1.weight > 0 and np.sum(s1.count_T) > 0
    for field in ("numerator", "weight", "ce", "l1", "bce", "tau", "accept_T"):
        assert_close(np.asarray(getattr(s8, field)), np.asarray(getattr(s1, field)), f"loss sum {field}")
    for field in ("count_T", "top1_T", "agree_T", "blocks"):         # counts: equal
        np.testing.assert_array_equal(np.asarray(getattr(s8, field)), np.asarray(getattr(s1, field)))
    flat1, flat8 = dict(jax.tree_util.tree_leaves_with_path(g1)), dict(jax.tree_util.tree_leaves_with_path(g8))
    assert flat1.keys() == flat8.keys() and len(flat1) > 20
    assert sum(np.abs(g).max() > 0 for g in flat1.values()) > 0.9 * len(flat1)      # gradients reach the draft
    for path, g in flat1.items():
        assert_close(flat8[path], g, f"gradient {jax.tree_util.keystr(path)}")


def test_regen_answers_with_the_target_split_equal_one_device(k3_dir, tmp_path):
    """train.regen's library path (continuous batching) on a --tp 4 --dp 2 mesh with chunked
    prefill (3-token chunks: each prompt goes in over several steps): the same greedy answers as whole
    prompts on one device (float32)."""
    # two prompts of one length in one batch: few programs to compile per mesh
    records = [{"id": f"r{i}", "source": "t", "messages": [{"role": "user", "content": text}]}
               for i, text in enumerate(("qqqq", "QQQQ"))]
    settings = regen.RegenSettings(target="tiny-k3", max_new_tokens=8, temperature=0.0, seed=0,
                                   chat_template_sha256="x")
    answers = {}
    for name, tp, dp, budget in (("one", 1, 1, None), ("tp", 4, 2, 3)):
        mesh = training_mesh(tp=tp, dp=dp, devices=jax.local_devices(), multi_process=False)
        target = load_target(k3_dir, dtype=jnp.float32, mesh=mesh)
        out = tmp_path / f"{name}.jsonl"
        regen.regenerate(target, CharTokenizer(), records, out, settings=settings, batch_size=2,
                         max_num_batched_tokens=budget)
        answers[name] = {r["id"]: r["answer_ids"] for r in answer_cache.read_cache(out)}
    assert answers["tp"] == answers["one"] and len(answers["one"]) == 2
    assert len({tuple(a) for a in answers["one"].values()}) > 1


def test_offline_teacher_shards_with_the_target_split_equal_one_device(k3_dir, tmp_path):
    """train.teacher's library path on a --tp 4 --dp 2 mesh (each batch split over data): the
    shards hold one device's aux and final hidden states (float64)."""
    samples = _samples(4, 20, 96, seed=3)
    got = {}
    with x64():
        for name, tp, dp, budget in (("one", 1, 1, None), ("tp", 4, 2, 3)):
            mesh = training_mesh(tp=tp, dp=dp, devices=jax.local_devices(), multi_process=False)
            target = load_target(k3_dir, dtype=jnp.float64, mesh=mesh, rules=TEACHER_RULES)
            meta = teacher_shards.ShardMeta(num_writers=1, shard_size=4, aux_layer_ids=AUX_LAYERS, hidden_size=32,
                                     aux_width=96, dtype="float64", target="tiny-k3", max_len=24)
            teacher_shards.write_teacher_shards(target, samples, tmp_path / name, writer=0, meta=meta, batch_size=2,
                                         mesh=mesh)
            got[name] = teacher_shards.read_shard(tmp_path / name / teacher_shards.shard_name(0, 0))
    assert got["tp"][0] == got["one"][0] == [s.id for s in samples]
    for i, what in ((3, "aux hidden"), (4, "final hidden")):
        assert_close(got["tp"][i], got["one"][i], what)


def test_impossible_meshes_name_the_flag_and_the_numbers():
    devices = jax.devices()[:8]
    assert dict(training_mesh(devices=devices).shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert dict(training_mesh(tp=4, devices=devices).shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    assert dict(training_mesh(tp=2, fsdp=2, dp=2, devices=devices).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # several processes: every device takes part, the rest on fsdp unless --dp / --fsdp says
    assert dict(training_mesh(tp=4, devices=devices, multi_process=True).shape) == {"data": 1, "fsdp": 2,
                                                                                    "tensor": 4}
    assert dict(training_mesh(tp=2, dp=2, devices=devices, multi_process=True).shape) == {"data": 2, "fsdp": 2,
                                                                                          "tensor": 2}
    with pytest.raises(MeshError, match=r"--tp 3 does not divide the 8 devices"):
        training_mesh(tp=3, devices=devices)
    with pytest.raises(MeshError, match=r"--dp 4 x --fsdp 2 x --tp 2 = 16 devices, but 8 cpu device"):
        training_mesh(tp=2, dp=4, fsdp=2, devices=devices)
    with pytest.raises(MeshError, match=r"--dp 1 x --fsdp 2 x --tp 2 = 4, but a multi-process mesh holds all 8"):
        training_mesh(tp=2, fsdp=2, dp=1, devices=devices, multi_process=True)
    with pytest.raises(MeshError, match=r"--dp 4 x --tp 4 = 16 devices, but 8 cpu device"):
        training_mesh(tp=4, dp=4, devices=devices)
    with pytest.raises(MeshError, match=r"--fsdp 3 x --tp 2 does not divide the 8 devices"):
        training_mesh(tp=2, fsdp=3, devices=devices, multi_process=True)
    k3 = KimiConfig.from_dict(tiny_k3_dict())             # 2 MLA heads, 2 KDA heads, 8 experts
    check_target(k3, 2)
    with pytest.raises(MeshError, match=r"--tp 4 does not divide the target's num_attention_heads=2, "
                                        r"linear_attn_config.num_heads=2"):
        check_target(k3, 4)
    with pytest.raises(MeshError, match=r"num_experts=8"):
        check_target(KimiConfig.from_dict(tiny_k3_tp_dict()), 16)
    llama = LlamaConfig.from_dict(dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(MeshError, match=r"--tp 4 does not divide the target's num_key_value_heads=2"):
        check_target(llama, 4)


def test_programs_refuse_a_tensor_axis_the_target_cannot_take(k3_dir, tmp_path):
    """The absl programs build their mesh through train_mesh: a bad --tp is a usage error."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    draft_cfg = tmp_path / "draft.json"
    draft_cfg.write_text(json.dumps(dict(draft_for(KimiConfig.from_dict(tiny_k3_tp_dict(K3_LAYERS))).cfg.raw)))
    res = subprocess.run([sys.executable, "-m", "train.teacher", f"--target={k3_dir}", "--tp=3",
                          f"--data={tmp_path / 'none.jsonl'}", f"--draft_config={draft_cfg}",
                          f"--out={tmp_path / 'teacher'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode != 0
    assert "--tp 3 does not divide the target's num_attention_heads=4, linear_attn_config.num_heads=4, " \
           "num_experts=8" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "teacher").exists()
