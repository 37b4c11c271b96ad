"""The distillation plan (dspark_jax/plan/training.py): the trainer's own step compiles for
abstract tiny models on a (data 2 x tensor 4) mesh, online and offline, and reports memory, FLOPs
and the shard bytes per token; at Kimi-K3 widths a shard row is (5 + 1) x 7,168 values, in bf16 or
in float8 with one float32 scale per row."""

from __future__ import annotations

import jax

from dspark_jax.config import load_config
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.plan import training as train_plan
from dspark_jax.plan.serving import resolve_config_path
from tests.kimi_configs import tiny_k3_tp_dict
from tests.train.test_train_mesh import draft_for


def test_tiny_plan_compiles_online_and_offline():
    assert len(jax.devices()) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = KimiConfig.from_dict(tiny_k3_tp_dict())
    dcfg = draft_for(cfg).cfg
    plans = {}
    for online in (True, False):
        shape = train_plan.TrainShape(tp=4, dp=2, seq_len=32, micro_batch=2, accum_steps=2, num_anchors=8,
                                      online=online, target_dtype="float32", compute_dtype="float32")
        plans[online] = train_plan.build_train_plan(cfg, dcfg, shape)
    on, off = plans[True], plans[False]
    assert on.mesh == {"data": 2, "fsdp": 1, "tensor": 4}
    for p in (on, off):
        assert p.program.argument_bytes > 0 and p.program.temp_bytes > 0 and p.flops > 0
        assert p.peak_bytes > p.program.argument_bytes
    assert off.flops < on.flops                          # the teacher's forward is not in the offline step
    # 3 captured layers + the final state, 32 wide; float8: 1 byte per value and a 4-byte scale per row
    assert on.shard_bytes_per_token == {"float32": 4 * 32 * 4 + 5, "bfloat16": 4 * 32 * 2 + 5,
                                        "float8_e4m3fn": 4 * 32 + 4 * 4 + 5}
    lines = train_plan.format_train_plan(on)
    assert lines[-1].startswith("per-device peak: ") and "MI355X" in "\n".join(lines)
    assert "517 bytes in float32, 261 bytes in bfloat16, 149 bytes in float8_e4m3fn" in "\n".join(lines)


def test_k3_shard_row_bytes():
    cfg = load_config(resolve_config_path("kimi-k3"))
    dcfg = load_config(resolve_config_path("kimi-k3-dspark"))
    assert isinstance(dcfg, DraftConfig) and len(dcfg.target_layer_ids) == 5 and cfg.hidden_size == 7168
    assert train_plan.shard_bytes_per_token(cfg, dcfg) == 6 * 7168 * 2 + 5      # 86,021 bytes
    fp8 = train_plan.shard_bytes_per_token(cfg, dcfg, "float8_e4m3fn")
    assert fp8 == 6 * 7168 + 6 * 4 + 5 == 43_037 and fp8 <= 45_000
    assert train_plan.shard_storage(cfg, dcfg, "bfloat16") == {"bfloat16": 86_021, "float8_e4m3fn": 43_037}
