"""How long a long prompt stalls a running stream: the chunked prefill budget against one
whole-prompt prefill.

    python -m benchmarks.prefill_stall --prompt_tokens 3000 --budgets 512,8192

For each `--max_num_batched_tokens` value, one stream (a short chat prompt) decodes greedily in
a `Scheduler`; once it runs, a prompt of `--prompt_tokens` tokens (token ids from the tokenizer's
encoding of repeated text) arrives. Every `Scheduler.step` is timed until the long prompt's first
token: the longest step is the longest the stream waited for its next tokens, the sum is the
long prompt's time to first token. A first pass of the same scenario compiles the programs; the
second is timed. Prints one row per budget and writes JSON.

    python -m benchmarks.prefill_stall --dtype bfloat16 --throughput_lengths 512,2048,4096,8192
    python -m benchmarks.prefill_stall --throughput_lengths 512,4096 --budgets 2048 \
        --llama_bench ~/llama.cpp/build/bin/llama-bench --gguf smollm2-135m-bf16.gguf

With `--throughput_lengths` it measures prefill throughput instead: for each prompt length,
`generate(target, None, [ids], max_new_tokens=1)` (the target alone, the prompt whole and, for
each of `--budgets` below the length, in chunks of that many tokens), best of `--reps` timed calls
after a warm one, as tokens/s and as a ratio to the first length's rate; with `--llama_bench`
(and `--gguf`), llama.cpp's `llama-bench -p N -n 0` on the same lengths beside it, in the same run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

from dspark_jax.serving import pair_flags

_MODEL = pair_flags.define_model("smollm2-135m")
_DRAFT = pair_flags.define_draft_model("smollm2-135m-dspark")
_DTYPE = pair_flags.define_dtype("float32", ("float32", "bfloat16"), "Target compute dtype.")
_TOKENS = flags.DEFINE_integer("prompt_tokens", 3000, "Tokens of the long prompt.", lower_bound=1)
_BUDGETS = flags.DEFINE_list("budgets", ["512", "8192"], "max_num_batched_tokens values to compare.")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 4096, "Sequence capacity of the scheduler.", lower_bound=64)
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "Drafts per verify step.", lower_bound=0)
_LENGTHS = flags.DEFINE_list("throughput_lengths", [], "Prompt lengths of the prefill-throughput mode "
                              "(empty: the stall scenario).")
_REPS = flags.DEFINE_integer("reps", 2, "Timed calls per length in the throughput mode (the best is kept).",
                             lower_bound=1)
_LLAMA_BENCH = flags.DEFINE_string("llama_bench", None, "llama.cpp's llama-bench binary: run `-p N` beside ours.")
_GGUF = flags.DEFINE_string("gguf", None, "The GGUF llama-bench loads (the same weights, e.g. BF16).")
_THREADS = flags.DEFINE_integer("threads", None, "llama-bench threads (default: the CPUs this process may use).")
pair_flags.define_tp()
_JSON = flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    import jax.numpy as jnp

    from dspark_jax.api import load_draft, load_target
    from dspark_jax.decode.config import EngineConfig, SchedulerConfig
    from dspark_jax.decode.engine import Engine
    from dspark_jax.decode.requests import encode_prompt, tokenizer_for
    from dspark_jax.decode.scheduler import Request, Scheduler
    from dspark_jax.hostinfo import describe_cpu

    pair_flags.require_one_device("benchmarks.prefill_stall")
    if _LLAMA_BENCH.value and not _GGUF.value:
        raise app.UsageError("--llama_bench needs --gguf (the model file it loads)")
    target = load_target(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
    if _LENGTHS.value:
        return throughput(target, [int(n) for n in _LENGTHS.value], [int(b) for b in _BUDGETS.value])
    draft = load_draft(_DRAFT.value, dtype=target.dtype) if _DRAFT.value != "none" else None
    tok = tokenizer_for(target)
    engine = Engine(target, draft, EngineConfig(num_speculative_tokens=_T.value if draft is not None else 0))
    stream_prompt = encode_prompt("Write a long story about a lighthouse keeper.", tok, True)
    long_prompt = filler_ids(tok, _TOKENS.value)
    rows = []
    for budget in (int(b) for b in _BUDGETS.value):
        scheduler = Scheduler(engine, SchedulerConfig(2, _MAX_LEN.value, max_num_batched_tokens=budget))
        for timed in (False, True):
            stream = Request(stream_prompt, _MAX_LEN.value - len(stream_prompt) - engine.t - 1)
            scheduler.add(stream)
            scheduler.step()
            long_req = Request(long_prompt, 1)
            scheduler.add(long_req)
            steps, before = [], len(stream.tokens)
            while not long_req.tokens:
                t0 = time.perf_counter()
                scheduler.step()
                steps.append(time.perf_counter() - t0)
            got = len(stream.tokens) - before
            scheduler.abort(stream)
            if timed:
                rows.append(dict(max_num_batched_tokens=budget, prefill_steps=len(steps),
                                 longest_stall_s=max(steps), time_to_first_token_s=sum(steps),
                                 stream_tokens_meanwhile=got))
        r = rows[-1]
        print(f"budget {budget:6d}: {r['prefill_steps']} steps, longest stall {r['longest_stall_s']:.2f} s, "
              f"long prompt's first token after {r['time_to_first_token_s']:.2f} s, "
              f"stream got {r['stream_tokens_meanwhile']} tokens meanwhile", flush=True)
    out = dict(model=_MODEL.value, draft=_DRAFT.value, dtype=_DTYPE.value, prompt_tokens=_TOKENS.value,
               max_model_len=_MAX_LEN.value, num_speculative_tokens=engine.t, cpu=describe_cpu(),
               date=time.strftime("%Y-%m-%d"), rows=rows)
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(out, indent=1) + "\n")


def filler_ids(tok, n: int) -> list[int]:
    """n token ids of repeated text (the tokenizer's encoding; an error when it has fewer)."""
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(n))
    ids = tok.encode(text)[:n]
    if len(ids) < n:
        raise app.UsageError(f"the filler text encodes to {len(ids)} tokens, fewer than {n}")
    return ids


