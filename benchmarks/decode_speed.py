"""Plain, fixed-length speculative and adaptive speculative decoding throughput, measured in one run.

    python -m benchmarks.decode_speed                      # SmolLM2 + demo draft (or a random one)
    python -m benchmarks.decode_speed --batch_sizes 1,2,4,8,16,32 --num_prompts 32 --rounds 3
    python -m benchmarks.decode_speed --steps_only --random_weights --model dspark_jax/configs/smollm2-135m.json

Each variant first runs once untimed over the same batches (compiling every program the timed
rounds meet: for the adaptive variant, every speculation length at every batch bucket up to the
batch size, as its choices and the buckets of a batch's last steps may differ from one pass to the
next; it also measures the step costs of a bucket not measured before on the host it runs on).
A timed round then runs each batch (one `generate()` call) under the three variants back to back,
their order rotating from call to call, so the ratio within a round compares passes seconds apart
on a machine whose speed drifts over minutes.
Prints the CPU (model, cores, bf16 flags) and, per batch size: plain tokens/s, speculative
tokens/s with every step verifying T drafts ("fixed"), their ratio (of the best rounds, and the
median of the ratios within each round), tok/fwd, and the draft's
share of a speculative step (the draft's block pass vs the verify that follows it) and the break-even
tok/fwd (a speculative step's cost over a one-token step's: speculation wins above it), and the
wall time per decode step inside the compiled step (dispatch + wait) and outside it (prefill, the
host loop, set-up), for the best round of each variant; then the adaptive speculation length
(the library's default: each step verifies the L of most expected tokens/s, docs/profile.md):
its tokens/s, its ratio to plain and the lengths its steps chose. A summary table of the three
rates ends the run. CPU numbers are only meaningful as ratios; absolute times only from a GPU.

By default each batch size b runs the prompts in batches of b, one `generate()` call each, which
lasts as long as its slowest sequence: with speculation, sequences that accept fewer drafts finish
later, and the batch's last steps run a few rows. `--continuous` decodes all the prompts in one call
with b slots (`generate(max_num_seqs=b)`): a finished sequence's slot takes the next prompt at once,
as the server's continuous batching does.

`--steps_only` times just the three steps (no generation, no prompts, no tokenizer) and prints
them in ms; with `--random_weights` the target is built from --model's config alone (a
config.json or its directory, e.g. dspark_jax/configs/smollm2-135m.json) with random weights
(what a step costs does not depend on the values), so a machine without the checkpoint can
measure it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from absl import app, flags

from dspark_jax.bench.steps_timing import (CompileClock, StepClock, make_engine, random_target, run_every_length,
                                           run_every_prefill, step_costs)
from dspark_jax.serving import pair_flags

_MODEL = pair_flags.define_model("smollm2-135m")
_DRAFT = pair_flags.define_draft_model("smollm2-135m-dspark")
_BATCHES = flags.DEFINE_string("batch_sizes", "1,8", "comma-separated batch sizes")
_N = flags.DEFINE_integer("num_prompts", 16, "GSM8K test prompts per batch size")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per prompt")
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per step")
_DTYPE = pair_flags.define_dtype()
pair_flags.define_tp()
_ROUNDS = flags.DEFINE_integer("rounds", 1, "timed passes per variant, alternating; the best is reported",
                               lower_bound=1)
_JSON = flags.DEFINE_string("output_json", None, "write the results here")
_REPS = flags.DEFINE_integer("step_reps", 5, "timed repetitions of each step (after a compile call)")
_CONTINUOUS = flags.DEFINE_bool("continuous", False, "each batch size is the sequences decoded at once over all "
                                 "--num_prompts prompts (generate(max_num_seqs=)), a finished one's slot taking the "
                                 "next prompt as in a server; default: batches of that many prompts, one generate() "
                                 "call each, which lasts as long as its slowest sequence")
_STEPS_ONLY = flags.DEFINE_bool("steps_only", False, "only time the steps (block pass, verify, one-token step)")
_RANDOM = flags.DEFINE_bool("random_weights", False, "target from --model's config (a config.json or its "
                            "directory) with random weights (with --steps_only)")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from dspark_jax import generate, load_target
    from dspark_jax.decode.buckets import prefill_bucket
    from dspark_jax.data.eval_sets import load_gsm8k
    from dspark_jax.decode.requests import encode_prompt, tokenizer_for
    from dspark_jax.serving.pair import load_draft_spec

    pair_flags.require_one_device("benchmarks.decode_speed")
    if _RANDOM.value and not _STEPS_ONLY.value:
        raise app.UsageError("--random_weights times steps only: add --steps_only")
    from dspark_jax.api import resolve_dtype
    from dspark_jax.hostinfo import describe_cpu

    dtype = resolve_dtype(_DTYPE.value, "--dtype")
    t0 = time.perf_counter()
    try:
        if _RANDOM.value:
            target = random_target(_MODEL.value, dtype or jnp.dtype(jnp.float32))
        else:
            target = load_target(_MODEL.value, dtype=dtype or "checkpoint")
    except ValueError as e:
        if not _RANDOM.value:
            raise
        raise app.UsageError(f"--model {e}") from None
    draft, draft_name = load_draft_spec(_DRAFT.value, target), _DRAFT.value
    print(f"target and draft ready in {time.perf_counter() - t0:.1f} s; params {jnp.dtype(target.dtype).name}; "
          f"CPU: {describe_cpu()}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    if draft is None:
        raise app.UsageError("--draft_model none: there is no speculative step to time")
    prompts = [] if _STEPS_ONLY.value else [it.conversation() for it in load_gsm8k(limit=_N.value)]
    tokenizer = tokenizer_for(target) if prompts else None
    widths = sorted({prefill_bucket(len(encode_prompt(p, tokenizer, True))) for p in prompts})    # prompt buckets
    # batches the warm-up's did not form (prompt buckets, batch buckets) compile inside the timed
    # runs; the rates are reported over the wall time and over the wall time less that compilation
    clock, steps = CompileClock(), StepClock()
    results = []
    for b in [int(x) for x in _BATCHES.value.split(",")]:
        row = {"batch_size": b, "draft": draft_name}
        eng = make_engine(target, draft, _T.value)
        costs = step_costs(eng, b, reps=_REPS.value)
        share, break_even = costs["draft_share"], costs["break_even"]
        row["draft_share_of_step"] = share
        row["break_even_tok_per_fwd"] = break_even
        row.update({k: costs[k] for k in ("draft_block_ms", "verify_ms", "one_token_step_ms")})
        if _STEPS_ONLY.value:
            results.append(row)
            print(f"batch {b}: draft block pass {row['draft_block_ms']:.2f} ms | verify of {_T.value + 1} tokens "
                  f"{row['verify_ms']:.2f} ms | one-token step {row['one_token_step_ms']:.2f} ms | draft share "
                  f"of a step {share:.1%} | break-even tok/fwd {break_even:.2f}", flush=True)
            continue
        # "speculative": every step verifies T drafts; "adaptive": the library's default length choice
        variants = [("plain", None, "fixed"), ("speculative", draft, "fixed"), ("adaptive", draft, "adaptive")]
        batches = [prompts] if _CONTINUOUS.value else [prompts[i:i + b] for i in range(0, len(prompts), b)]
        row["batching"] = "continuous" if _CONTINUOUS.value else "fixed"

        def run(ps, d, length):
            return generate(target, d, ps, max_new_tokens=_NEW.value, num_speculative_tokens=_T.value,
                            speculative_length=length, max_num_seqs=b)

        for name, d, length in variants:   # an untimed pass over the same batches compiles every
            for ps in batches:             # program the timed rounds meet
                run(ps, d, length)
            if length == "adaptive":       # and every length at every bucket: the timed rounds
                run_every_length(eng)      # may choose other lengths, their tails other buckets
            if _CONTINUOUS.value:          # and prompts admitted a few at a time, as slots free up
                run_every_prefill(make_engine(target, d, _T.value if d is not None else 0), widths)
        for rnd in range(_ROUNDS.value):
            # a round runs each batch under every variant back to back (seconds apart, so a slow
            # spell of the machine hits them alike), the variants' order rotating from one call to
            # the next; each variant's best round is reported
            tally = {name: {"produced": 0, "elapsed": 0.0, "compile": 0.0, "steps": 0, "step_s": 0.0,
                            "stats": None} for name, _, _ in variants}
            for i, ps in enumerate(batches):
                k = (rnd + i) % len(variants)
                for name, d, length in variants[k:] + variants[:k]:
                    clock.reset()
                    steps.reset()
                    res, dt = _timed(lambda: run(ps, d, length))
                    acc = tally[name]
                    acc["produced"] += sum(len(o.token_ids) for o in res.outputs)
                    acc["elapsed"] += dt
                    acc["compile"] += min(clock.seconds, dt)
                    acc["steps"] += steps.steps
                    acc["step_s"] += steps.seconds
                    acc["stats"] = res.stats if acc["stats"] is None else _merge(acc["stats"], res.stats)
            for name, d, _ in variants:
                acc = tally[name]
                produced, elapsed, comp, stats = acc["produced"], acc["elapsed"], acc["compile"], acc["stats"]
                row.setdefault(f"{name}_tokens_per_s_by_round", []).append(produced / elapsed)
                row.setdefault(f"{name}_compile_s_by_round", []).append(comp)
                row.setdefault(f"{name}_steps_by_round", []).append(acc["steps"])
                if d is not None:
                    row.setdefault(f"{name}_length_counts_by_round", []).append(stats["verify_length_counts"])
                if rnd and produced / elapsed <= row[f"{name}_tokens_per_s"]:
                    continue
                row[f"{name}_tokens_per_s"] = produced / elapsed
                row[f"{name}_compile_s"] = comp
                row[f"{name}_tokens_per_s_compiled"] = produced / max(elapsed - comp, 1e-9)
                # where the wall time went: the decode steps (a compiling step included) and the rest
                row[f"{name}_steps"] = acc["steps"]
                row[f"{name}_ms_per_step"] = 1e3 * acc["step_s"] / max(acc["steps"], 1)
                row[f"{name}_ms_per_step_outside"] = 1e3 * (elapsed - acc["step_s"]) / max(acc["steps"], 1)
                if d is not None:
                    row[f"{name}_tok_per_fwd"] = stats["average_tokens_per_forward"]
                    row[f"{name}_drafts_verified_per_step"] = (stats["total_draft_tokens"]
                                                               / max(stats["num_verify_steps"], 1))
                    row[f"{name}_length_counts"] = stats["verify_length_counts"]
        row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        # a virtual machine's speed can drift by tens of percent within minutes, and the best rounds
        # of two variants may come from different spells: the ratio within each round (the variants
        # run back to back) is the steadier figure. Rounds that still compiled are left out while
        # any other is left.
        rounds = list(zip(row["speculative_tokens_per_s_by_round"], row["plain_tokens_per_s_by_round"],
                          row["speculative_compile_s_by_round"], row["plain_compile_s_by_round"]))
        clean = [r for r in rounds if r[2] < 0.1 and r[3] < 0.1]
        by_round = sorted(sp / pl for sp, pl, _, _ in clean or rounds)
        which = "without compilation" if clean else "all compiled"
        row["speedup_by_round"] = by_round
        row["speedup_median_of_rounds"] = statistics.median(by_round)
        row["speedup_compiled"] = row["speculative_tokens_per_s_compiled"] / row["plain_tokens_per_s_compiled"]
        line = (f"batch {b}: plain {row['plain_tokens_per_s']:.1f} tok/s | speculative "
                f"{row['speculative_tokens_per_s']:.1f} tok/s | ratio {row['speedup']:.2f}x (within a round: median "
                f"{row['speedup_median_of_rounds']:.2f}x of {len(by_round)} {which}, "
                f"{by_round[0]:.2f}-{by_round[-1]:.2f}) | "
                f"less compilation "
                f"({row['plain_compile_s']:.1f} s / {row['speculative_compile_s']:.1f} s): plain "
                f"{row['plain_tokens_per_s_compiled']:.1f}, speculative {row['speculative_tokens_per_s_compiled']:.1f} "
                f"tok/s, ratio {row['speedup_compiled']:.2f}x | "
                f"tok/fwd {row['speculative_tok_per_fwd']:.2f} | draft share of a step {share:.1%} | "
                f"break-even tok/fwd {break_even:.2f} | per decode step, in the step + outside it: plain "
                f"{row['plain_ms_per_step']:.1f} + {row['plain_ms_per_step_outside']:.1f} ms, speculative "
                f"{row['speculative_ms_per_step']:.1f} + {row['speculative_ms_per_step_outside']:.1f} ms")
        row["adaptive_speedup"] = row["adaptive_tokens_per_s"] / row["plain_tokens_per_s"]
        adaptive_by_round = sorted(a / pl for a, pl in zip(row["adaptive_tokens_per_s_by_round"],
                                                          row["plain_tokens_per_s_by_round"]))
        row["adaptive_speedup_median_of_rounds"] = statistics.median(adaptive_by_round)
        chosen = ", ".join(f"L={k}: {v}" for k, v in row["adaptive_length_counts"].items() if v)
        line += (f" | adaptive {row['adaptive_tokens_per_s']:.1f} tok/s ({row['adaptive_speedup']:.2f}x plain, "
                 f"within a round median {row['adaptive_speedup_median_of_rounds']:.2f}x; tok/fwd "
                 f"{row['adaptive_tok_per_fwd']:.2f}; steps by length: {chosen})")
        results.append(row)
        print(line, flush=True)
        # the next batch size meets other cache geometries: drop this one's programs, which hold
        # hundreds of memory mappings each against the process's limit (vm.max_map_count)
        jax.clear_caches()
        eng.programs.clear()       # generate()'s speculative engine: what the chooser reads as compiled
    if results and not _STEPS_ONLY.value:
        print(f"\ntokens/s, demo settings T = {_T.value}, {_NEW.value} new tokens, {_N.value} GSM8K prompts, "
              f"{'continuous batching over b slots' if _CONTINUOUS.value else 'batches of b prompts'}; "
              f"CPU: {describe_cpu()}")
        print(f"{'batch':>5} | {'plain':>8} | {'fixed T':>8} | {'adaptive':>8} | fixed/plain | adaptive/plain")
        for r in results:
            print(f"{r['batch_size']:>5} | {r['plain_tokens_per_s']:8.1f} | {r['speculative_tokens_per_s']:8.1f} | "
                  f"{r['adaptive_tokens_per_s']:8.1f} | {r['speedup']:10.2f}x | {r['adaptive_speedup']:13.2f}x")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=2))


def _merge(a, b):
    keys = ("num_verify_steps", "total_accepted_tokens", "total_draft_tokens")
    out = {k: a[k] + b[k] for k in keys}
    out["verify_length_counts"] = {k: a["verify_length_counts"][k] + b["verify_length_counts"][k]
                                   for k in a["verify_length_counts"]}
    n = out["num_verify_steps"]
    out["average_tokens_per_forward"] = 1 + out["total_accepted_tokens"] / n if n else 1.0
    return out


if __name__ == "__main__":
    app.run(main)
