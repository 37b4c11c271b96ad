"""Where a decode step's time goes: the three compiled programs, broken into op groups from a real trace.

    python -m benchmarks.profile_steps                       # demo pair, batch 1 and 8
    python -m benchmarks.profile_steps --batch_sizes 1 --reps 20 --output_json /tmp/profile.json

For the demo pair (SmolLM2-135M f32 + the shipped DSpark draft, or --model/--draft_model) it times,
at each batch size, on a cache `--context` tokens deep:

- `step(1)`: the one-token step (`Engine.step` with zero given drafts),
- `verify(T+1)`: the verify of T+1 tokens (`Engine.step` with T given drafts),
- `draft`: the draft's block pass (`Engine.propose`),

exactly as `benchmarks.decode_speed --steps_only` does (median wall time of `--reps` calls, the three
programs interleaved). Then it records `--trace_reps` calls of each program under
`jax.profiler.start_trace(create_perfetto_trace=True)`, reads the trace's per-HLO-instruction events
(XLA:CPU's thunk executor names each by its instruction: `ynn_fusion.3`, `dot.7`, `fusion.12`, ...),
and maps every instruction to its source through the compiled program's HLO text
(`jitted.lower(...).compile().as_text()`: each instruction's `stack_frame_id` -> the Python stack
that built it; a fusion takes the group of the ops it calls, a GEMM's first). The groups:

projections (Linear GEMMs), attention (scores/softmax/values over the paged keys), lm_head (the GEMM
whose output has the vocabulary dimension), cache writes (PagedPool.write), gathers (PagedPool.read,
embedding lookups), norms/activations (RMSNorm, RoPE, SiLU), sampling/acceptance (argmax, Markov
head, acceptance), other. Op time is the exclusive duration of the instruction events (nested
events are subtracted from their parents) divided by the number of calls; `runtime` is the part of
the wall time no instruction event covers (dispatch, argument handling, executor overhead). Prints a
table (ms per call and % of the wall time per group per program) and writes JSON.

One file although it is a little over 450 lines: the trace reading and the op grouping serve this
program only.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from absl import app, flags

from dspark_jax.serving import pair_flags

_MODEL = pair_flags.define_model("smollm2-135m")
_DRAFT = pair_flags.define_draft_model("smollm2-135m-dspark")
_DTYPE = pair_flags.define_dtype("float32", ("float32", "bfloat16"), "target (and so draft) compute dtype")
pair_flags.define_tp()
_BATCHES = flags.DEFINE_string("batch_sizes", "1,8", "comma-separated batch sizes")
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per step")
_CONTEXT = flags.DEFINE_integer("context", 100, "tokens already in the cache")
_REPS = flags.DEFINE_integer("reps", 15, "timed calls of each program (median)")
_TRACE_REPS = flags.DEFINE_integer("trace_reps", 5, "calls of each program recorded in the trace")
_JSON = flags.DEFINE_string("output_json", None, "write the results here")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "keep the traces here (default: a temp dir)")
_VARIANTS = flags.DEFINE_string("variants", "declared", "comma-separated engine variants, timed interleaved in "
                                "one process: 'declared' (the params as declared, [out, in], one GEMM per "
                                "weight), 'serving' (Engine's serving layout: fused q|k|v and gate|up, [in, out]), "
                                "'fp32_cache' (the declared params over a float32 KV cache instead of the "
                                "model dtype's)")

GROUPS = ("projections", "attention", "lm_head", "cache writes", "gathers", "norms/activations",
          "sampling/acceptance", "other")


# ---------------------------------------------------------------------------------------------
# HLO text -> instruction -> group

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def parse_hlo(text: str):
    """(instructions {name: Instr}, computations {name: [instruction names]},
    stacks {frame_id: [(file, function, line) innermost first]}, entry computation name)."""
    files, funcs, locs, frames = {}, {}, {}, {}
    section = None
    instrs, comps, cur, entry = {}, {}, None, None
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        if section and s and s[0].isdigit():
            idx, rest = s.split(" ", 1)
            idx = int(idx)
            if section == "FileNames":
                files[idx] = rest.strip('"')
            elif section == "FunctionNames":
                funcs[idx] = rest.strip('"')
            elif section == "FileLocations":
                kv = dict(re.findall(r"(\w+)=(\d+)", rest))
                locs[idx] = (int(kv["file_name_id"]), int(kv["function_name_id"]), int(kv["line"]))
            else:
                kv = dict(re.findall(r"(\w+)=(\d+)", rest))
                frames[idx] = (int(kv["file_location_id"]), int(kv["parent_frame_id"]))
            continue
        section = None
        if not s:
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            name, shape, opcode = m.groups()
            called = []
            for c in _CALLS.findall(line):
                called += [x.strip().lstrip("%") for x in c.strip("{}").split(",") if x.strip()]
            args = line[m.end():].split("), ")[0]
            operands = re.findall(r"%([\w.\-]+)", args)
            f = _FRAME.search(line)
            instrs[name] = Instr(opcode, shape, int(f.group(1)) if f else None, called, operands, cur)
            comps[cur].append(name)
            continue
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            cur = m.group(1)
            comps[cur] = []
            if s.startswith("ENTRY"):
                entry = cur

    def stack(fid):
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            fi, fn, ln = locs[loc]
            out.append((os.path.basename(files.get(fi, "?")), funcs.get(fn, "?"), ln))
            # as printed, parent_frame_id is the parent's id + 1 (1: no parent)
            if parent <= 1:
                break
            fid = parent - 1
        return out

    stacks = {fid: stack(fid) for fid in frames}
    return instrs, comps, stacks, entry


class Instr(NamedTuple):
    opcode: str
    shape: str
    frame: int | None
    called: list
    operands: list
    computation: str


def _has_dim(shape: str, n: int) -> bool:
    return re.search(rf"[\[,]{n}[\],]", shape) is not None


def _group_of(opcode: str, shape: str, stack, vocab: int) -> str:
    fns = [fn for _, fn, _ in stack]
    joined = " ".join(fns)
    if opcode in ("dot", "convolution") and _has_dim(shape, vocab) and \
            any(f in joined for f in ("TargetLM.logits", "Embed.attend", "base_logits", "lm_head")) and \
            "markov" not in joined.lower():
        return "lm_head"
    if "PagedPool.write" in joined:
        return "cache writes"
    if "PagedPool.read" in joined:
        return "gathers"
    if any(f in joined for f in ("accept_greedy", "accept_sampling", "markov_draft", "sample_tokens",
                                 "_leading_true", "confidence", "filter_logits")):
        return "sampling/acceptance"
    if "Linear.__call__" in joined:
        return "projections"
    if any(f in joined for f in ("gqa_attention", "attend_paged", "attention_core", "LlamaAttention.attend",
                                 "mla_attention", "paged_attention")):
        return "attention"
    if "Embed.__call__" in joined or "_take" in joined:
        return "gathers"
    if any(f in joined for f in ("RMSNorm", "rms_norm", "Rotary", "rope", "LlamaMLP", "silu", "MLP")):
        return "norms/activations"
    if opcode in ("dot", "convolution"):
        return "projections"
    return "other"


_PRIORITY = {"dot": 0, "convolution": 0, "scatter": 1, "dynamic-update-slice": 1, "gather": 2,
             "dynamic-slice": 2, "reduce": 3}
_PASS = ("bitcast", "copy", "transpose", "reshape", "convert", "fusion", "get-tuple-element", "broadcast")


def classify(instrs, comps, stacks, vocab: int, entry: str | None = None) -> dict[str, str]:
    """group of every instruction: a fusion / call / while takes the group of its most telling
    callee (a GEMM, then a scatter, a gather, a reduction), else its own stack's. Ops XLA left
    without metadata: a GEMM by the weight it reads (embeddings / lm_head: lm_head; Markov head:
    sampling; another weight: projections; none, activations only: attention, or its loop's
    group inside a loop), anything else by its caller's or its operands' stack."""
    memo = {}
    caller = {}
    for name, ins in instrs.items():
        for c in ins.called:
            caller.setdefault(c, name)

    def key_op(name, depth=0):
        """(priority, name) of the most telling op at or under `name`."""
        if name in memo:
            return memo[name]
        ins = instrs[name]
        best = (_PRIORITY.get(ins.opcode, 9), name)
        if depth < 8:
            for c in ins.called:
                for sub in comps.get(c, []):
                    cand = key_op(sub, depth + 1)
                    if cand[0] < best[0] or (cand[0] == best[0] and instrs[best[1]].frame is None
                                             and instrs[cand[1]].frame is not None):
                        best = cand
        memo[name] = best
        return best

    def weight(name, depth=0):
        """an entry parameter (a weight) that `name` reads, through layout ops."""
        ins = instrs.get(name)
        if ins is None or depth > 5:
            return None
        if ins.opcode == "parameter" and ("t_state" in name or "d_state" in name):
            return name
        if ins.opcode in _PASS or ins.opcode == "parameter":
            for op in ins.operands:
                w = weight(op, depth + 1)
                if w:
                    return w
        return None

    def frame_near(name, depth=0):
        ins = instrs.get(name)
        if ins is None or depth > 6:
            return None
        if ins.frame is not None:
            return ins.frame
        if ins.computation in caller:
            f = frame_near(caller[ins.computation], depth + 1)
            if f is not None:
                return f
        for op in ins.operands:
            f = frame_near(op, depth + 1)
            if f is not None:
                return f
        return None

    def outer(name):
        """the instruction in `entry` that contains `name` (through fusions / calls / loops)."""
        seen = 0
        while instrs[name].computation != entry and instrs[name].computation in caller and seen < 10:
            name = caller[instrs[name].computation]
            seen += 1
        return name

    def in_loop(name):
        seen = 0
        while instrs[name].computation in caller and seen < 10:
            name = caller[instrs[name].computation]
            if instrs[name].opcode == "while":
                return True
            seen += 1
        return False

    out = {}
    for name, ins in instrs.items():
        pri, sub = key_op(name)
        sins = instrs[sub]
        if sins.opcode in ("dot", "convolution") and sins.frame is None:
            top = outer(sub) if sins.computation != entry else sub
            ws = [w for op in instrs[top].operands if (w := weight(op))]
            wname = " ".join(ws).lower()
            if "markov" in wname or (not ws and in_loop(sub)):
                out[name] = "sampling/acceptance"
            elif ("embed_tokens" in wname or "lm_head" in wname) and _has_dim(sins.shape, vocab):
                out[name] = "lm_head"
            elif ws:
                out[name] = "projections"
            else:
                out[name] = "attention"
            continue
        if pri == 9 or sins.frame is None:
            fr = frame_near(name)
            op, shp = ins.opcode, ins.shape
        else:
            fr, op, shp = sins.frame, sins.opcode, sins.shape
        out[name] = _group_of(op, shp, stacks.get(fr, []), vocab)
    return out


# ---------------------------------------------------------------------------------------------
# trace -> per-instruction exclusive time


def trace_op_times(trace_dir: str, module: str):
    """({hlo_op: exclusive µs summed over the trace}, number of runs) for one HLO module."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module
           and "hlo_op" in e.get("args", {})]
    runs = {e["args"].get("run_id") for e in ops}
    by_tid = collections.defaultdict(list)
    for e in ops:
        by_tid[e["tid"]].append(e)
    excl = collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []   # (end, name)
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if stack:   # nested: subtract from the parent
                excl[stack[-1][1]] -= e["dur"]
            excl[e["args"]["hlo_op"]] += e["dur"]
            stack.append((e["ts"] + e["dur"], e["args"]["hlo_op"]))
    return excl, max(len(runs), 1)