def throughput(target, lengths: list[int], budgets: list[int]) -> None:
    """Prefill tokens/s by prompt length (whole, and chunked by each budget below the length),
    and llama-bench's beside it when given."""
    from dspark_jax.decode.generate import generate
    from dspark_jax.decode.requests import tokenizer_for
    from dspark_jax.hostinfo import describe_cpu

    tok = tokenizer_for(target)
    rows = []
    for n in lengths:
        ids = filler_ids(tok, n)
        for budget in [None] + sorted(b for b in budgets if b < n):
            def call():
                generate(target, None, [ids], max_new_tokens=1, max_model_len=max(n + 2, 2048),
                         max_num_batched_tokens=budget)
            call()                              # compiles
            best = float("inf")
            for _ in range(_REPS.value):
                t0 = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t0)
            rows.append(dict(prompt_tokens=n, max_num_batched_tokens=budget, seconds=best, tokens_per_s=n / best))
            print(f"ours  {n:6d} tokens, {'whole' if budget is None else f'chunks of {budget}':>15}: "
                  f"{best:8.3f} s, {n / best:8.1f} tokens/s", flush=True)
    peer = llama_bench(lengths) if _LLAMA_BENCH.value else {}
    base = next(r["tokens_per_s"] for r in rows if r["max_num_batched_tokens"] is None)
    print(f"\n| prompt tokens | ours tokens/s | x ours at {lengths[0]} |"
          + (" llama-bench -p N tokens/s | ours / llama.cpp |" if peer else ""))
    print("|---:|---:|---:|" + ("---:|---:|" if peer else ""))
    for r in rows:
        n, label = r["prompt_tokens"], "" if r["max_num_batched_tokens"] is None else f" (chunks of {r['max_num_batched_tokens']})"
        cells = f"| {n}{label} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} |"
        if peer:
            cells += f" {peer[n]:.1f} | {r['tokens_per_s'] / peer[n]:.2f} |"
        print(cells)
    out = dict(model=_MODEL.value, dtype=_DTYPE.value, cpu=describe_cpu(), date=time.strftime("%Y-%m-%d"),
               rows=rows, llama_bench={str(k): v for k, v in peer.items()}, gguf=_GGUF.value)
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(out, indent=1) + "\n")


def llama_bench(lengths: list[int]) -> dict[int, float]:
    """{prompt tokens: llama-bench's mean prompt-processing tokens/s} (`-p N -n 0 -o json`)."""
    import os
    import subprocess

    threads = _THREADS.value or len(os.sched_getaffinity(0))
    cmd = [_LLAMA_BENCH.value, "-m", _GGUF.value, "-p", ",".join(map(str, lengths)), "-n", "0",
           "-t", str(threads), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(done.stdout) if int(r["n_gen"]) == 0}


if __name__ == "__main__":
    app.run(main)
