"""Generation with the Pallas kernels forced on (interpret mode on CPU) stays lossless, on one
device and with the heads split over a mesh (one kernel per device)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from dspark_jax.decode.generate import generate
from dspark_jax.kernels.dispatch import KernelCall, record_paths, use_kernels
from tests.gen_utils import prompts, tiny_draft, tiny_k3, tiny_llama


def _check(target, draft, ps, new_tokens, t):
    # interpret mode runs every kernel program in Python: keep it short
    with use_kernels("off"):
        plain = generate(target, None, ps, max_new_tokens=new_tokens)      # references
    with use_kernels("interpret"):
        spec = generate(target, draft, ps, max_new_tokens=new_tokens, num_speculative_tokens=t)
    for a, b in zip(plain.outputs, spec.outputs):
        assert a.token_ids == b.token_ids


def test_llama_pair_with_paged_mla_kernel():
    target = tiny_llama(0)
    _check(target, tiny_draft(target, 1), prompts(2, target.cfg.vocab_size, seed=2, hi=12), 6, 3)


@pytest.fixture(scope="module")
def k3_pair():
    """Tiny K3 and its draft, and the one prompt both K3 tests decode: generate() keeps the
    reference engine compiled for the target, so the second test's reference costs no compilation."""
    target = tiny_k3(0)
    return target, tiny_draft(target, 1, layer_ids=(1, 3)), prompts(1, target.cfg.vocab_size, seed=3, lo=5, hi=12)


def test_k3_pair_with_kda_and_mla_kernels(k3_pair):
    target, draft, ps = k3_pair
    _check(target, draft, ps, 3, 2)


def test_k3_kernels_per_device_under_the_mesh_match_one_device_reference(request, k3_pair):
    """Tiny K3 (MLA and KDA at 2 heads, power-of-two dims) with its heads on a tensor axis of 2
    (x data 4 = 8 devices), kernels forced on in interpret mode: greedy output equals the
    one-device reference path token for token in float32, and every KDA and paged MLA call ran
    as a kernel inside the shard_map over the heads (the dispatch's record)."""
    if jax.device_count() < 8:
        # the suite normally runs with 8 fake CPU devices; without them, rerun in a process that has them
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                           cwd=request.config.rootpath, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        return
    from flax import nnx

    from dspark_jax.sharding import make_mesh, shard_module

    target, draft, ps = k3_pair
    # one prompt: the batch is not what is checked here, and rows finishing at different steps
    # would compile each program again at a smaller batch bucket (in interpret mode, slowly)
    with use_kernels("off"):
        want = generate(target, None, ps, max_new_tokens=3)
    mesh = make_mesh(tensor=2, data=4)
    sharded = shard_module(nnx.clone(target), mesh)
    assert sharded.model.layers[0].self_attn.q_proj.weight.get_value().sharding.spec[0] == "tensor"
    with use_kernels("interpret"), record_paths() as calls:
        got = generate(sharded, None, ps, max_new_tokens=3)
        # speculative: the verify's KDA snapshots and the draft's block attention, sharded too
        sharded_draft = shard_module(nnx.clone(draft), mesh)      # the fixture's draft stays on one device
        got_spec = generate(sharded, sharded_draft, ps, max_new_tokens=3, num_speculative_tokens=2)
    for out in (got, got_spec):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
    entries = {c.entry for c in calls}
    assert {"kda_prefill", "kda_verify", "mla_paged_attention"} <= entries, calls
    assert all(c == KernelCall(c.entry, "kernel", 2) for c in calls), calls
