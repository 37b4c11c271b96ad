"""The serving plan (`serve.plan`, `dspark_jax.plan.serving`): full-size K3 sharding, byte accounting and
MoE FLOPs without allocating; the plan's programs are the server's (the engine's jitted programs
as the scheduler calls them, at the largest shapes of the server's warm-up list) and their
AOT-compiled memory on 8 fake devices; the CLI's last line and exit status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.decode import warmup
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.scheduler import Scheduler
from dspark_jax.decode.spec_length import StepCosts
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.plan import server_programs as plan_programs
from dspark_jax.plan import serving as plan_lib
from tests.kimi_configs import tiny_k3_dict

REPO = Path(__file__).resolve().parents[2]
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
    assert 180 * 2**30 < total < 186 * 2**30
    # one MoE layer over a 4096-token chunk, per device: 16 routed pairs a token through 3 GEMMs of
    # 3584 (the latent width) x 3072, experts split 8 ways; 2 shared experts (6144 wide) split 8 ways
    moe = plan_programs.moe_flops(target, mesh, 4096)
    routed = 4096 * 16 * 6 * 3584 * 3072 / 8
    shared = 4096 * 6 * 7168 * 6144 / 8
    assert moe.routed == routed and moe.shared == shared and moe.minimum == routed + shared
    assert moe.router == 2 * 4096 * 7168 * 896 / 8                   # the router is split by expert
    # the latent down/up projections split their 3584-wide side 8 ways, as the experts are split
    assert not moe.latent_replicated and moe.latent == 2 * 2 * 4096 * 7168 * 3584 / 8
    assert moe.total == routed + shared + moe.router + moe.latent
    assert moe.total / moe.minimum < 1.5


TINY_ENGINE = EngineConfig(num_speculative_tokens=3, kv_cache_dtype="fp8", page_size=16)
TINY_SCHEDULER = SchedulerConfig(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64)


def _abstract_pair(cfg: KimiConfig, dcfg: DraftConfig):
    target = params_lib.abstract(lambda: KimiLinearModel(cfg, rngs=nnx.Rngs(0)))
    draft = params_lib.abstract(lambda: K3DSparkModel(dcfg, dtype=jnp.dtype(dcfg.dtype), rngs=nnx.Rngs(0)))
    return target, draft


def test_plan_programs_are_the_servers():
    """The plan's programs are the engine's jitted ones, called as the server's scheduler calls them:
    the prefill of a full chunk budget, the one-token step (width 0) and the T-draft verify at the
    largest batch bucket, none of them bound to a length (the whole block table passed); its warm-up
    list is the one a server's Scheduler over real weights has for the same flags."""
    cfg_d, draft_d = _tiny_configs()
    cfg, dcfg = KimiConfig.from_dict(cfg_d), DraftConfig.from_dict(draft_d)
    mesh = sharding.make_mesh(tensor=8)
    scheduler = plan_programs.serving_scheduler(*_abstract_pair(cfg, dcfg), TINY_ENGINE, TINY_SCHEDULER, mesh)
    eng = scheduler.engine
    shapes = warmup.program_shapes(scheduler, sampled=True)
    largest = plan_programs.largest_programs(shapes, eng.t)
    assert list(largest) == ["prefill", "step", "verify"]
    # 256 positions, T = 3, a 64-token budget: rows x chunk bucket of 64 tokens
    pre = plan_programs.program_call(scheduler, largest["prefill"])
    assert pre.program is eng.prefill_jit and "span" not in pre.kw
    tokens, lens, slots, caches = pre.call_args[2:6]
    assert tokens.size == 64 and not any(pre.kw["starts_P"])
    assert caches is eng.abstract_caches and set(slots) == {2}             # padding rows
    assert caches.pool.block_table.shape == (2, 256 // TINY_ENGINE.page_size)
    for kind, width in (("step", 0), ("verify", 3)):
        call = plan_programs.program_call(scheduler, largest[kind])
        assert call.program is eng.step_jit and "span" not in call.kw and call.kw["width"] is None
        x0, drafts = call.call_args[2:4]
        assert x0.shape == (2,) and list(call.kw["rows_B"]) == [2, 2]     # the largest batch bucket
        # the one-token step verifies given empty drafts; the verify step drafts all T itself
        assert (drafts.shape == (2, 0)) if width == 0 else drafts is None
    lowered = pre.lower()
    assert lowered.args_info[0][2].shape == tokens.shape
    # the same flags on a server's Scheduler over real (tiny) weights: the same warm-up list
    real = Scheduler(Engine(KimiLinearModel(cfg, rngs=nnx.Rngs(0)), K3DSparkModel(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(1)),
                          TINY_ENGINE), TINY_SCHEDULER.replace(step_costs=StepCosts()))
    assert shapes == warmup.program_shapes(real, sampled=True)
    assert {s.width for s in shapes if s.kind == "step"} == {0, 1, None}      # lengths 0, 1, 3


def test_tiny_plan_compiles_and_accounts_memory():
    cfg_d, draft_d = _tiny_configs()
    cfg, dcfg = KimiConfig.from_dict(cfg_d), DraftConfig.from_dict(draft_d)
    shape = plan_lib.ServingShape(num_devices=8, engine=TINY_ENGINE, scheduler=TINY_SCHEDULER)
    plan = plan_lib.build_plan(cfg, dcfg, shape, programs=("step", "verify"))   # prefill: the CLI test
    assert [p.name for p in plan.programs] == ["step", "verify"]
    by_name = {g.name: g for g in plan.caches}
    pool = by_name["KV pool (MLA + draft rows)"]
    # 2 MLA rows + 2 draft rows, 2 sequences x 16 pages of 16 tokens, 24-wide latent rows, fp8
    assert pool.shape == "[4, 32, 16, 24]" and pool.total_bytes == 4 * 32 * 16 * 24
    assert pool.device_bytes == pool.total_bytes                    # replicated
    ssm = by_name["KDA SSM states"]
    assert ssm.shape == "[3, 2, 8, 8, 8]" and ssm.device_bytes * 8 == ssm.total_bytes   # split by head
    step, verify = plan.programs
    # the verify step takes every weight and cache: XLA's argument bytes are our per-device
    # accounting, give or take a few scalars / per-sequence vectors; the one-token step leaves out
    # the draft's block-pass weights (jit drops unused arguments), so the peak counts them apart
    assert abs(verify.argument_bytes - plan.persistent_bytes) < 1024
    assert step.argument_bytes < plan.persistent_bytes - 4096
    for p in plan.programs:
        assert p.alias_bytes > 0 and p.output_bytes - p.alias_bytes < 1024   # caches donated
    assert plan.peak_bytes == max(p.peak_bytes(plan.persistent_bytes) for p in plan.programs)
    n_shapes = sum(plan.warmup_programs.values())
    assert n_shapes == len(warmup.program_shapes(
        plan_programs.serving_scheduler(*_abstract_pair(cfg, dcfg), TINY_ENGINE, TINY_SCHEDULER,
                                           sharding.make_mesh(tensor=8)),
        sampled=True))
    lines = plan_lib.format_plan(plan, "tiny")
    assert LAST_LINE.match(lines[-1]) and plan.fits
    assert any(line.startswith("routed experts (MXFP4 packed)") and "(tensor, -, -)" in line for line in lines)
    text = "\n".join(lines)
    assert f": {n_shapes} programs (" in text and f"x {n_shapes} programs = " in text
    mean = sum(p.lower_s + p.compile_s for p in plan.programs) / 2
    assert f"estimated compile time of the whole list: {mean:.0f} s per program" in text
    # the MoE count over the prefill chunk (64 tokens; tiny K3: top-2, 32-wide latent, 32-wide experts)
    moe = plan.moe
    assert moe.tokens == 64 and moe.routed == 64 * 2 * 6 * 32 * 32 / 8
    assert f"{moe.total / moe.minimum:.2f}x the routed minimum" in text
    small = plan_lib.Plan(**{**plan.__dict__, "capacity_gib": plan.peak_bytes / 2**30 / 2})
    assert not small.fits and "DOES NOT FIT" in "\n".join(plan_lib.format_plan(small, "tiny"))


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
    assert any(line.startswith("prefill ") and "-token prompt chunk (target + draft context rows); up to 128 "
               "positions" in line for line in lines)
    assert not any(line.startswith(("step ", "verify ")) for line in lines)
    tight = _cli(tmp_path, "--programs", "step", "--hbm_gib", "0.000001")
    assert tight.returncode == 1, tight.stderr[-3000:]
    last = tight.stdout.strip().splitlines()[-1]
    assert re.match(r"^per-device peak: \d+\.\d GiB of 1e-06 GiB \(0\.93 usable\)$", last), last
    assert any(line.startswith("step ") and "one-token step, 2 sequences; up to 128 positions" in line
               for line in tight.stdout.splitlines())
    bad = subprocess.run([sys.executable, "-m", "serve.plan", "--config", "no-such-model"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no-such-model" in bad.stderr
    unknown = _cli(tmp_path, "--programs", "propose")
    assert unknown.returncode != 0 and "--programs propose: choose from prefill,step,verify" in unknown.stderr
