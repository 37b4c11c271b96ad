"""MoE cost against routed work: the routed expert mixture vs the dense per-expert loop.

1. One tiny K3 MoE layer (router, latent projections + norm, 2 shared experts, SiTU, MXFP4 experts,
   float32, jitted) runs the same routed work, `--tokens` x top-`--top_k` pairs, with `--few`
   and with `--many` experts; the time ratio many / few is printed for the routed and for the
   dense path, measured in one process, calls interleaved.
2. A Kimi-K3 chunk of `--k3_tokens` tokens (896 experts, top-16, EP over `--k3_devices`): the
   expert FLOPs per device of both paths against the routed minimum (pairs / devices), counted
   from the routing of random router logits (uniform routing; a skewed router moves pairs
   between devices, not the per-pair cost). The count is analytic: a loop whose trip count is
   data-dependent is invisible to XLA's cost analysis, and the routed path multiplies exactly one
   row per routed pair (no padding; tests/layers/test_moe.py counts the rows at run time).
3. Why no single `jax.lax.ragged_dot` over all local experts: its FLOPs in XLA's cost analysis
   on this backend for the same rows with `--few` and `--many` groups.

    python -m benchmarks.moe_routed
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dspark_jax.config import load_config
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.moe import MoE, route
from dspark_jax.plan.serving import resolve_config_path

_TOKENS = flags.DEFINE_integer("tokens", 1024, "tokens of one layer call")
_TOP_K = flags.DEFINE_integer("top_k", 2, "experts per token")
_FEW = flags.DEFINE_integer("few", 2, "expert count of the small layer")
_MANY = flags.DEFINE_integer("many", 128, "expert count of the large layer")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "model width")
_LATENT = flags.DEFINE_integer("latent", 0, "routed_expert_hidden_size (K3: hidden / 2); 0: the experts read "
                                "the hidden state")
_WIDTH = flags.DEFINE_integer("expert_width", 256, "moe_intermediate_size")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per variant (after one warm-up call)")
_K3_TOKENS = flags.DEFINE_integer("k3_tokens", 4096, "tokens of the Kimi-K3 prefill chunk counted")
_K3_DEVICES = flags.DEFINE_integer("k3_devices", 8, "expert-parallel devices of the Kimi-K3 count")

_MXFP4 = dict(quant_method="compressed-tensors", format="mxfp4-pack-quantized",
              config_groups=dict(group_0=dict(targets=["Linear"], weights=dict(
                  num_bits=4, type="float", strategy="group", group_size=32, symmetric=True))))


def _layer_config(num_experts: int) -> KimiConfig:
    latent = _LATENT.value or None
    return KimiConfig.from_dict(dict(
        vocab_size=16, hidden_size=_HIDDEN.value, num_hidden_layers=2, intermediate_size=16,
        num_attention_heads=1, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=num_experts, num_experts_per_token=_TOP_K.value, num_shared_experts=2,
        moe_intermediate_size=_WIDTH.value, moe_renormalize=True, routed_scaling_factor=1.0,
        num_expert_group=1, topk_group=1, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, routed_expert_hidden_size=latent,
        latent_moe_use_norm=latent is not None, rms_norm_eps=1e-5, quantization_config=_MXFP4,
        linear_attn_config=dict(num_heads=1, head_dim=8, kda_layers=[1], full_attn_layers=[2])))


def _best_times(calls) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of the fastest of `iters` runs per call, runs interleaved so load
    drift hits all alike. CPU time adds up XLA's threads and is steadier on a shared host."""
    for call in calls:
        jax.block_until_ready(call())             # compile + warm-up
    best = [(float("inf"), float("inf"))] * len(calls)
    for _ in range(_ITERS.value):
        for i, call in enumerate(calls):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(call())
            run = (time.perf_counter() - t0, time.process_time() - c0)
            best[i] = tuple(min(a, b) for a, b in zip(best[i], run))
    return best


