"""The speed of the real thing on a GPU: kernels, steps and end-to-end decoding in one command.

    pip install -e '.[cuda]'                         # or '.[rocm]'; torch + transformers for the torch stage
    scripts/gpu_bench.sh OUT [flags]                 # = python3 -m benchmarks.gpu_bench --out OUT [flags]
    scripts/gpu_bench.sh OUT --stages kernels,crossover --budget_s 300

Stages, in this order (`--stages` picks; each runs in its own process with its own time limit, so a
failure or a hang costs that stage only, and every stage fits in what is left of `--budget_s`):

  kernels     every Pallas kernel against its reference with the Triton lowering, timed
              (benchmarks.gpu_kernel_check, one process per kernel group)
  crossover   the paged MLA decode kernel against its reference over spans of 1k-64k keys: the
              measured crossover for `auto` (gpu_kernel_check --crossover)
  steps_demo  one-token step, verify of T+1 tokens and the draft's block pass, batch 1/8/32, bf16,
              kernels `auto` and `off`: SmolLM2-135M built from its config with random weights and
              the shipped demo draft (dspark_jax.bench.steps_timing.step_costs)
  steps_k3    the same for a K3-width slice: Kimi-K3's first 4 layers at full width (hidden 7168,
              MLA 96 heads with 512 + 64 latent rows, 3 KDA layers of 96 x 128, 1 dense MLP and
              3 MoE layers of 896 MXFP4 experts, top-16, latent 3584 x 3072, 2 shared experts; the
              163840-row embedding and lm_head) and the full-width 5-layer draft (64 heads, 7168
              hidden, Markov rank 256), random weights drawn on the device, pages of 128
  demo        plain vs speculative generate() on the demo pair's real weights (the `smollm2-135m`
              preset, installed and converted on first use, or --demo_target; the shipped draft),
              GSM8K test prompts from the data registry with the chat template, temperature 0, 128 new
              tokens, batch 1, bf16 (benchmarks.peers' protocol)
  torch       transformers' LlamaForCausalLM.generate on the same weights, prompt ids and GPU;
              skipped, with the reason recorded, when torch has no CUDA device

At the end it prints the tables and the goals (GOALS), and writes OUT/results.json, OUT/table.md
and OUT/bench.log (everything printed, stages' output included). Results of earlier runs with the
same --state_dir are merged in, marked as such, so the stages can be run in separate commands.

Without a GPU the model stages say so and are skipped; `--tiny` runs every stage on tiny shapes
(interpret-mode kernels, tiny configs) to test the script on a CPU.

One file although it is over 450 lines: the driver, the stage workers it starts and the tables
read and write the same stage records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from importlib import metadata
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "dspark_jax" / "configs"
STAGES = ("kernels", "crossover", "steps_demo", "steps_k3", "demo", "torch")
# seconds each stage may take at most (the rest of --budget_s permitting); --stage_timeouts overrides
STAGE_TIMEOUTS = {"kernels": 240, "crossover": 150, "steps_demo": 150, "steps_k3": 240, "demo": 200, "torch": 120}
KERNEL_GROUPS = ("mla_paged", "mla_prefill", "kda", "block_sparse")
# what the GPU run should show: speculative decoding's speed-up, our plain decoding against
# transformers', and the cost of a verify of T+1 tokens against a one-token step
GOALS = {"speculative_over_plain": 2.0, "ours_over_torch": 0.8, "verify_over_step": 1.3}

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "output folder: results.json, table.md, bench.log (required)")
flags.DEFINE_list("stages", list(STAGES), f"stages to run, from {', '.join(STAGES)}")
flags.DEFINE_float("budget_s", 1200.0, "total seconds for every stage together")
flags.DEFINE_list("stage_timeouts", [], f"STAGE=SECONDS overrides of the per-stage limits (defaults {STAGE_TIMEOUTS})")
flags.DEFINE_float("min_stage_s", 30.0, "do not start a stage with less time than this left")
flags.DEFINE_string("state_dir", str(ROOT / "runs" / "gpu_bench"), "results of earlier runs and the compilation "
                    "cache")
flags.DEFINE_bool("compile_cache", True, "JAX's persistent compilation cache in STATE/jax_cache (reruns on the "
                  "same host skip compiles)")
flags.DEFINE_bool("tiny", False, "tiny shapes everywhere (kernels in interpret mode): a CPU test of the script, "
                  "timings meaningless")
# not pair_flags: the driver imports no JAX (its stages run in processes of their own)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "model dtype")
flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per step (verify = T+1 tokens)")
flags.DEFINE_list("kernel_groups", list(KERNEL_GROUPS), "kernel groups of the kernels stage")
flags.DEFINE_string("kernel_match", "", "only kernel cases whose name contains this")
flags.DEFINE_integer("kernel_iters", 10, "timed calls per kernel and reference")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "batch sizes of the step timings")
flags.DEFINE_list("step_modes", ["auto", "off"], "kernel modes of the step timings, in order")
flags.DEFINE_integer("step_reps", 10, "timed repetitions of each step (after its compile)")
flags.DEFINE_integer("step_context", 100, "tokens in the cache when a step is timed")
flags.DEFINE_string("demo_config", str(CONFIGS / "smollm2-135m.json"), "steps_demo: the target's config.json")
flags.DEFINE_integer("k3_layers", 4, "steps_k3: Kimi-K3's first N layers (>= 4: 3 KDA + 1 MLA)")
flags.DEFINE_string("demo_target", "smollm2-135m", "demo/torch: an HF-layout target directory or a preset "
                    "(installed and converted on first use)")
flags.DEFINE_string("demo_draft", "smollm2-135m-dspark", "demo and steps_demo: the draft (directory or preset)")
flags.DEFINE_integer("num_prompts", 8, "demo/torch: the first N GSM8K test prompts")
flags.DEFINE_integer("max_new_tokens", 128, "demo/torch: new tokens per prompt (fewer at EOS)")
flags.DEFINE_integer("rounds", 2, "demo/torch: timed rounds over the prompts (best of rounds)")
flags.DEFINE_string("torch_device", "cuda", "torch: the device (`cpu` only for tests)")
flags.DEFINE_string("worker", None, "internal: run this one stage (the driver starts one process per stage)")
flags.DEFINE_string("result", None, "internal: the worker's result file")


class _Args:
    """The flags' values as attributes; their defaults until the command line is parsed (the
    functions tests call read them unparsed)."""

    def __getattr__(self, name: str):
        return FLAGS[name].value


ARGS = _Args()


class Skip(Exception):
    """A stage that cannot run here; the message says why (recorded, not an error)."""


def _state_dir() -> Path:
    return Path(ARGS.state_dir)


def write_json(path: Path, data) -> None:
    """Atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# the K3-width slice


