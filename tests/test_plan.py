"""The serving plan (`serve.plan`, `dspark_jax.plan`): full-size K3 sharding and byte accounting
without allocating, the AOT-compiled programs' memory on 8 fake devices, the chunked prefill
program's semantics, and the CLI's last line and exit status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import plan as plan_lib
from dspark_jax import sharding
from dspark_jax.config import DraftConfig, KimiConfig
from dspark_jax.engine import Engine
from dspark_jax.engine_config import EngineConfig
from dspark_jax.models.kimi import KimiLinearModel
from tests.gen_utils import randomize, tiny_draft
from tests.kimi_configs import tiny_k3_dict

REPO = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"^per-device peak: (\d+\.\d) GiB of 288 GiB \(0\.93 usable\)$")


def _tiny_configs() -> tuple[dict, dict]:
    """Tiny K3 (MXFP4, 8 heads and 8 experts: an 8-way tensor axis shards them) and a draft for it."""
    d = tiny_k3_dict(quantized=True)
    t = d["text_config"]
    t.update(num_attention_heads=8, num_key_value_heads=8, num_experts=8,
             linear_attn_config=dict(t["linear_attn_config"], num_heads=8))
    draft = dict(
        architectures=["K3DSparkModel"], model_type="k3_dspark", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=96,
        target_hidden_size=32, target_num_hidden_layers=5, target_layer_ids=[1, 3], mask_token_id=95,
        markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                             rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    return d, draft


def test_full_k3_shards_as_intended_abstractly():
    """Kimi-K3 + its draft on 8 devices: 96 heads -> 12 per device, 896 experts -> 112 per device
    (MXFP4 packed), vocab split 8 ways; byte totals from the docs/architecture.md §1.3 shapes."""
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg, dcfg = plan_lib.load_plan_configs("kimi-k3", "auto")
    assert dcfg is not None and dcfg.target_layer_ids == (2, 23, 47, 71, 89)
    from dspark_jax.models.dspark import K3DSparkModel
    target = params_lib.abstract(lambda: KimiLinearModel(cfg, rngs=nnx.Rngs(0)))
    draft = params_lib.abstract(lambda: K3DSparkModel(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    mesh = sharding.make_mesh(tensor=8)
    groups = {g.name: g for g in plan_lib.weight_groups(target, draft, mesh)}
    experts = groups["routed experts (MXFP4 packed)"]
    # per layer: w1, w3 [896, 3072, 3584/2] + [.., 3584/32]; w2 [896, 3584, 3072/2] + [.., 3072/32]
    per_layer = 896 * (2 * 3072 * (1792 + 112) + 3584 * (1536 + 96))
    assert experts.total_bytes == 92 * per_layer and experts.device_bytes * 8 == experts.total_bytes
    assert set(experts.specs) == {"(tensor, -, -)"} and set(experts.dtypes) == {"uint8"}
    q = target.model.layers[0].self_attn.q_proj.weight            # KDA: 96 heads x 128
    spec = sharding.logical_to_spec(params_lib.logical_axes(q), q.get_value().shape, mesh)
    assert jax.sharding.NamedSharding(mesh, spec).shard_shape(q.get_value().shape) == (12 * 128, 7168)
    for name in ("embeddings", "lm_head"):
        assert groups[name].device_bytes * 8 == groups[name].total_bytes == 163840 * 7168 * 2
    # the draft file (7,124,633,450 bytes = 8 + a 7,520-byte header + the 68 tensors, docs/architecture.md §3.2)
    # minus embed_tokens (the target's table is used)
    assert groups["draft"].count == 67
    assert groups["draft"].total_bytes == 7_124_633_450 - 8 - 7_520 - 163840 * 7168 * 2
    total = sum(g.device_bytes for g in groups.values())
    assert 185 * 2**30 < total < 195 * 2**30


def test_tiny_plan_compiles_and_accounts_memory():
    cfg_d, draft_d = _tiny_configs()
    cfg, dcfg = KimiConfig.from_dict(cfg_d), DraftConfig.from_dict(draft_d)
    config = EngineConfig(num_speculative_tokens=3, kv_cache_dtype="fp8", page_size=16, max_num_seqs=2,
                          max_model_len=256)
    shape = plan_lib.ServingShape(num_devices=8, engine=config, prefill_chunk=64)
    plan = plan_lib.build_plan(cfg, dcfg, shape, programs=("step", "propose"))   # prefill: the CLI test
    assert [p.name for p in plan.programs] == ["step", "propose"]
    by_name = {g.name: g for g in plan.caches}
    pool = by_name["KV pool (MLA + draft rows)"]
    # 2 MLA rows + 2 draft rows, 2 sequences x 16 pages of 16 tokens, 24-wide latent rows, fp8
    assert pool.shape == "[4, 32, 16, 24]" and pool.total_bytes == 4 * 32 * 16 * 24
    assert pool.device_bytes == pool.total_bytes                    # replicated
    ssm = by_name["KDA SSM states"]
    assert ssm.shape == "[3, 2, 8, 8, 8]" and ssm.device_bytes * 8 == ssm.total_bytes   # split by head
    step = plan.programs[0]
    # the step takes every weight and cache: XLA's argument bytes are our per-device accounting,
    # give or take a few scalars / per-sequence vectors and the confidence head (unused when greedy)
    assert abs(step.argument_bytes - plan.persistent_bytes) < 1024
    assert step.alias_bytes > 0 and step.output_bytes - step.alias_bytes < 1024   # caches donated
    assert plan.peak_bytes == max(p.peak_bytes(plan.persistent_bytes) for p in plan.programs)
    lines = plan_lib.format_plan(plan, "tiny")
    assert LAST_LINE.match(lines[-1]) and plan.fits
    assert any(line.startswith("routed experts (MXFP4 packed)") and "(tensor, -, -)" in line for line in lines)
    small = plan_lib.Plan(**{**plan.__dict__, "capacity_gib": plan.peak_bytes / 2**30 / 2})
    assert not small.fits and "DOES NOT FIT" in "\n".join(plan_lib.format_plan(small, "tiny"))


def test_prefill_chunks_equal_one_whole_prefill():
    """The plan's prefill program, fed a prompt in chunks, leaves the caches and samples the first
    token exactly as the engine's whole-prompt prefill does."""
    # 3 layers (KDA + dense, KDA + MoE, MLA + MoE; AttnRes banks at 0 and 2): every kind of state
    d = tiny_k3_dict(quantized=False, num_hidden_layers=3)
    d["text_config"]["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3])
    target = KimiLinearModel(KimiConfig.from_dict(d), dtype=jnp.float32, rngs=nnx.Rngs(0))
    randomize(target, 0)
    draft = tiny_draft(target, seed=1, layer_ids=(0, 2))
    eng = Engine(target, draft, EngineConfig(num_speculative_tokens=3, page_size=8))
    prompt = np.random.default_rng(2).integers(3, 90, 20).astype(np.int32)
    slot = jnp.asarray([1], jnp.int32)
    key = jax.random.PRNGKey(0)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :20] = prompt
    first_whole, whole = jax.jit(eng.prefill_fn, static_argnames=("temperature", "top_p"))(
        eng.t_state, eng.d_state, jnp.asarray(tokens), jnp.asarray([20]), slot, eng.new_caches(2, 64), key,
        temperature=0.0, top_p=1.0)
    chunk = jax.jit(lambda *a: plan_lib.prefill_chunk(eng, *a))
    caches = eng.new_caches(2, 64)
    for start in (0, 16):                      # 16 + 4 valid tokens
        n = min(16, 20 - start)
        piece = np.zeros((1, 16), np.int32)
        piece[0, :n] = prompt[start:start + n]
        first, caches = chunk(eng.t_state, eng.d_state, jnp.asarray(piece), jnp.asarray([start]),
                              jnp.asarray([n]), slot, caches, key)
    assert int(first[0]) == int(first_whole[0])
    # KDA chunk boundaries differ (fp32 reassociation), attention sees the same rows: tight tolerance
    for a, b in zip(jax.tree.leaves(caches), jax.tree.leaves(whole)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def _cli(tmp_path, *extra) -> subprocess.CompletedProcess:
    cfg_d, draft_d = _tiny_configs()
    (tmp_path / "target.json").write_text(json.dumps(cfg_d))
    (tmp_path / "draft.json").write_text(json.dumps(draft_d))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the program sets its devices
    return subprocess.run(
        [sys.executable, "-m", "serve.plan", "--config", str(tmp_path / "target.json"), "--draft_config",
         str(tmp_path / "draft.json"), "--num_devices", "8", "--max_model_len", "128", "--max_num_seqs", "2",
         "--block_size", "16", "--max_num_batched_tokens", "32", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_cli_last_line_and_exit_status(tmp_path):
    ok = _cli(tmp_path, "--programs", "prefill")
    assert ok.returncode == 0, ok.stderr[-3000:]
    lines = ok.stdout.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    assert lines[0].startswith(f"{tmp_path / 'target.json'} (5 layers: 3 KDA + 2 MLA, 8 experts MXFP4)")
    assert any(line.startswith("prefill ") and "one 32-token chunk" in line for line in lines)
    tight = _cli(tmp_path, "--programs", "propose", "--hbm_gib", "0.000001")
    assert tight.returncode == 1, tight.stderr[-3000:]
    last = tight.stdout.strip().splitlines()[-1]
    assert re.match(r"^per-device peak: \d+\.\d GiB of 1e-06 GiB \(0\.93 usable\)$", last), last
    bad = subprocess.run([sys.executable, "-m", "serve.plan", "--config", "no-such-model"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no-such-model" in bad.stderr