def time_layers() -> None:
    x = jax.random.normal(jax.random.key(1), (1, _TOKENS.value, _HIDDEN.value), jnp.float32)
    calls, touched = [], {}
    for n_exp in (_FEW.value, _MANY.value):
        moe = MoE(_layer_config(n_exp), dtype=jnp.float32, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(moe)
        idx, _ = route(moe.gate(x[0]), moe.gate.e_score_correction_bias.get_value(), moe.cfg)
        touched[n_exp] = len(np.unique(np.asarray(idx)))
        for dense in (False, True):
            fwd = jax.jit(lambda st, x, dense=dense, g=graphdef: nnx.merge(g, st)(x, dense_reference=dense))
            calls.append(lambda fwd=fwd, state=state: fwd(state, x))
    routed_few, dense_few, routed_many, dense_many = _best_times(calls)
    pairs = _TOKENS.value * _TOP_K.value
    print(f"one MoE layer: {_TOKENS.value} tokens x top-{_TOP_K.value} = {pairs} routed pairs; hidden "
          f"{_HIDDEN.value}, latent {_LATENT.value or 'none'}, experts {_WIDTH.value} wide, MXFP4, 2 shared "
          f"experts, float32, jitted, best of {_ITERS.value}; device {jax.devices()[0].device_kind}")
    ms = lambda t: f"{t[0] * 1e3:8.2f} ms ({t[1] * 1e3:8.2f} ms CPU)"
    for n_exp, routed, dense in ((_FEW.value, routed_few, dense_few), (_MANY.value, routed_many, dense_many)):
        print(f"  {n_exp:4d} experts ({touched[n_exp]:4d} touched): routed {ms(routed)}   dense loop {ms(dense)}")
    ratio = lambda a, b: f"{a[0] / b[0]:.2f}x ({a[1] / b[1]:.2f}x CPU)"
    print(f"  {_MANY.value} / {_FEW.value} experts: routed {ratio(routed_many, routed_few)} (goal <= 2.0x), "
          f"dense loop {ratio(dense_many, dense_few)}")
    print(f"  routed / dense loop at {_MANY.value} experts: {ratio(routed_many, dense_many)}")


def count_k3_flops() -> None:
    cfg = load_config(resolve_config_path("kimi-k3"))
    n_tok, n_dev, top_k = _K3_TOKENS.value, _K3_DEVICES.value, cfg.num_experts_per_token
    local = cfg.num_experts // n_dev
    logits = jax.random.normal(jax.random.key(2), (n_tok, cfg.num_experts), jnp.float32)
    idx, _ = route(logits, jnp.zeros(cfg.num_experts), cfg)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=cfg.num_experts).reshape(n_dev, local)
    per_pair = 6 * cfg.moe_expert_in * cfg.moe_intermediate_size        # gate + up + down, 2 FLOPs a MAC
    minimum = n_tok * top_k / n_dev * per_pair
    routed = counts.sum(1) * per_pair
    dense = (counts > 0).sum(1) * n_tok * per_pair
    print(f"\nKimi-K3 MoE layer, one {n_tok}-token chunk, top-{top_k} of {cfg.num_experts}, EP {n_dev} "
          f"({local} experts per device), uniform routing: expert TFLOP per device")
    print(f"  routed minimum (pairs / devices): {minimum / 1e12:8.3f}")
    print(f"  routed mixture: max {routed.max() / 1e12:8.3f}  mean {routed.mean() / 1e12:8.3f}  "
          f"-> {routed.max() / minimum:.2f}x the minimum (max device; the spread is routing imbalance)")
    print(f"  dense loop:     max {dense.max() / 1e12:8.3f}  mean {dense.mean() / 1e12:8.3f}  "
          f"-> {dense.max() / minimum:.1f}x the minimum")
    one = 3 * cfg.moe_expert_in * cfg.moe_intermediate_size
    print(f"  decoded expert weights alive at once: one expert, {one * 2 / 2**20:.0f} MiB bf16 "
          f"({one * 4 / 2**20:.0f} MiB float32); all {local} local experts would be "
          f"{local * one * 2 / 2**30:.2f} GiB bf16")


def ragged_dot_flops() -> None:
    rows, d_in, width = _TOKENS.value * _TOP_K.value, _HIDDEN.value, _WIDTH.value
    print(f"\njax.lax.ragged_dot [{rows}, {d_in}] x [G, {d_in}, {width}] on "
          f"{jax.devices()[0].platform}, XLA cost analysis:")
    for groups in (_FEW.value, _MANY.value):
        sizes = jnp.full((groups,), rows // groups, jnp.int32)
        lowered = jax.jit(jax.lax.ragged_dot).lower(
            jax.ShapeDtypeStruct((rows, d_in), jnp.float32), jax.ShapeDtypeStruct((groups, d_in, width), jnp.float32),
            sizes)
        flops = lowered.compile().cost_analysis().get("flops", float("nan"))
        print(f"  G = {groups:4d}: {flops / 1e9:8.3f} GFLOP  ({flops / (2 * rows * d_in * width):.1f}x the routed rows')")


def main(argv):
    del argv
    time_layers()
    count_k3_flops()
    ragged_dot_flops()


if __name__ == "__main__":
    app.run(main)