# ---------------------------------------------------------------------------------------------


def programs(eng, b: int, t: int, context: int):
    """{name: (jitted, args(caches), kwargs)} of the three programs, and the fresh caches."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.decode.buckets import pow2

    max_len = max(512, pow2(context + t + 1))
    caches = eng.new_caches(b, max_len)
    x0, lens = jnp.ones((b,), jnp.int32), jnp.full((b,), context, jnp.int32)
    active, key = jnp.ones((b,), bool), jax.random.PRNGKey(0)
    ml = jnp.int32(max_len)
    progs = {
        "step(1)": (eng.step_jit, lambda c: (eng.t_state, eng.d_state, x0, jnp.ones((b, 0), jnp.int32), lens,
                                             active, ml, c, key), {"serving": eng.serving}),
        f"verify({t + 1})": (eng.step_jit, lambda c: (eng.t_state, eng.d_state, x0, jnp.ones((b, t), jnp.int32),
                                                      lens, active, ml, c, key),
                             {"serving": eng.serving}),
        "draft": (eng.propose_jit, lambda c: (eng.t_state, eng.d_state, x0, lens, c, key),
                  {"serving": eng.serving, "draft_head": eng.draft_head}),
    }
    return progs, caches


def profile_batch(engines: dict, b: int, t: int, context: int, reps: int, trace_reps: int, trace_root: str,
                  vocab: int):
    """{variant: {program: result}}: every variant's three programs compiled, timed interleaved
    (variant by variant, program by program, `reps` rounds), then traced one by one."""
    import jax

    progs, caches, compiled = {}, {}, {}
    for v, eng in engines.items():
        progs[v], caches[v] = programs(eng, b, t, context)
        for name, (fn, args, kw) in progs[v].items():
            t0 = time.perf_counter()
            compiled[v, name] = fn.lower(*args(caches[v]), **kw).compile()
            print(f"  batch {b} {v}: compiled {name} in {time.perf_counter() - t0:.1f} s", flush=True)

    def call(v, name):
        fn, args, kw = progs[v][name]
        out = compiled[v, name](*args(caches[v]), **kw)
        caches[v] = out[-1]
        jax.block_until_ready(out)

    for key in compiled:   # warm
        call(*key)
    times = collections.defaultdict(list)
    for _ in range(reps):    # interleaved
        for key in compiled:
            t0 = time.perf_counter()
            call(*key)
            times[key].append(time.perf_counter() - t0)
    result = collections.defaultdict(dict)
    for (v, name) in compiled:
        hlo = compiled[v, name].as_text()
        module = re.match(r"HloModule (\S+?),", hlo).group(1)
        instrs, comps, stacks, entry = parse_hlo(hlo)
        groups = classify(instrs, comps, stacks, vocab, entry)
        tdir = os.path.join(trace_root, f"b{b}_{v}_{re.sub(r'[^a-z0-9]', '', name)}")
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        jax.profiler.start_trace(tdir, create_perfetto_trace=True, profiler_options=opts)
        for _ in range(trace_reps):
            call(v, name)
        jax.profiler.stop_trace()
        excl, runs = trace_op_times(tdir, module)
        per_group = collections.Counter()
        unknown = 0.0
        for op, us in excl.items():
            g = groups.get(op)
            if g is None:
                unknown += us
                g = "other"
            per_group[g] += us / runs / 1e3
        wall = 1e3 * statistics.median(times[v, name])
        op_ms = sum(per_group.values())
        top = sorted(excl.items(), key=lambda kv: -kv[1])[:12]
        result[v][name] = {
            "wall_ms": wall, "wall_ms_all": [1e3 * x for x in times[v, name]],
            "op_ms": op_ms, "runtime_ms": max(wall - op_ms, 0.0),
            "groups_ms": {g: per_group.get(g, 0.0) for g in GROUPS},
            "top_ops": [{"op": op, "group": groups.get(op, "?"), "ms": us / runs / 1e3,
                         "shape": instrs[op].shape if op in instrs else "?"} for op, us in top],
            "trace_runs": runs, "unmapped_ms": unknown / runs / 1e3, "trace_dir": tdir,
        }
    return dict(result)


def format_table(results: dict) -> str:
    lines = []
    for (b, v), res in ((bv, r) for b_, per in results.items() for bv, r in
                        (((b_, v_), r_) for v_, r_ in per.items())):
        names = list(res)
        lines.append(f"\n**batch {b}, {v}** (ms per call; % of the program's wall time)\n")
        lines.append("| group | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for g in GROUPS + ("runtime",):
            cells = []
            for n in names:
                ms = res[n]["runtime_ms"] if g == "runtime" else res[n]["groups_ms"][g]
                cells.append(f"{ms:.2f} ({100 * ms / res[n]['wall_ms']:.0f}%)")
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append("| **wall (median)** | " + " | ".join(f"**{res[n]['wall_ms']:.2f}**" for n in names) + " |")
        s1 = res["step(1)"]["wall_ms"]
        ver = [n for n in names if n.startswith("verify")][0]
        lines.append(f"\nbatch {b}, {v}: {ver}/step(1) = {res[ver]['wall_ms'] / s1:.2f}, "
                     f"draft/step(1) = {res['draft']['wall_ms'] / s1:.2f}")
    return "\n".join(lines)


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags_ = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
    model = re.search(r"^model name\s*:(.*)$", text, re.M)
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    have = [f for f in wanted if f in flags_]
    missing = [f for f in wanted if f not in flags_]
    return (f"{model.group(1).strip() if model else '?'}, {os.cpu_count()} cores; has {' '.join(have)}; "
            f"lacks {' '.join(missing) or 'nothing'}")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from dspark_jax import load_target
    from dspark_jax.decode.engine import Engine
    from dspark_jax.decode.config import EngineConfig
    from dspark_jax.serving.pair import load_draft_spec

    pair_flags.require_one_device("benchmarks.profile_steps")
    target = load_target(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
    draft = load_draft_spec(_DRAFT.value, target)
    vocab = target.cfg.vocab_size
    info = {"cpu": cpu_flags(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
            "model": _MODEL.value, "draft": _DRAFT.value, "context": _CONTEXT.value, "reps": _REPS.value}
    print(f"CPU: {info['cpu']}\nXLA_FLAGS={info['XLA_FLAGS']!r}", flush=True)
    root = _TRACE_DIR.value or tempfile.mkdtemp(prefix="profile_steps_")
    results = {}
    for b in [int(x) for x in _BATCHES.value.split(",")]:
        cfg = EngineConfig(num_speculative_tokens=_T.value, page_size=16)
        engines = {v: Engine(target, draft, cfg.replace(kv_cache_dtype="fp32") if v == "fp32_cache" else cfg,
                             serving_layout=(v == "serving"))
                   for v in _VARIANTS.value.split(",")}
        results[b] = profile_batch(engines, b, _T.value, _CONTEXT.value, _REPS.value, _TRACE_REPS.value, root,
                                   vocab)
    ratios = {}
    variants = _VARIANTS.value.split(",")
    if len(variants) > 1:
        base = variants[0]
        for b, per in results.items():
            for v in variants[1:]:
                for n in per[v]:
                    ratios[f"batch {b} {n}: {v}/{base}"] = per[v][n]["wall_ms"] / per[base][n]["wall_ms"]
    table = format_table(results)
    print(table)
    for k, r in ratios.items():
        print(f"{k} = {r:.2f}")
    for b, per in results.items():
        for v, res in per.items():
            for n, r in res.items():
                print(f"\nbatch {b} {v} {n}: top ops " + ", ".join(f"{o['op']}[{o['group']}] {o['ms']:.2f}"
                                                                  for o in r["top_ops"][:8]))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps({"info": info, "results": results, "ratios": ratios, "table": table},
                                                indent=2))


if __name__ == "__main__":
    app.run(main)
