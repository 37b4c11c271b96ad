"""KDA prefill throughput: chunked (WY, parallel within a chunk) vs recurrent (scan over tokens).

Both forms run the whole layer (projections, conv, gates, norm) on the same weights and input in
one process; prints tokens/s of each and their ratio. Absolute numbers depend on the machine; the
ratio is the result.

    python -m benchmarks.kda_chunked_vs_recurrent --seq_len 2048 --heads 4 --head_dim 64
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dspark_jax.config.kimi import KimiConfig
from dspark_jax.layers.kda import KimiDeltaAttention

_BATCH = flags.DEFINE_integer("batch", 1, "sequences per call")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "prefill length")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "model width D")
_HEADS = flags.DEFINE_integer("heads", 4, "KDA heads")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "KDA head dim (K = V)")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "chunk length of the chunked form")
_K3 = flags.DEFINE_boolean("k3", True, "K3 bounded gate + full-rank g_proj (else Kimi-Linear)")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per form (after one compile/warm-up call)")


def _config() -> KimiConfig:
    return KimiConfig.from_dict(dict(
        vocab_size=16, hidden_size=_HIDDEN.value, num_hidden_layers=1, intermediate_size=16,
        num_attention_heads=1, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        linear_attn_config=dict(num_heads=_HEADS.value, head_dim=_HEAD_DIM.value, short_conv_kernel_size=4,
                                gate_lower_bound=-5.0 if _K3.value else None,
                                use_full_rank_gate=_K3.value, kda_layers=[1], full_attn_layers=[])))


def _best_times(fns, *args) -> list[float]:
    """Fastest of `iters` calls per function, calls interleaved so load drift hits both alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))          # compile + warm-up
    best = [float("inf")] * len(fns)
    for _ in range(_ITERS.value):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main(argv):
    del argv
    layer = KimiDeltaAttention(_config(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    b, t = _BATCH.value, _SEQ.value
    x = jax.random.normal(jax.random.key(1), (b, t, _HIDDEN.value), jnp.float32)

    def prefill(mode):
        @jax.jit
        def f(params, x):
            return nnx.merge(graphdef, params)(x, mode=mode, chunk_size=_CHUNK.value)
        return f

    chunked, recurrent = prefill("chunked"), prefill("recurrent")
    diff = np.max(np.abs(np.asarray(chunked(params, x)[0]) - np.asarray(recurrent(params, x)[0])))
    sec_c, sec_r = _best_times([chunked, recurrent], params, x)
    tokens = b * t
    print(f"device {jax.devices()[0].platform}, B={b} T={t} D={_HIDDEN.value} H={_HEADS.value} "
          f"head_dim={_HEAD_DIM.value} chunk={_CHUNK.value} gate={'k3' if _K3.value else 'kimi_linear'}")
    print(f"chunked   prefill: {tokens / sec_c:12.0f} tokens/s  ({sec_c * 1e3:.1f} ms)")
    print(f"recurrent prefill: {tokens / sec_r:12.0f} tokens/s  ({sec_r * 1e3:.1f} ms)")
    print(f"chunked / recurrent throughput: {sec_r / sec_c:.2f}x   (max |out diff| {diff:.1e})")


if __name__ == "__main__":
    app.run(main)