def k3_slice(layers: int = 4, tiny: bool = False) -> tuple[dict, dict]:
    """(target config, draft config) dicts: Kimi-K3's first `layers` layers as configured in
    dspark_jax/configs/kimi-k3.json (layer 1 dense, the rest MoE; KDA and MLA as in K3: MLA at
    every 4th), and the K3 DSpark draft at full width reading `layers`' hidden states
    (its 5 aux layer ids spread over them). `tiny`: the same structure at test widths."""
    raw = json.loads((CONFIGS / "kimi-k3.json").read_text())
    text = raw["text_config"]
    la = text["linear_attn_config"]
    la["kda_layers"] = [i for i in la["kda_layers"] if i <= layers]
    la["full_attn_layers"] = [i for i in la["full_attn_layers"] if i <= layers]
    if not la["kda_layers"] or not la["full_attn_layers"]:
        raise ValueError(f"k3 slice of {layers} layers: needs >= 4 for a KDA and an MLA layer")
    text["num_hidden_layers"] = layers
    draft = json.loads((CONFIGS / "kimi-k3-dspark.json").read_text())
    n_aux = len(draft["target_layer_ids"])
    draft["target_num_hidden_layers"] = layers
    draft["target_layer_ids"] = [round(i * (layers - 1) / (n_aux - 1)) for i in range(n_aux)]
    if tiny:
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        raw.update(ids)
        text.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_experts=8, num_experts_per_token=2,
                    moe_intermediate_size=32, routed_expert_hidden_size=32, num_attention_heads=2,
                    num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, **ids)
        la.update(num_heads=2, head_dim=16)
        draft.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=16, v_head_dim=16, vocab_size=256, draft_vocab_size=256,
                     target_hidden_size=64, markov_rank=8, mask_token_id=255, **ids)
    return raw, draft


def _nbytes(model) -> int:
    import jax
    from flax import nnx
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


# ---------------------------------------------------------------------------------------------
# stage workers (one process each; `emit(data)` saves what is measured so far)


