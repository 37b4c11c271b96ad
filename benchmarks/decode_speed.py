"""Plain vs speculative decoding throughput, measured in one run (issue 3 and 5 benchmarks).

    python -m benchmarks.decode_speed                      # SmolLM2 + demo draft (or a random one)
    python -m benchmarks.decode_speed --batch_sizes 1,8 --num_prompts 16 --max_new_tokens 64

Prints, per batch size: plain tokens/s, speculative tokens/s, their ratio, tok/fwd, and the draft's
share of a speculative step (a step with the draft vs the same verify with given drafts). CPU
numbers are only meaningful as ratios; absolute times only from a GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "target directory or preset")
_DRAFT = flags.DEFINE_string("draft_model", None, "draft directory or preset; default: the demo draft "
                             "preset if available, else a random draft built from its config")
_BATCHES = flags.DEFINE_string("batch_sizes", "1,8", "comma-separated batch sizes")
_N = flags.DEFINE_integer("num_prompts", 16, "GSM8K test prompts per batch size")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per prompt")
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per step")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "param dtype")
_JSON = flags.DEFINE_string("output_json", None, "write the results here")


def _draft(target):
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax import load_draft
    from dspark_jax.config import DraftConfig
    from dspark_jax.models.dspark import K3DSparkModel
    if _DRAFT.value:
        return load_draft(_DRAFT.value, dtype=target.dtype), _DRAFT.value
    try:
        return load_draft("smollm2-135m-dspark", dtype=target.dtype), "smollm2-135m-dspark"
    except (NotImplementedError, FileNotFoundError, ValueError):
        cfg_path = Path(__file__).resolve().parent.parent / "dspark_jax" / "configs" / "smollm2-135m-dspark.json"
        cfg = DraftConfig.from_json(cfg_path)
        return K3DSparkModel(cfg, dtype=jnp.dtype(target.dtype), rngs=nnx.Rngs(0)), "random (untrained)"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax import generate, load_target
    from dspark_jax.data.benchmarks import load_gsm8k
    from dspark_jax.generate import _engine

    target = load_target(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
    draft, draft_name = _draft(target)
    items = load_gsm8k(limit=_N.value)
    prompts = [it.conversation() for it in items]
    results = []
    for b in [int(x) for x in _BATCHES.value.split(",")]:
        row = {"batch_size": b, "draft": draft_name}
        for name, d in (("plain", None), ("speculative", draft)):
            # warm-up compiles every shape this run uses
            generate(target, d, prompts[:b], max_new_tokens=_NEW.value, num_speculative_tokens=_T.value)
            produced, elapsed, stats = 0, 0.0, None
            for i in range(0, len(prompts), b):
                res, dt = _timed(lambda: generate(target, d, prompts[i:i + b], max_new_tokens=_NEW.value,
                                                   num_speculative_tokens=_T.value))
                produced += sum(len(o.token_ids) for o in res.outputs)
                elapsed += dt
                stats = res.stats if stats is None else _merge(stats, res.stats)
            row[f"{name}_tokens_per_s"] = produced / elapsed
            if name == "speculative":
                row["tok_per_fwd"] = stats["average_tokens_per_forward"]
        row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        row["draft_share_of_step"] = _draft_share(target, draft, b, jax, jnp, np, _engine)
        results.append(row)
        print(f"batch {b}: plain {row['plain_tokens_per_s']:.1f} tok/s | speculative "
              f"{row['speculative_tokens_per_s']:.1f} tok/s | ratio {row['speedup']:.2f}x | "
              f"tok/fwd {row['tok_per_fwd']:.2f} | draft share of a step {row['draft_share_of_step']:.1%}",
              flush=True)
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=2))


def _merge(a, b):
    steps_a, steps_b = a["num_verify_steps"], b["num_verify_steps"]
    acc = a["total_accepted_tokens"] + b["total_accepted_tokens"]
    n = steps_a + steps_b
    return {"num_verify_steps": n, "total_accepted_tokens": acc,
            "average_tokens_per_forward": 1 + acc / n if n else 1.0}


def _draft_share(target, draft, b, jax, jnp, np, engine_for) -> float:
    """Time one speculative step vs the same verify with the drafts given (no draft pass)."""
    eng = engine_for(target, draft, _T.value, 0.0, 1.0, "auto", 16)
    max_len = 512
    caches = eng.new_caches(b, max_len)
    x0 = jnp.ones((b,), jnp.int32)
    lens = jnp.full((b,), 100, jnp.int32)
    active = jnp.ones((b,), bool)
    key = jax.random.PRNGKey(0)
    given = jnp.ones((b, _T.value), jnp.int32)

    def run(g):
        out = eng._step(eng.t_state, eng.d_state, x0, g, lens, active, jnp.int32(max_len), caches, key)
        jax.block_until_ready(out)

    for g in (None, given):
        run(g)
    reps = 5
    _, with_draft = _timed(lambda: [run(None) for _ in range(reps)])
    _, verify_only = _timed(lambda: [run(given) for _ in range(reps)])
    return max(0.0, 1.0 - verify_only / with_draft)


if __name__ == "__main__":
    app.run(main)
