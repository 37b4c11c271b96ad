"""How long a long prompt stalls a running stream: the chunked prefill budget against one
whole-prompt prefill.

    python -m benchmarks.prefill_stall --prompt_tokens 3000 --budgets 512,8192

For each `--max_num_batched_tokens` value, one stream (a short chat prompt) decodes greedily in
a `Scheduler`; once it runs, a prompt of `--prompt_tokens` tokens (token ids from the tokenizer's
encoding of repeated text) arrives. Every `Scheduler.step` is timed until the long prompt's first
token: the longest step is the longest the stream waited for its next tokens, the sum is the
long prompt's time to first token. A first pass of the same scenario compiles the programs; the
second is timed. Prints one row per budget and writes JSON.
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
pair_flags.define_tp()
_JSON = flags.DEFINE_string("output_json", None, "Write the results here.")


def main(argv):
    del argv
    import jax.numpy as jnp

    from dspark_jax.api import load_draft, load_target
    from dspark_jax.decode.scheduler import Scheduler, Request
    from dspark_jax.decode.engine import Engine
    from dspark_jax.decode.config import EngineConfig
    from dspark_jax.decode.requests import encode_prompt, tokenizer_for
    from dspark_jax.hostinfo import describe_cpu

    pair_flags.require_one_device("benchmarks.prefill_stall")
    target = load_target(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
    draft = load_draft(_DRAFT.value, dtype=target.dtype) if _DRAFT.value != "none" else None
    tok = tokenizer_for(target)
    engine = Engine(target, draft, EngineConfig(num_speculative_tokens=_T.value if draft is not None else 0))
    stream_prompt = encode_prompt("Write a long story about a lighthouse keeper.", tok, True)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(_TOKENS.value))
    long_prompt = tok.encode(text)[:_TOKENS.value]
    if len(long_prompt) < _TOKENS.value:
        raise app.UsageError(f"the filler text encodes to {len(long_prompt)} tokens, fewer than --prompt_tokens")
    rows = []
    for budget in (int(b) for b in _BUDGETS.value):
        scheduler = Scheduler(engine, 2, _MAX_LEN.value, max_num_batched_tokens=budget)
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


if __name__ == "__main__":
    app.run(main)