def _backend(allow_cpu: bool = False) -> dict:
    import jax
    backend = jax.default_backend()
    info = {"backend": backend, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(f"devices: {jax.devices()}", flush=True)
    if backend not in ("gpu", "cuda", "rocm") and not (allow_cpu or ARGS.tiny):
        raise Skip(f"no GPU (JAX backend {backend}); --tiny runs the stage on tiny shapes")
    return info


def worker_steps(which: str, emit) -> None:
    import jax.numpy as jnp

    from dspark_jax.bench import steps_timing as st
    from dspark_jax.kernels.dispatch import use_kernels

    data = _backend()
    dtype = jnp.dtype(ARGS.dtype)
    t0 = time.perf_counter()
    if which == "demo":
        from dspark_jax.serving.pair import load_draft_spec
        target = st.random_target(ARGS.demo_config, dtype)
        draft = load_draft_spec(ARGS.demo_draft, target)
        page = 16
        data["model"] = (f"{Path(ARGS.demo_config).name} (random weights) + draft {ARGS.demo_draft}")
    else:
        from dspark_jax.config.draft import DraftConfig
        from dspark_jax.config.kimi import KimiConfig
        from dspark_jax.models.dspark import K3DSparkModel
        raw_t, raw_d = k3_slice(ARGS.k3_layers, ARGS.tiny)
        tcfg, dcfg = KimiConfig.from_dict(raw_t, where="k3 slice"), DraftConfig.from_dict(raw_d, where="k3 draft")
        target = st.random_target(tcfg, dtype, on_device=True)
        draft = st.random_weights(lambda rngs: K3DSparkModel(dcfg, dtype=dtype, rngs=rngs), on_device=True)
        page = 16 if ARGS.tiny else 128
        data["model"] = (f"K3 slice: {tcfg.num_hidden_layers} layers ({len(tcfg.kda_layers)} KDA + "
                         f"{len(tcfg.full_attn_layers)} MLA; {tcfg.first_k_dense_replace} dense + "
                         f"{tcfg.num_hidden_layers - tcfg.first_k_dense_replace} MoE of {tcfg.num_experts} experts, "
                         f"top {tcfg.num_experts_per_token}), hidden {tcfg.hidden_size}, "
                         f"{tcfg.num_attention_heads} heads; draft {dcfg.num_hidden_layers} layers, "
                         f"{dcfg.num_attention_heads} heads (random weights)")
        data["configs"] = {"target": raw_t, "draft": raw_d}
    data.update(setup_s=time.perf_counter() - t0, target_bytes=_nbytes(target), draft_bytes=_nbytes(draft),
                dtype=ARGS.dtype, page_size=page, context=ARGS.step_context, T=ARGS.num_speculative_tokens,
                reps=ARGS.step_reps, rows=[])
    print(f"{data['model']}: target {data['target_bytes'] / 2**30:.2f} GiB, draft {data['draft_bytes'] / 2**30:.2f} "
          f"GiB, ready in {data['setup_s']:.1f} s", flush=True)
    emit(data)
    errors = []
    for mode in ARGS.step_modes:
        for b in [int(x) for x in ARGS.batch_sizes]:
            t1 = time.perf_counter()
            try:
                with use_kernels(mode):
                    eng = st.make_engine(target, draft, ARGS.num_speculative_tokens, page_size=page)
                    c = st.step_costs(eng, b, reps=ARGS.step_reps, context=ARGS.step_context)
            except Exception as e:      # e.g. out of memory at batch 32: the other settings still run
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                data["rows"].append({"kernels": mode, "batch": b, "error": msg})
                errors.append(f"kernels {mode} batch {b}: {msg}")
                print(f"kernels {mode} batch {b}: FAILED {msg}", flush=True)
                emit(data)
                continue
            row = {"kernels": mode, "batch": b, "one_token_step_ms": c["one_token_step_ms"],
                   "verify_ms": c["verify_ms"], "draft_block_ms": c["draft_block_ms"],
                   "verify_over_step": c["verify_ms"] / c["one_token_step_ms"],
                   "break_even_tok_per_fwd": c["break_even"], "draft_share": c["draft_share"],
                   "wall_s": time.perf_counter() - t1}
            data["rows"].append(row)
            emit(data)
            print(f"kernels {mode} batch {b}: one-token step {row['one_token_step_ms']:.3f} ms | verify(T+1) "
                  f"{row['verify_ms']:.3f} ms ({row['verify_over_step']:.2f}x) | draft pass "
                  f"{row['draft_block_ms']:.3f} ms | break-even tok/fwd {row['break_even_tok_per_fwd']:.2f}",
                  flush=True)
    if errors:
        raise RuntimeError("; ".join(errors))


def _demo_target() -> Path:
    """The demo target's directory: --demo_target, a directory or a preset resolved (installed and
    converted on first use)."""
    from dspark_jax.presets import resolve_model_path
    try:
        return resolve_model_path(ARGS.demo_target)
    except (OSError, RuntimeError) as e:
        raise Skip(f"demo target {ARGS.demo_target!r} not available: {e}") from None


def _prompts(target_dir: Path):
    """(token ids of the first --num_prompts GSM8K test questions with the chat template, eos ids)."""
    from dspark_jax.data.eval_sets import load_gsm8k
    from dspark_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(target_dir)
    ids = [tok.encode(tok.apply_chat_template(it.conversation(), add_generation_prompt=True))
           for it in load_gsm8k(limit=ARGS.num_prompts)]
    cfg = json.loads((target_dir / "config.json").read_text())
    eos = set(tok.eos_token_ids) | ({int(cfg["eos_token_id"])} if cfg.get("eos_token_id") is not None else set())
    eos = sorted(eos)
    return ids, eos, tok


def _traced(systems, data: dict, emit) -> list:
    """The systems with every run recorded in data["runs"] as it ends, so a stage stopped at its
    time limit still shows tokens/s from the runs it finished (`partial_speeds`)."""
    data.setdefault("runs", [])
    out = []
    for s in systems:
        if s.run is None:
            out.append(s)
            continue

        def run(ids, n, s=s, inner=s.run):
            before = s.compiles() if s.compiles else 0
            t0 = time.perf_counter()
            tokens = inner(ids, n)
            data["runs"].append({"system": s.key, "prompt_tokens": len(ids), "max_new_tokens": n,
                                 "new_tokens": len(tokens), "seconds": time.perf_counter() - t0,
                                 "compiled": (s.compiles() if s.compiles else 0) != before})
            emit(data)
            return tokens
        out.append(dataclasses.replace(s, run=run))
    return out


def partial_speeds(data: dict) -> dict[str, tuple[float, int]]:
    """system -> (tokens/s, runs) over the finished full-length runs that compiled nothing."""
    acc: dict[str, list[float]] = {}
    for r in data.get("runs", []):
        if r["max_new_tokens"] == data.get("max_new_tokens") and not r["compiled"] and r["seconds"] > 0:
            a = acc.setdefault(r["system"], [0, 0.0, 0])
            a[0] += r["new_tokens"]
            a[1] += r["seconds"]
            a[2] += 1
    return {k: (tok / sec, n) for k, (tok, sec, n) in acc.items()}


def worker_demo(emit) -> None:
    from dspark_jax.bench import peers

    data = _backend()
    target_dir = _demo_target()
    ids, eos, tok = _prompts(target_dir)
    dt = ARGS.dtype
    data.update(target=str(target_dir), draft=ARGS.demo_draft, dtype=dt, T=ARGS.num_speculative_tokens,
                max_new_tokens=ARGS.max_new_tokens, rounds=ARGS.rounds, prompts=len(ids),
                prompt_tokens=[len(p) for p in ids])
    print(f"{len(ids)} GSM8K test prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens), "
          f"{ARGS.max_new_tokens} new tokens, temperature 0, batch 1, {dt}", flush=True)
    emit(data)
    systems = peers.ours_systems(str(target_dir), ARGS.demo_draft, [dt], {"ours_plain", "ours_spec"},
                                 ARGS.num_speculative_tokens, tok)
    records = peers.measure(_traced(systems, data, emit), ids, ARGS.max_new_tokens, ARGS.rounds,
                            log=lambda m: print(m, flush=True))
    rows = peers.summarize(systems, records, baseline=f"ours_plain:{dt}")
    plain, spec = (next(r for r in rows if r["system"] == f"{k}:{dt}") for k in ("ours_plain", "ours_spec"))
    data.update(rows=rows, plain_tokens_per_s=plain["tokens_per_s_best"],
                speculative_tokens_per_s=spec["tokens_per_s_best"],
                speculative_over_plain=spec["tokens_per_s_best"] / plain["tokens_per_s_best"],
                tok_per_fwd=spec.get("tok_per_fwd"),
                speculative_equals_plain=f"{spec.get('identical_to_reference')}/{spec.get('compared_prompts')}")
    emit(data)
    # what the torch stage compares with: the same prompt ids, our plain outputs and speed
    ours = {r.prompt: r.tokens for r in records if r.system == f"ours_plain:{dt}" and r.round == 0}
    write_json(_state_dir() / "demo_plain.json",
               {"target": str(target_dir), "dtype": dt, "max_new_tokens": ARGS.max_new_tokens, "prompt_ids": ids,
                "eos": eos, "tokens": [ours[p] for p in sorted(ours)], "tokens_per_s": plain["tokens_per_s_best"]})
    print(f"plain {plain['tokens_per_s_best']:.1f} tok/s | speculative {spec['tokens_per_s_best']:.1f} tok/s | "
          f"ratio {data['speculative_over_plain']:.2f}x | tok/fwd {data['tok_per_fwd']:.2f} | speculative == plain "
          f"on {data['speculative_equals_plain']} prompts", flush=True)


def _hf_run(torch, model, eos, device):
    def run(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, num_beams=1,
                               eos_token_id=list(eos), pad_token_id=eos[0])
        return y[0, len(ids):].tolist()          # .tolist() waits for the device
    return run


def worker_torch(emit) -> None:
    from dspark_jax.bench import peers

    try:
        import torch
        import transformers
    except ImportError as e:
        raise Skip(f"torch / transformers not importable ({e})") from None
    device = ARGS.torch_device
    data = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise Skip(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
        data["device_name"] = torch.cuda.get_device_name(0)
    target_dir = _demo_target()
    dt = ARGS.dtype
    saved = _state_dir() / "demo_plain.json"
    ours = json.loads(saved.read_text()) if saved.is_file() else None
    same_setting = (str(target_dir), dt, ARGS.max_new_tokens)
    if ours is not None and (ours["target"], ours["dtype"], ours["max_new_tokens"]) != same_setting:
        ours = None
    if ours is not None and len(ours["prompt_ids"]) >= ARGS.num_prompts:
        ids, eos = ours["prompt_ids"][:ARGS.num_prompts], ours["eos"]
    else:
        ids, eos, _ = _prompts(target_dir)
        ours = None
        print("no plain-decoding results of the demo stage with these settings: torch timed alone", flush=True)
    data.update(target=str(target_dir), dtype=dt, max_new_tokens=ARGS.max_new_tokens, rounds=ARGS.rounds,
                prompts=len(ids))
    emit(data)
    t0 = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dt),
                                                          local_files_only=True).to(device).eval()
    print(f"transformers {transformers.__version__} / torch {torch.__version__} on {device}: loaded in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    system = peers.System(f"hf_greedy:{dt}", "transformers, greedy generate", dt, _hf_run(torch, model, eos, device))
    records = peers.measure(_traced([system], data, emit), ids, ARGS.max_new_tokens, ARGS.rounds,
                            log=lambda m: print(m, flush=True))
    row = peers.summarize([system], records, baseline=system.key)[0]
    data.update(row=row, torch_tokens_per_s=row["tokens_per_s_best"])
    if ours is not None:
        theirs = {r.prompt: r.tokens for r in records if r.round == 0}
        same = sum(theirs[p] == ours["tokens"][p] for p in theirs)
        prefix = [peers.common_prefix(theirs[p], ours["tokens"][p]) for p in sorted(theirs)]
        data.update(ours_plain_tokens_per_s=ours["tokens_per_s"],
                    ours_over_torch=ours["tokens_per_s"] / row["tokens_per_s_best"],
                    identical_to_ours=f"{same}/{len(theirs)}", matching_prefix_tokens=prefix)
    emit(data)
    print(f"torch {row['tokens_per_s_best']:.1f} tok/s" + (
        f" | ours plain {data['ours_plain_tokens_per_s']:.1f} tok/s ({data['ours_over_torch']:.2f}x) | greedy "
        f"outputs identical on {data['identical_to_ours']} prompts" if ours is not None else ""), flush=True)


def run_worker(stage: str) -> int:
    result = Path(ARGS.result)
    state = {"data": {}}

    def emit(data):
        state["data"] = data
        write_json(result, {"status": "running", "data": data})

    try:
        {"steps_demo": lambda: worker_steps("demo", emit), "steps_k3": lambda: worker_steps("k3", emit),
         "demo": lambda: worker_demo(emit), "torch": lambda: worker_torch(emit)}[stage]()
    except Skip as e:
        print(f"skipped: {e}", flush=True)
        write_json(result, {"status": "skipped", "reason": str(e), "data": state["data"]})
        return 0
    except Exception as e:             # recorded with what was measured before it
        traceback.print_exc()
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
        write_json(result, {"status": "error", "reason": reason, "data": state["data"]})
        return 1
    write_json(result, {"status": "ok", "data": state["data"]})
    return 0


# ---------------------------------------------------------------------------------------------
# the driver: stages as processes within the budget, then the tables


_NOISE = re.compile(r"Unable to initialize backend 'tpu'|xla_bridge\.py:\d+\] (Unable|Platform)")


class Log:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, line: str, echo: bool = True) -> None:
        with self.lock:
            self.f.write(line + "\n")
            if echo:
                print(line, flush=True)


