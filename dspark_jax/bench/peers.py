"""Our decoding beside its peers (`python -m benchmarks.peers`, `benchmarks.gpu_bench`): the
measurement protocol (alternating rounds, compile-free timed runs, best and median per prompt),
its table, the CPU's description, and the systems: ours (plain and speculative `generate()`),
transformers' greedy and prompt-lookup `generate`, llama-cpp-python's plain and lookup decoding
(llama.cpp's own binaries: dspark_jax/bench/llama_cpp.py). No command-line flags here, so both
programs and the tests import it."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ALL_SYSTEMS = ("ours_plain", "ours_spec", "hf_greedy", "hf_pld", "llamacpp_plain", "llamacpp_lookup")
DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "gguf": "Q4_1"}


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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
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
            row["first_difference"] = {str(p): common_prefix(mine[p], theirs[p]) for p in common
                                       if mine[p] != theirs[p]}
            row["matching_prefix_tokens"] = sum(common_prefix(mine[p], theirs[p]) for p in common)
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
            weights = {"weight_bytes": weight_bytes(target)}
            out.append(System(f"ours_plain:{dt}", "ours, plain", dt, _ours_run(generate, target, None, 0, tokenizer),
                              counter, stats=lambda weights=weights: weights))
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


def weight_bytes(model) -> int:
    """Bytes of a model's parameters: what plain decoding reads per token (the tied embedding once)."""
    import jax
    from flax import nnx
    return sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


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
    labels = {"llamacpp_plain": "llama-cpp-python, plain",
              "llamacpp_lookup": f"llama-cpp-python, prompt lookup ({lookup})"}
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
        out.append(System(k, labels[k] + f" [{llama_cpp.__version__}]", "gguf",
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

def write_json(path: str | os.PathLike, result: dict[str, Any]) -> None:
    """Write atomically (a temp file renamed), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
