"""tests/ mirrors the package: every dspark_jax module with logic of its own (a function or a
method) has a test module named after it (`dspark_jax/x/foo.py` -> `tests/test_foo.py`), or an
entry below saying where it is tested and why it has no module of its own. An entry goes when its
module gets a test module; a new module without one fails here until it gets one or an entry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dspark_jax"

# module (path under dspark_jax/) -> where it is tested instead
UNTESTED_BY_NAME = {
    "bench/crossover.py": "arithmetic of the GPU benchmark's crossover stage: tests/test_gpu_bench.py",
    "bench/steps_timing.py": "step timing of the benchmarks: tests/test_gpu_bench.py runs it on tiny models",
    "cache.py": "the paged pool and fp8 storage are exercised by every cached forward: tests/test_kernels.py, "
                "tests/test_generate.py (fp8), tests/test_llama.py",
    "checkpoint/draft_io.py": "the draft's torch <-> Orbax converters: tests/test_dspark_draft.py (named for the "
                              "draft it converts), tests/test_draft_vocab.py",
    "checkpoint/draft_layout.py": "the draft's tensor inventory and its checks: tests/test_dspark_draft.py, "
                                  "tests/test_draft_vocab.py",
    "checkpoint/gguf.py": "GGUF -> HF conversion: tests/test_gguf_tokenizer.py",
    "checkpoint/loader.py": "HF-layout target loading: tests/test_llama.py, tests/test_kimi_target.py",
    "checkpoint/orbax_io.py": "atomic Orbax staging: tests/test_dspark_draft.py, tests/test_target_io.py",
    "checkpoint/safetensors_io.py": "the safetensors reader/writer under every converter: "
                                    "tests/test_dspark_draft.py, tests/test_target_io.py",
    "config.py": "each family's config is tested with its model: tests/test_llama.py, tests/test_kimi_target.py, "
                 "tests/test_dspark_draft.py, tests/test_rope_mla.py",
    "data/dedup.py": "the data modules share tests/test_data.py (one registry fixture)",
    "data/eval_sets.py": "the data modules share tests/test_data.py; the card's use: tests/test_bench.py",
    "data/prompts.py": "the data modules share tests/test_data.py",
    "data/registry.py": "the data modules share tests/test_data.py",
    "distributed.py": "multi-process runs: tests/test_multihost.py",
    "engine.py": "the engine is tested through its loop: tests/test_generate.py, tests/test_scheduler.py, "
                 "tests/test_chunked_prefill.py, tests/test_serving_layout.py",
    "engine_config.py": "validated by the programs and generate(): tests/test_scheduler.py, tests/test_server.py, "
                        "tests/test_chunked_prefill.py",
    "hostinfo.py": "the CPU description the programs log: tests/test_api.py",
    "kernels/block_sparse.py": "every kernel against its reference: tests/test_kernels.py",
    "kernels/common.py": "the kernels' shared tiling helpers: tests/test_kernels.py",
    "kernels/dispatch.py": "kernel or reference: tests/test_kernels.py, tests/test_kernels_in_generation.py",
    "kernels/kda_chunked.py": "every kernel against its reference: tests/test_kernels.py, tests/test_kda.py",
    "kernels/kda_reference.py": "the references are the kernels' oracles: tests/test_kernels.py, tests/test_kda.py",
    "kernels/mla_flash.py": "every kernel against its reference: tests/test_kernels.py",
    "kernels/mla_paged.py": "every kernel against its reference: tests/test_kernels.py",
    "kernels/mla_prefill.py": "every kernel against its reference: tests/test_kernels.py",
    "kernels/mla_reference.py": "the references are the kernels' oracles: tests/test_kernels.py",
    "layers/attn_res.py": "Block Attention Residuals with the MoE: tests/test_moe_attnres.py",
    "layers/linear.py": "the dense projection under every model: tests/test_bf16_casts.py, tests/test_llama.py",
    "layers/mla.py": "MLA with its rope: tests/test_rope_mla.py",
    "layers/mlp.py": "the MLP with the MoE's experts: tests/test_moe_attnres.py",
    "layers/mxfp4.py": "MXFP4 experts with the MoE: tests/test_moe_attnres.py",
    "layers/norms.py": "the norms under every model: tests/test_bf16_casts.py, tests/test_llama.py",
    "layers/rope.py": "rope with MLA: tests/test_rope_mla.py, tests/test_dspark_draft.py (YaRN)",
    "models/draft_surgery.py": "each operation where it is used: tests/test_add_layers.py, "
                               "tests/test_draft_vocab.py (remap_vocabulary), tests/test_average.py",
    "models/dspark.py": "the draft model with its converters: tests/test_dspark_draft.py",
    "models/kimi.py": "the kimi_linear family: tests/test_kimi_target.py",
    "models/target.py": "the TargetLM contract: every family implements it (tests/test_llama.py, "
                        "tests/test_kimi_target.py)",
    "params.py": "parameter walking under every converter: tests/test_dspark_draft.py, tests/test_target_io.py",
    "plan_programs.py": "the server's programs as serve.plan compiles them, and the MoE FLOPs count: "
                        "tests/test_plan.py",
    "presets.py": "preset names and the SmolLM2 install: tests/test_gguf_tokenizer.py, tests/test_smollm2.py",
    "sampling.py": "sampled verification: tests/test_generate.py, tests/test_compute_dtype.py",
    "serving/app.py": "the HTTP app through the OpenAI client: tests/test_server.py",
    "serving/card.py": "the acceptance card (serve.bench): tests/test_bench.py",
    "serving/guard.py": "Host, Origin and CORS checks in front of the app: tests/test_server.py",
    "serving/metrics.py": "the /metrics endpoint: tests/test_server.py",
    "serving/pair.py": "the entry points' model pair: tests/test_server.py, tests/test_api.py, "
                       "tests/test_compute_dtype.py",
    "serving/protocol.py": "request parsing through the server: tests/test_server.py",
    "serving/worker.py": "the engine thread behind the server: tests/test_server.py",
    "sharding.py": "meshes and sharded loads: tests/test_multihost.py, tests/test_plan.py, tests/test_llama.py",
    "sources.py": "a model's source directory, read by generate(): tests/test_gguf_tokenizer.py",
    "stats.py": "acceptance statistics: tests/test_acceptance.py, tests/test_generate.py",
    "steps.py": "the step functions through generation and its paths: tests/test_generate.py, "
                "tests/test_draft_paths.py",
    "tokenizer.py": "the HF and Kimi tokenizers: tests/test_gguf_tokenizer.py, tests/test_smollm2.py",
    "train/loss.py": "the distillation loss with the trainer: tests/test_train.py",
    "train/monitor.py": "the held-out eval and learning curve: tests/test_train_monitor.py",
    "train/regen.py": "answer caches: tests/test_train.py, tests/test_regen_archive.py",
    "train/torchspec.py": "TorchSpec checkpoints into a train state: tests/test_train.py",
    "train/trainer.py": "training, resume and export: tests/test_train.py",
    "train/vocab.py": "the reduced vocabulary's choice: tests/test_draft_vocab.py",
    "train/warm_start.py": "warm start with the monitored runs: tests/test_train_monitor.py",
}


def modules_with_logic() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree)):
            out.append(path.relative_to(PKG).as_posix())
    return out


def test_every_module_with_logic_has_a_test_module_or_a_reason():
    modules = modules_with_logic()
    assert "engine.py" in modules and "train/init_draft.py" in modules
    untested = {m for m in modules if not (ROOT / "tests" / f"test_{Path(m).stem}.py").exists()}
    missing = sorted(untested - set(UNTESTED_BY_NAME))
    assert not missing, f"modules with neither a tests/test_<module>.py nor an entry in UNTESTED_BY_NAME: {missing}"
    stale = sorted(set(UNTESTED_BY_NAME) - untested)
    assert not stale, f"entries of modules that now have a test module of their own (or are gone): {stale}"


def test_every_reason_names_test_modules_that_exist():
    for module, reason in UNTESTED_BY_NAME.items():
        named = re.findall(r"tests/(test_\w+\.py)", reason)
        assert named, f"{module}: the reason names no test module"
        for name in named:
            assert (ROOT / "tests" / name).exists(), f"{module}: {name} does not exist"


MAX_LINES = 450
REASON = re.compile(r"over 450 lines")


def test_long_modules_say_why_at_their_top():
    """A package module over MAX_LINES says, in its first 40 lines, why it stays one module."""
    quiet = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES + 10 and not REASON.search("\n".join(lines[:40])):
            quiet.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not quiet, f"modules over {MAX_LINES} lines with no reason at their top: {quiet}"