def run_process(argv: list[str], timeout: float, log: Log, prefix: str, env: dict) -> tuple[int | None, list[str]]:
    """Run argv in its own process group, streaming its output; kill it (the whole group) after
    `timeout` s. Returns (exit status or None on timeout, the last output lines)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-40]
            log(f"{prefix} {line}", echo=not _NOISE.search(line))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = None
    reader.join(timeout=5)
    return rc, tail


def _common_flags() -> list[str]:
    """The flags a worker needs (the driver's own values)."""
    names = ["state_dir", "tiny", "dtype", "num_speculative_tokens", "batch_sizes", "step_modes",
             "step_reps", "step_context", "demo_config", "k3_layers", "demo_target", "demo_draft", "num_prompts",
             "max_new_tokens", "rounds", "torch_device"]
    out = []
    for name in names:
        value = getattr(ARGS, name)
        if value is None or value is False:
            continue
        if value is True:
            out.append(f"--{name}")
        elif isinstance(value, list):
            out.append(f"--{name}={','.join(str(x) for x in value)}")
        else:
            out.append(f"--{name}={value}")
    return out


def stage_jobs(stage: str, tmp: Path) -> list[tuple[str, list[str], Path]]:
    """(label, argv, result file) of the processes a stage runs."""
    py = [sys.executable, "-m"]
    tiny = ["--tiny", "--nolower"] if ARGS.tiny else []
    if stage == "kernels":
        return [(g, py + ["benchmarks.gpu_kernel_check", "--only", g, "--iters", str(ARGS.kernel_iters),
                          f"--match={ARGS.kernel_match}", "--output_json", str(tmp / f"kernels-{g}.json")] + tiny,
                 tmp / f"kernels-{g}.json") for g in ARGS.kernel_groups]
    if stage == "crossover":
        return [("crossover", py + ["benchmarks.gpu_kernel_check", "--only", "none", "--crossover", "--iters",
                                    str(ARGS.kernel_iters), "--output_json", str(tmp / "crossover.json")] + tiny,
                 tmp / "crossover.json")]
    return [(stage, py + ["benchmarks.gpu_bench", "--worker", stage, "--result", str(tmp / f"{stage}.json")]
             + _common_flags(), tmp / f"{stage}.json")]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_stage(stage: str, deadline: float, cap: float, log: Log, env: dict, tmp: Path) -> dict:
    """Run a stage's processes one after another within `cap` s (and before `deadline`): each of
    n processes still to run may take 1/n of the time left (at least a minute, if left), so a
    hang costs its own share; the record merges their results."""
    t0 = time.time()
    rec = {"stage": stage, "run_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    jobs = stage_jobs(stage, tmp)
    stage_end = min(deadline, t0 + cap)
    parts, statuses = {}, []
    for i, (label, argv, result) in enumerate(jobs):
        left = stage_end - time.time()
        if left < 1:
            parts[label] = {"status": "timeout", "reason": "no time left in the stage's budget"}
            statuses.append("timeout")
            log(f"[{stage}] {label}: not run, no time left")
            continue
        share = max(left / (len(jobs) - i), min(left, 60.0))
        result.unlink(missing_ok=True)
        rc, tail = run_process(argv, share, log, f"[{stage}{'' if label == stage else ':' + label}]", env)
        out = _read(result) or {}
        if stage in ("kernels", "crossover"):       # gpu_kernel_check's own JSON (exit 1: a mismatch)
            out = {"status": "ok" if rc == 0 else ("timeout" if rc is None else "error"), "data": out}
        elif rc is None:
            out["status"] = "timeout"
        elif rc != 0:
            out["status"] = "error"
        out.setdefault("status", "error")
        if out["status"] in ("error", "timeout"):
            out["rc"] = rc
            out["log_tail"] = tail[-15:]
        parts[label] = out
        statuses.append(out["status"])
        log(f"[{stage}] {label}: {out['status']}" + (f" ({out['reason']})" if out.get("reason") else ""))
    if stage != "kernels":                         # one process
        rec.update(parts[jobs[0][0]])
    else:
        rec["groups"] = parts
        rec["status"] = next((s for s in ("error", "timeout", "ok") if s in statuses), "skipped")
    rec["wall_s"] = time.time() - t0
    return rec


def machine_info() -> dict:
    info = {"python": sys.version.split()[0]}
    for dist in ("jax", "jaxlib", "flax", "torch", "transformers", "triton"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["gpu"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    return info


# ---------------------------------------------------------------------------------------------
# tables and goals


def _f(x, fmt=".3f", none="n/a") -> str:
    return none if x is None else format(x, fmt)


def goals(results: dict) -> list[dict]:
    """The goals (GOALS), each with the measured value (None: not measured)."""
    out = []
    demo = (results.get("demo") or {}).get("data") or {}
    out.append({"id": "speculative_over_plain",
                "goal": f"speculative >= {GOALS['speculative_over_plain']}x plain tok/s, demo pair, batch 1",
                "value": demo.get("speculative_over_plain"), "ok": None if demo.get("speculative_over_plain") is None
                else demo["speculative_over_plain"] >= GOALS["speculative_over_plain"]})
    torch_ = (results.get("torch") or {}).get("data") or {}
    v = torch_.get("ours_over_torch")
    out.append({"id": "ours_over_torch",
                "goal": f"our plain decoding >= {GOALS['ours_over_torch']}x transformers' (same weights, GPU)",
                "value": v, "ok": None if v is None else v >= GOALS["ours_over_torch"]})
    for stage in ("steps_demo", "steps_k3"):
        rows = [r for r in ((results.get(stage) or {}).get("data") or {}).get("rows", [])
                if r["kernels"] == "auto" and "error" not in r]
        v = max((r["verify_over_step"] for r in rows), default=None)
        out.append({"id": f"verify_over_step_{stage[6:]}",
                    "goal": f"verify(T+1) <= {GOALS['verify_over_step']}x one-token step ({stage}, kernels auto, "
                            f"worst batch of {','.join(str(r['batch']) for r in rows) or 'none'})",
                    "value": v, "ok": None if v is None else v <= GOALS["verify_over_step"]})
    xo = ((results.get("crossover") or {}).get("data") or {}).get("crossover") or {}
    v = xo.get("auto_worst_ratio_current")
    out.append({"id": "paged_mla_auto", "goal": "paged MLA under `auto` never slower than its reference at any "
                "measured span",
                "value": v, "ok": xo.get("auto_never_slower_current")})
    kernels = _kernel_cases(results)
    other = [c for c in kernels if c["group"] != "mla_paged" and c.get("ratio") is not None]
    v = max((c["ratio"] for c in other), default=None)
    out.append({"id": "other_kernels", "goal": "the other kernels (always on under `auto`) never slower than their "
                "references",
                "value": v, "ok": None if v is None else v <= 1.0})
    return out


def _kernel_cases(results: dict) -> list[dict]:
    rec = results.get("kernels") or {}
    groups = rec.get("groups") or {}
    return [c for g in groups.values() for c in ((g.get("data") or {}).get("cases") or [])]


def tables(results: dict, info: dict) -> str:
    lines = [f"# GPU benchmark ({info.get('gpu') or 'no GPU found by nvidia-smi'}; jax {info.get('jax')}, "
             f"torch {info.get('torch')}, transformers {info.get('transformers')})", ""]
    lines += ["| stage | status | when | wall s | note |", "|---|---|---|---:|---|"]
    for stage in STAGES:
        rec = results.get(stage)
        if rec is None:
            continue
        note = rec.get("reason") or ""
        if not note and rec.get("status") in ("error", "timeout") and rec.get("log_tail"):
            note = rec["log_tail"][-1]
        note = ("(earlier run) " if rec.get("earlier") else "") + note[:160].replace("|", "/")
        lines.append(f"| {stage} | {rec.get('status')} | {rec.get('run_at', '')} | {_f(rec.get('wall_s'), '.0f')} | "
                     f"{note.strip()} |")
    cases = _kernel_cases(results)
    if cases:
        lines += ["", "## Kernels vs references", "", "| group | case | match | kernel ms | reference ms | ratio |",
                  "|---|---|---|---:|---:|---:|"]
        for c in cases:
            match = f"{'ok' if c.get('ok') else 'FAIL'} ({_f(c.get('err'), '.1e')})"
            lines.append(f"| {c['group']} | {c['name']} | {match} "
                         f"| {_f(c.get('kernel_ms'))} | {_f(c.get('reference_ms'))} | {_f(c.get('ratio'))} |")
    xo = ((results.get("crossover") or {}).get("data") or {}).get("crossover")
    if xo:
        lines += ["", "## Paged MLA decode: kernel vs reference by span (keys per sequence)", "",
                  "| shape | span | kernel ms | reference ms | ratio | auto runs |", "|---|---:|---:|---:|---:|---|"]
        for p in xo.get("points", []):
            lines.append(f"| {p['shape']} | {p['span']} | {_f(p.get('kernel_ms'))} | {_f(p.get('reference_ms'))} | "
                         f"{_f(p.get('ratio'))} | {p.get('auto', '')} |")
        if "recommended_min_keys" in xo:
            lines += ["", f"measured crossover: {xo.get('measured_crossover') or 'none'}; recommended "
                          f"DSPARK_MLA_PAGED_MIN_KEYS={xo['recommended_min_keys']} (current "
                          f"{xo['current_min_keys']}); `auto` with the current value: worst "
                          f"{_f(xo.get('auto_worst_ratio_current'))} x the reference"
                          + ("" if xo.get("timings_meaningful", True) else " (interpret mode: timings meaningless)")]
    for stage, title in (("steps_demo", "Steps: demo pair widths"), ("steps_k3", "Steps: K3-width slice")):
        data = (results.get(stage) or {}).get("data") or {}
        if data.get("rows"):
            lines += ["", f"## {title}: {data.get('model')}, {data.get('dtype')}, context {data.get('context')}, "
                          f"T={data.get('T')}", "",
                      "| kernels | batch | one-token step ms | verify(T+1) ms | verify / step | draft pass ms | "
                      "break-even tok/fwd |", "|---|---:|---:|---:|---:|---:|---:|"]
            for r in data["rows"]:
                if "error" in r:
                    lines.append(f"| {r['kernels']} | {r['batch']} | error: {r['error'][:100]} | | | | |")
                    continue
                lines.append(f"| {r['kernels']} | {r['batch']} | {_f(r['one_token_step_ms'])} | {_f(r['verify_ms'])} | "
                             f"{_f(r['verify_over_step'], '.2f')} | {_f(r['draft_block_ms'])} | "
                             f"{_f(r['break_even_tok_per_fwd'], '.2f')} |")
    demo = (results.get("demo") or {}).get("data") or {}
    torch_ = (results.get("torch") or {}).get("data") or {}
    partial = {k: v for d in (demo, torch_) if not (d.get("rows") or d.get("row"))
               for k, v in partial_speeds(d).items()}
    if partial:
        lines += ["", "## Demo pair / torch, partial (the stage stopped before its summary): tok/s over the "
                      "finished runs that compiled nothing", "", "| system | tok/s | runs |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.1f} | {n} |" for k, (v, n) in partial.items()]
    if demo.get("rows") or torch_.get("row"):
        n = demo.get("prompts") or torch_.get("prompts")
        lines += ["", f"## Demo pair, real weights: {n} GSM8K test prompts, batch 1, temperature 0, "
                      f"{demo.get('max_new_tokens') or torch_.get('max_new_tokens')} new tokens, "
                      f"{demo.get('dtype') or torch_.get('dtype')} (tok/s: best of rounds, prefill included)", "",
                  "| system | tok/s | vs ours plain | tok/fwd | greedy output = ours plain |",
                  "|---|---:|---:|---:|---|"]
        for r in demo.get("rows", []):
            if "unavailable" in r:
                continue
            same = (f"{r['identical_to_reference']}/{r['compared_prompts']}" if "identical_to_reference" in r
                    else "(reference)")
            ratio = _f(r.get('ratio_vs_baseline_best'), '.2f')
            lines.append(f"| {r['label']} | {r['tokens_per_s_best']:.1f} | {ratio}x"
                         f" | {_f(r.get('tok_per_fwd'), '.2f', '')} | {same} |")
        if torch_.get("row"):
            r = torch_["row"]
            vs = (1 / torch_["ours_over_torch"]) if torch_.get("ours_over_torch") else None
            lines.append(f"| transformers greedy ({torch_.get('device_name') or torch_.get('device')}) | "
                         f"{r['tokens_per_s_best']:.1f} | {_f(vs, '.2f')}x | | "
                         f"{torch_.get('identical_to_ours', 'n/a')} |")
    g = goals(results)
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---:|---|"]
    for x in g:
        met = "n/a" if x["ok"] is None else ("yes" if x["ok"] else "NO")
        lines.append(f"| {x['goal']} | {_f(x['value'])} | {met} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def _usage(message: str) -> app.UsageError:
    return app.UsageError(message, exitcode=2)       # exit status 2: a command-line mistake


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise _usage(f"unexpected arguments: {argv[1:]}")
    if ARGS.worker:
        if ARGS.worker not in STAGES or not ARGS.result:
            raise _usage("--worker STAGE --result FILE")
        return run_worker(ARGS.worker)
    if not ARGS.out:
        raise _usage("--out OUT is required")
    unknown = [s for s in ARGS.stages if s not in STAGES]
    if unknown:
        raise _usage(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    bad_groups = [g for g in ARGS.kernel_groups if g not in KERNEL_GROUPS]
    if bad_groups:
        raise _usage(f"--kernel_groups: unknown {bad_groups}; choose from {', '.join(KERNEL_GROUPS)}")
    bad_modes = [m for m in ARGS.step_modes if m not in ("auto", "on", "off", "interpret")]
    if bad_modes:
        raise _usage(f"--step_modes: unknown {bad_modes}; choose from auto, on, off, interpret")
    caps = dict(STAGE_TIMEOUTS)
    for item in ARGS.stage_timeouts:
        name, _, sec = item.partition("=")
        if name not in STAGES or not sec:
            raise _usage(f"--stage_timeouts: {item!r}: expected STAGE=SECONDS with STAGE in {', '.join(STAGES)}")
        caps[name] = float(sec)
    start = time.time()
    deadline = start + ARGS.budget_s
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    state = _state_dir()
    tmp = state / "current"
    tmp.mkdir(parents=True, exist_ok=True)
    log = Log(out / "bench.log")
    info = machine_info()
    log(f"gpu_bench: stages {','.join(ARGS.stages)}; budget {ARGS.budget_s:.0f} s; {json.dumps(info)}")

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if ARGS.compile_cache:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(state / "jax_cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    this_run = {}
    for stage in ARGS.stages:
        left = deadline - time.time()
        if left < ARGS.min_stage_s:
            rec = {"stage": stage, "status": "skipped", "reason": f"budget: {left:.0f} s left of --budget_s",
                   "run_at": time.strftime("%Y-%m-%d %H:%M:%S")}
            log(f"== {stage}: skipped ({rec['reason']})")
        else:
            cap = min(caps[stage], left - 5)
            log(f"== {stage} (at most {cap:.0f} s; {left:.0f} s of the budget left)")
            try:
                rec = run_stage(stage, deadline - 5, cap, log, env, tmp)
            except Exception as e:    # the driver itself must survive to write what it has
                rec = {"stage": stage, "status": "error", "reason": f"driver: {type(e).__name__}: {e}"}
            log(f"== {stage}: {rec['status']} in {rec.get('wall_s', 0):.0f} s")
        this_run[stage] = rec

    history_path = state / "history.json"
    history = _read(history_path) or {}
    for stage, rec in this_run.items():
        earlier = history.get(stage)
        # a stage that could not run now keeps an earlier run's result
        if rec["status"] == "skipped" and earlier and earlier.get("status") in ("ok", "timeout"):
            continue
        history[stage] = rec
    write_json(history_path, history)
    results = {s: (r if s in this_run and this_run[s] is r else {**r, "earlier": True}) for s, r in history.items()}
    table = tables(results, info)
    summary = {"machine": info, "budget_s": ARGS.budget_s, "wall_s": time.time() - start,
               "stages_this_run": {s: r["status"] for s, r in this_run.items()}, "results": results,
               "goals": goals(results)}
    write_json(out / "results.json", summary)
    (out / "table.md").write_text(table)
    log("\n" + table)
    log(f"gpu_bench: done in {time.time() - start:.0f} s; {out}/results.json, {out}/table.md, {out}/bench.log")
    failed = [s for s, r in this_run.items() if r["status"] in ("error", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(main)
