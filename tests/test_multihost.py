"""Multi-host with `jax.distributed`: distillation steps with a Kimi-K3 teacher on two processes
on localhost (4 CPU devices each, one global 8-device training mesh, tensor 4 inside each process)
give the losses of the same steps in one process with 8 devices; and the settings resolve from
arguments, flags or environment with clear errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import distributed

REPO = Path(__file__).resolve().parents[1]

# Three online-distillation steps (target prefill as teacher inside the step, DSpark loss, grad,
# AdamW) of a 3-layer tiny Kimi-K3 target (MXFP4 experts) + tiny draft on the training mesh of --tp 4:
# the teacher split over "tensor" (heads, EP) inside each process, the draft FSDP over the 2 hosts.
_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from dspark_jax import distributed
    n_local = int(sys.argv[1])
    jax.config.update("jax_num_cpu_devices", n_local)
    settings = distributed.initialize_from_flags_or_env()
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from dspark_jax import sharding
    from dspark_jax.config.draft import DraftConfig
    from dspark_jax.config.kimi import KimiConfig
    from dspark_jax.models.kimi import KimiLinearModel
    from dspark_jax.train import loss as L, trainer as T
    from dspark_jax.train import batches
    from dspark_jax.train.regen import Sample
    from dspark_jax.train.train_mesh import TEACHER_RULES, training_mesh
    from tests.kimi_configs import tiny_k3_tp_dict

    assert jax.device_count() == 8 and jax.local_device_count() == n_local
    # two processes: the rest of the devices go to fsdp by default; one process says so
    mesh = training_mesh(tp=4) if settings.multi_process else training_mesh(tp=4, fsdp=2)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    tcfg = KimiConfig.from_dict(tiny_k3_tp_dict(num_layers=3))     # 2 KDA + 1 MLA, 2 MoE
    # built straight into the teacher's sharding: the same program on every process
    target = sharding.create_sharded(lambda: KimiLinearModel(tcfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh,
                                     TEACHER_RULES)
    dcfg = DraftConfig.from_dict(dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=96,
        target_hidden_size=32, target_num_hidden_layers=3, target_layer_ids=[0, 2], mask_token_id=95,
        markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                             rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)))
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        ids = rng.integers(0, 90, 40).astype(np.int32); m = np.zeros(40, bool); m[8:] = True
        samples.append(Sample(str(i), ids, m))
    cfg = T.TrainConfig(run_dir="unused", total_steps=3, global_batch=8, micro_batch=8, max_len=40, lr=1e-3,
                        compute_dtype="float32", export=False, loss=L.LossConfig(num_anchors=12))
    tr = T.Trainer(cfg, dcfg, target, online=True, mesh=mesh)
    batch = batches.collate([batches.Example(s) for s in samples], cfg, offline=False)
    losses = [tr.step(batch)["loss"] for _ in range(3)]
    w = tr.state.params["context_proj"]["weight"]
    experts = target.model.layers[2].block_sparse_moe.experts.w1.weight_packed.get_value()
    print(json.dumps({"process": jax.process_index(), "losses": losses,
                      "local_shards": len(w.addressable_shards), "draft_spec": str(w.sharding.spec),
                      "expert_spec": str(experts.sharding.spec),
                      "mesh_processes": [d.process_index for d in mesh.devices.flat]}))
""")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(n_local: int, env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **env_extra)
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, str(n_local)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process timed out after {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_give_the_single_process_losses():
    port = _free_port()
    # all three start together: the two halves of the 2-process run and the 1-process reference
    procs = [_start(4, {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: "2",
                        distributed.ENV_PROCESS_ID: str(pid)}) for pid in (0, 1)]
    single = _start(8, {})
    try:
        multi = [_result(p, 480) for p in procs]
        ref = _result(single, 480)
    finally:
        for p in procs + [single]:
            if p.poll() is None:
                p.kill()
    assert [r["process"] for r in multi] == [0, 1]
    # one global mesh, each process's devices contiguous: "tensor" (the teacher's heads and
    # experts) inside a process, the draft's FSDP axis across the two
    assert [r["local_shards"] for r in multi] == [4, 4] and ref["local_shards"] == 8
    assert multi[0]["mesh_processes"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert multi[0]["expert_spec"] == "P('tensor', None, None)"       # EP, MXFP4 packed
    assert "fsdp" in multi[0]["draft_spec"]
    # both processes see the same (replicated) loss, and it is the single-process loss: the same
    # SPMD program; only the all-reduces run over gloo between processes (fp32, 3 AdamW steps;
    # the tolerance allows a different reduction order)
    assert multi[0]["losses"] == multi[1]["losses"]
    np.testing.assert_allclose(multi[0]["losses"], ref["losses"], rtol=1e-6)
    assert ref["losses"][2] < ref["losses"][0]              # it trains


def test_settings_resolve_and_validate():
    env = {distributed.ENV_COORDINATOR: "10.0.0.1:1234", distributed.ENV_NUM_PROCESSES: "4",
           distributed.ENV_PROCESS_ID: "3"}
    assert distributed.resolve_settings(environ={}) == distributed.DistributedSettings(None, 1, 0)
    assert not distributed.resolve_settings(environ={}).multi_process
    assert distributed.resolve_settings(environ=env) == distributed.DistributedSettings("10.0.0.1:1234", 4, 3)
    # explicit arguments win over the environment
    assert distributed.resolve_settings(process_id=0, environ=env).process_id == 0
    with pytest.raises(distributed.DistributedError, match="DSPARK_COORDINATOR"):
        distributed.resolve_settings(num_processes=2, environ={})
    with pytest.raises(distributed.DistributedError, match="not in 0..3"):
        distributed.resolve_settings(process_id=4, environ=env)
    with pytest.raises(distributed.DistributedError, match="host:port"):
        distributed.resolve_settings(coordinator_address="nohost", environ={})
    with pytest.raises(distributed.DistributedError, match="not an integer"):
        distributed.resolve_settings(environ={distributed.ENV_NUM_PROCESSES: "two"})
    # a single process: nothing to join
    assert distributed.initialize_from_flags_or_env(num_processes=1) == distributed.DistributedSettings(None, 1, 0)


def test_absl_flags_are_read_by_entry_points():
    code = ("from absl import app; from dspark_jax import distributed; "
            "app.run(lambda argv: print(distributed.resolve_settings(environ={})))")
    res = subprocess.run([sys.executable, "-c", code, "--coordinator_address=h:1", "--num_processes=2",
                          "--process_id=1"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "DistributedSettings(coordinator_address='h:1', num_processes=2, process_id=1)" in res.stdout
