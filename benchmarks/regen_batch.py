"""Answer-generation throughput by batch size: plain batched greedy decoding as `train.regen` runs it.

    python -m benchmarks.regen_batch --prompts runs/demo/prompts.jsonl --batch_sizes 8,16,32,64

For each batch size B, the continuous-batching loop (the `Scheduler` regen drives) answers
`--rounds` x B pool prompts (chat template, temperature 0, <= --max_new_tokens): a first pass of B prompts
compiles the programs, then the timed pass answers the next `--rounds` x B prompts. Prints
tokens/s per batch size and the ratio to the best, and writes JSON. Generated tokens count every
emitted token (eos included), as regen's log does. Prompts finishing at different times meet
prefill shapes (new rows x prompt bucket) and batch buckets the warm-up pass did not, so the timed pass
still compiles: the table gives tok/s over the wall time and over the wall time less the
compilation JAX reports (`/jax/core/compile/*` durations), the rate a long run approaches once
every shape has been seen. The timed pass ends with a drain (fewer and fewer sequences left),
which a long run never has: the rate up to the step at which the queue ran empty (every slot busy
until then) is the column to pick a batch size by.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

from dspark_jax.serving import pair_flags

_PROMPTS = flags.DEFINE_string("prompts", None, "Prompt pool JSONL (`python -m train.prompts`).")
_MODEL = pair_flags.define_model("smollm2-135m")
_DTYPE = pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Target dtype.")
pair_flags.define_tp()
_BATCHES = flags.DEFINE_list("batch_sizes", ["8", "16", "32", "64"], "Batch sizes to measure.")
_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Answer length limit.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed prompts = rounds x batch size.", lower_bound=1)
_JSON = flags.DEFINE_string("output_json", None, "Write the results here.")
flags.mark_flag_as_required("prompts")


def main(argv):
    del argv
    import jax.numpy as jnp

    from dspark_jax import load_target
    from dspark_jax.bench.steps_timing import CompileClock
    from dspark_jax.decode.buckets import pow2
    from dspark_jax.decode.config import EngineConfig, SchedulerConfig
    from dspark_jax.decode.generate import engine_for
    from dspark_jax.decode.requests import encode_prompt, eos_ids
    from dspark_jax.decode.scheduler import Request, Scheduler
    from dspark_jax.presets import resolve_model_path
    from dspark_jax.tokenizer import load_tokenizer
    from dspark_jax.train import regen

    pair_flags.require_one_device("benchmarks.regen_batch")
    path = resolve_model_path(_MODEL.value)
    target = load_target(path, dtype=jnp.dtype(_DTYPE.value))
    tok = load_tokenizer(path)
    eos = frozenset(eos_ids(target, tok))
    records = regen.read_jsonl(_PROMPTS.value)
    sizes = [int(b) for b in _BATCHES.value]
    need = max(sizes) * (_ROUNDS.value + 1)
    prompts = [encode_prompt(regen.prompt_messages(r), tok, True) for r in records[:need]]
    max_len = pow2(max(len(p) for p in prompts) + _NEW.value + 1)
    engine = engine_for(target, None, EngineConfig(num_speculative_tokens=0))
    clock = CompileClock()
    rows = []
    for b in sizes:
        scheduler = Scheduler(engine, SchedulerConfig(b, max_len))
        # warm-up pass: compiles the first prefill and batch buckets (the timed pass may meet more)
        scheduler.run([Request(p, _NEW.value, eos_ids=eos) for p in prompts[:b]])
        reqs = [Request(p, _NEW.value, eos_ids=eos) for p in prompts[b:b * (_ROUNDS.value + 1)]]
        for r in reqs:
            scheduler.add(r)
        clock.reset()
        t0 = time.perf_counter()
        full = None
        while scheduler.has_work():
            scheduler.step()
            if full is None and scheduler.num_waiting == 0:
                # every slot was busy until now; from here the batch drains, which a long run never does
                full = (time.perf_counter() - t0, clock.seconds, sum(len(r.tokens) for r in reqs))
        dt = time.perf_counter() - t0
        comp = min(clock.seconds, dt)
        tokens = sum(len(r.tokens) for r in reqs)
        full_rate = full[2] / max(full[0] - min(full[1], full[0]), 1e-9)
        rows.append({"batch_size": b, "prompts": len(reqs), "tokens": tokens, "wall_s": dt, "compile_s": comp,
                     "tok_per_s": tokens / dt, "tok_per_s_compiled": tokens / max(dt - comp, 1e-9),
                     "full_s": full[0], "full_compile_s": full[1], "full_tokens": full[2],
                     "tok_per_s_full_compiled": full_rate, "engine_steps": scheduler.num_steps})
        print(f"batch {b:3d}: {len(reqs)} prompts, {tokens} tokens in {dt:.1f}s = {tokens / dt:.1f} tok/s "
              f"({comp:.1f}s compiling; {tokens / max(dt - comp, 1e-9):.1f} tok/s without); while every slot "
              f"was busy: {full[2]} tokens in {full[0]:.1f}s, {full_rate:.1f} tok/s less compiling", flush=True)
    best = max(r["tok_per_s_full_compiled"] for r in rows)
    print("\n| batch | prompts | tokens | wall s | compiling s | tok/s | tok/s less compiling | "
          "tok/s slots full, less compiling | vs best |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['prompts']} | {r['tokens']} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | "
              f"{r['tok_per_s']:.1f} | {r['tok_per_s_compiled']:.1f} | {r['tok_per_s_full_compiled']:.1f} | "
              f"{r['tok_per_s_full_compiled'] / best:.2f} |")
    if _JSON.value:
        Path(_JSON.value).parent.mkdir(parents=True, exist_ok=True)
        Path(_JSON.value).write_text(json.dumps({"model": _MODEL.value, "dtype": _DTYPE.value,
                                                 "max_new_tokens": _NEW.value, "rows": rows}, indent=1))


if __name__ == "__main__":
    app.run(main)
