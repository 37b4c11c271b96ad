"""benchmarks.gpu_bench, the GPU benchmark, run on the CPU with tiny shapes: every stage through
the driver (interpret-mode kernels, tiny configs, a tiny GGUF converted as the demo target,
transformers on the CPU as the peer), the JSON and the tables; a stage that fails, hangs, cannot
run or finds no time left is recorded and the others still run; the crossover and goal arithmetic
on made-up timings; the K3-width slice's configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from benchmarks import gpu_bench
from dspark_jax.bench.crossover import auto_choice, crossover_report, crossover_span
from tests.gguf_utils import TINY, tiny_tokens, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def write_gguf(path: Path, context: int = 4096) -> Path:
    """tests/gguf_utils.py's tiny llama GGUF, with room for GSM8K prompts (byte-level
    tokens) plus the new tokens."""
    return write_tiny_gguf(path, context=context)


def write_draft(dst: Path) -> Path:
    """A random DSpark draft for the tiny GGUF target (hidden 32, its vocabulary, 2 layers)."""
    from dspark_jax.checkpoint.draft_io import save_torch_draft
    from dspark_jax.config.draft import DraftConfig
    from dspark_jax.models.dspark import K3DSparkModel
    from tests.gen_utils import randomize
    from tests.serve_utils import DRAFT_CONFIG

    vocab = len(tiny_tokens())
    cfg = dict(DRAFT_CONFIG, vocab_size=vocab, mask_token_id=vocab - 1, target_num_hidden_layers=TINY["layers"],
               target_layer_ids=[0, 1], num_target_layers=2)
    model = K3DSparkModel(DraftConfig.from_dict(cfg), dtype=jnp.float32, rngs=nnx.Rngs(3))
    randomize(model, 3)
    save_torch_draft(model, cfg, dst)
    return dst


def _bench(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, XLA_FLAGS=""), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# arithmetic on made-up numbers


def _points(table: dict[int, list[float | None]]) -> list[dict]:
    return [{"shape": f"s{i}", "span": span, "ratio": r} for span, rs in table.items() for i, r in enumerate(rs)]


def test_crossover_from_a_sweep():
    pts = _points({65536: [0.7, 0.8], 32768: [0.9, 0.95], 16384: [0.9, 1.2], 8192: [1.5, 1.6]})
    assert crossover_span(pts) == 32768                      # every shape wins from 32k up
    rep = crossover_report(pts, current=16384)
    assert rep["measured_crossover"] == rep["recommended_min_keys"] == 32768
    assert rep["auto_worst_ratio_current"] == 1.2 and rep["auto_never_slower_current"] is False
    rep = crossover_report(pts, current=32768)
    assert rep["auto_worst_ratio_current"] == 1.0 and rep["auto_never_slower_current"] is True  # = the reference below
    assert [p["auto"] for p in auto_choice(pts, 32768)] == ["kernel"] * 4 + ["reference"] * 4
    # the kernel lost at the largest span: keep the reference at every measured span
    rep = crossover_report(_points({4096: [1.1], 2048: [0.5]}), current=32768)
    assert rep["measured_crossover"] is None and rep["recommended_min_keys"] == 8192
    assert rep["auto_never_slower_current"] is True           # 32k: the reference everywhere measured
    # a point that errored counts as a loss
    assert crossover_span(_points({8192: [0.5, None], 4096: [0.5, 0.5]})) is None
    assert crossover_span(_points({8192: [0.5], 4096: [0.5, None]})) == 8192


def test_goals_from_results():
    results = {
        "demo": {"data": {"speculative_over_plain": 2.4}},
        "torch": {"data": {"ours_over_torch": 0.7}},
        "steps_demo": {"data": {"rows": [{"kernels": "auto", "batch": 1, "verify_over_step": 1.1},
                                         {"kernels": "auto", "batch": 8, "verify_over_step": 1.25},
                                         {"kernels": "off", "batch": 1, "verify_over_step": 3.0}]}},
        "crossover": {"data": {"crossover": {"auto_worst_ratio_current": 1.0, "auto_never_slower_current": True}}},
        "kernels": {"groups": {"kda": {"data": {"cases": [{"group": "kda", "name": "x", "ratio": 0.3}]}},
                               "mla_paged": {"data": {"cases": [{"group": "mla_paged", "name": "y", "ratio": 1.8}]}}}},
    }
    got = {g["id"]: (g["value"], g["ok"]) for g in gpu_bench.goals(results)}
    assert got["speculative_over_plain"] == (2.4, True)
    assert got["ours_over_torch"] == (0.7, False)
    assert got["verify_over_step_demo"] == (1.25, True)                   # the worst batch under auto
    assert got["verify_over_step_k3"] == (None, None)                     # not measured: no claim
    assert got["paged_mla_auto"] == (1.0, True)
    # the paged kernel's 1.8 is the crossover's business: under auto it runs only above it
    assert got["other_kernels"] == (0.3, True)
    assert sum(1 for g in gpu_bench.goals({}) if g["ok"] is None) == 6    # nothing measured: nothing claimed


def test_a_stopped_demo_stage_keeps_its_finished_runs():
    """demo/torch record every run as it ends: a stage killed at its limit still reports tok/s
    over the full-length runs that compiled nothing (warm-ups and compiling runs left out)."""
    runs = [{"system": "ours_plain:bfloat16", "max_new_tokens": 16, "new_tokens": 16, "seconds": 9.0, "compiled": True},
            {"system": "ours_plain:bfloat16", "max_new_tokens": 128, "new_tokens": 128, "seconds": 5.0,
             "compiled": True},
            {"system": "ours_plain:bfloat16", "max_new_tokens": 128, "new_tokens": 128, "seconds": 0.5,
             "compiled": False},
            {"system": "ours_plain:bfloat16", "max_new_tokens": 128, "new_tokens": 72, "seconds": 0.3,
             "compiled": False},
            {"system": "ours_spec:bfloat16", "max_new_tokens": 128, "new_tokens": 128, "seconds": 0.4,
             "compiled": False}]
    data = {"max_new_tokens": 128, "runs": runs}
    assert gpu_bench.partial_speeds(data) == {"ours_plain:bfloat16": (200 / 0.8, 2), "ours_spec:bfloat16": (320.0, 1)}
    table = gpu_bench.tables({"demo": {"status": "timeout", "data": data}}, {})
    assert "## Demo pair / torch, partial" in table and "| ours_plain:bfloat16 | 250.0 | 2 |" in table
    assert "## Demo pair, real weights" not in table


def test_k3_slice_is_k3_at_full_width():
    from dspark_jax import params as params_lib
    from dspark_jax.config.draft import DraftConfig
    from dspark_jax.config.kimi import KimiConfig
    from dspark_jax.models.dspark import K3DSparkModel
    from dspark_jax.models.kimi import KimiLinearModel

    raw_t, raw_d = gpu_bench.k3_slice(4)
    t, d = KimiConfig.from_dict(raw_t), DraftConfig.from_dict(raw_d)
    full = KimiConfig.from_json(ROOT / "dspark_jax" / "configs" / "kimi-k3.json")
    assert (t.kda_layers, t.full_attn_layers, t.first_k_dense_replace) == ((0, 1, 2), (3,), 1)
    for key in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "q_lora_rank",
                "num_experts", "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                "kda_num_heads", "kda_head_dim", "quantization", "vocab_size", "attn_res_block_size"):
        assert getattr(t, key) == getattr(full, key), key
    assert (d.hidden_size, d.num_attention_heads, d.num_hidden_layers, d.markov_rank) == (7168, 64, 5, 256)
    assert d.target_layer_ids == (0, 1, 2, 2, 3) and d.target_hidden_size == 7168
    nbytes = lambda m: sum(x.size * x.dtype.itemsize for x in __import__("jax").tree.leaves(nnx.state(m)))
    target = params_lib.abstract(lambda: KimiLinearModel(t, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    draft = params_lib.abstract(lambda: K3DSparkModel(d, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert 50 * 2**30 < nbytes(target) < 60 * 2**30 and 4 * 2**30 < nbytes(draft) < 5 * 2**30  # fits an H200
    with pytest.raises(ValueError, match="needs >= 4"):
        gpu_bench.k3_slice(3)
    tiny_t, tiny_d = gpu_bench.k3_slice(4, tiny=True)
    assert KimiConfig.from_dict(tiny_t).hidden_size == DraftConfig.from_dict(tiny_d).target_hidden_size == 64


# ---------------------------------------------------------------------------------------------
# the driver


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny GGUF converted to an HF-layout target, a draft for it)."""
    from dspark_jax.checkpoint.gguf import convert_gguf

    root = tmp_path_factory.mktemp("gpu_bench")
    target = root / "target"
    convert_gguf(write_gguf(root / "tiny.gguf"), target, dtype="f32")
    return target, write_draft(root / "draft")


def _run_tiny(tiny_pair, tmp_path, stages: str, *extra: str) -> tuple[dict, str, subprocess.CompletedProcess]:
    target, draft = tiny_pair
    demo_cfg = tmp_path / "llama.json"              # the tiny GGUF's architecture, for steps_demo
    demo_cfg.write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=len(tiny_tokens()),
        hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"], num_hidden_layers=TINY["layers"],
        num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"],
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2)))
    out = tmp_path / "out"
    proc = _bench(["--out", str(out), "--stages", stages, "--tiny", "--demo_target", str(target), "--state_dir",
                   str(tmp_path / "state"), "--nocompile_cache", "--dtype", "float32", "--demo_config",
                   str(demo_cfg), "--demo_draft", str(draft), "--budget_s", "800", "--min_stage_s", "1", *extra])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert {s: r["status"] for s, r in res["results"].items()} == dict.fromkeys(stages.split(","), "ok")
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "results.json", "table.md"]
    table = (out / "table.md").read_text()
    assert table in proc.stdout and "## Goals" in table
    return res["results"], table, proc


def test_kernel_and_step_stages_on_tiny_shapes(tiny_pair, tmp_path):
    """kernels, crossover, steps_demo and steps_k3 on a CPU: interpret-mode kernels, tiny configs
    (the K3 slice's structure at test widths), every result in results.json and the tables."""
    r, table, proc = _run_tiny(tiny_pair, tmp_path, "kernels,crossover,steps_demo,steps_k3",
                               "--kernel_groups", "mla_paged", "--kernel_match", "block float8",
                               "--batch_sizes", "1", "--step_modes", "auto", "--step_reps", "1")
    cases = r["kernels"]["groups"]["mla_paged"]["data"]["cases"]
    assert [c["name"] for c in cases] == ["B2 T7 N2 ctx200 block float8_e4m3fn"] and cases[0]["ok"]
    xo = r["crossover"]["data"]["crossover"]
    assert xo["points"] and xo["current_min_keys"] == 32768 and xo["timings_meaningful"] is False
    assert all(p["auto"] == "reference" and p["ok"] for p in xo["points"])   # tiny spans << 32768
    for stage in ("steps_demo", "steps_k3"):
        (row,) = r[stage]["data"]["rows"]
        assert row["kernels"] == "auto" and row["batch"] == 1
        assert min(row["one_token_step_ms"], row["verify_ms"], row["draft_block_ms"]) > 0
    assert "K3 slice: 4 layers (3 KDA + 1 MLA; 1 dense + 3 MoE" in r["steps_k3"]["data"]["model"]
    for heading in ("## Kernels vs references", "## Paged MLA decode", "## Steps: demo pair widths",
                    "## Steps: K3-width slice"):
        assert heading in table, heading
    assert "[steps_k3]" in proc.stdout and "[kernels:mla_paged]" in proc.stdout


def test_demo_and_torch_stages_on_tiny_weights(tiny_pair, tmp_path):
    """demo and torch on a CPU: the converted tiny target, GSM8K prompts from the data registry,
    float32 (speculative output must equal plain output exactly), transformers on the CPU
    compared token for token with our plain decoding."""
    target, _ = tiny_pair
    r, table, _ = _run_tiny(tiny_pair, tmp_path, "demo,torch", "--num_prompts", "2", "--max_new_tokens", "8",
                            "--rounds", "1", "--torch_device", "cpu")
    demo = r["demo"]["data"]
    assert demo["target"] == str(target)
    assert demo["prompts"] == 2 and min(demo["prompt_tokens"]) > 100         # GSM8K questions (byte tokens)
    assert demo["speculative_equals_plain"] == "2/2" and demo["speculative_over_plain"] > 0
    torch_ = r["torch"]["data"]
    assert torch_["device"] == "cpu" and torch_["identical_to_ours"].endswith("/2")
    assert torch_["ours_over_torch"] > 0 and len(torch_["matching_prefix_tokens"]) == 2
    assert "## Demo pair, real weights" in table and "transformers greedy (cpu)" in table


def test_failures_hangs_skips_and_the_budget(tmp_path):
    """Each stage's trouble stays its own: a stage that cannot run is skipped with the reason, an
    error and a hang are recorded with the output's tail, later stages still run, and a stage
    that finds no budget left keeps an earlier run's result."""
    missing = tmp_path / "no-such-target"
    state = tmp_path / "state"
    out = tmp_path / "out"
    proc = _bench(["--out", str(out), "--tiny", "--demo_target", str(missing), "--state_dir", str(state),
                   "--nocompile_cache", "--stages", "torch,demo,steps_demo,steps_k3", "--demo_config",
                   str(ROOT / "dspark_jax" / "configs" / "smollm2-135m-dspark.json"),
                   "--stage_timeouts", "steps_k3=4", "--min_stage_s", "1", "--budget_s", "300"])
    assert proc.returncode == 1, proc.stdout[-4000:]                          # an error and a timeout
    r = json.loads((out / "results.json").read_text())["results"]
    assert r["torch"]["status"] == "skipped" and "sees no CUDA device" in r["torch"]["reason"]
    assert r["demo"]["status"] == "skipped"
    assert r["demo"]["reason"].startswith(f"demo target {str(missing)!r} not available")
    assert r["steps_demo"]["status"] == "error" and r["steps_demo"]["rc"] != 0
    assert "a DSpark draft config, not a target's" in r["steps_demo"]["reason"]
    assert any("Traceback" in line for line in r["steps_demo"]["log_tail"])
    assert r["steps_k3"]["status"] == "timeout" and r["steps_k3"]["rc"] is None

    # no budget left: nothing starts; an earlier ok result is kept (marked), others say why
    history = json.loads((state / "history.json").read_text())
    history["demo"] = {"stage": "demo", "status": "ok", "run_at": "earlier", "data": {"speculative_over_plain": 2.5}}
    (state / "history.json").write_text(json.dumps(history))
    proc = _bench(["--out", str(out), "--state_dir", str(state), "--stages", "demo,torch",
                   "--budget_s", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["stages_this_run"] == {"demo": "skipped", "torch": "skipped"}
    assert res["results"]["demo"]["status"] == "ok" and res["results"]["demo"]["earlier"] is True
    assert res["results"]["torch"]["reason"].startswith("budget")
    assert any(g["value"] == 2.5 and g["ok"] for g in res["goals"])
    bad = _bench(["--out", str(out), "--stages", "kernels,nope"], timeout=60)
    assert bad.returncode == 2 and "--stages: unknown ['nope']" in bad.stderr


def test_random_weights_on_host_and_device():
    """steps_timing.random_weights (the step stages' models): every leaf drawn, floats ~ N(0, 0.02),
    MXFP4 bytes random with 2^-5 scales, on the host below `host_max_bytes` and on the device
    above it, placed like a loaded checkpoint."""
    import jax
    import numpy as np

    from dspark_jax.bench import steps_timing
    from dspark_jax.config.kimi import KimiConfig
    from dspark_jax.models.kimi import KimiLinearModel

    cfg = KimiConfig.from_dict(gpu_bench.k3_slice(4, tiny=True)[0])
    for host_max in (16 << 20, 0):                      # all on the host; all on the device
        model = steps_timing.random_weights(lambda rngs: KimiLinearModel(cfg, dtype=jnp.float32, rngs=rngs),
                                            on_device=True, host_max_bytes=host_max)
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in
                jax.tree_util.tree_leaves_with_path(nnx.state(model))}
        scales = [v for k, v in flat.items() if "weight_scale" in k]
        packed = [v for k, v in flat.items() if "weight_packed" in k]
        floats = np.concatenate([v.ravel() for v in flat.values() if v.dtype == np.float32])
        assert scales and all((v == 122).all() for v in scales)
        assert packed and all(v.dtype == np.uint8 and len(np.unique(v)) > 200 for v in packed)
        assert abs(floats.std() - 0.02) < 2e-3 and abs(floats.mean()) < 1e-3
        assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(nnx.state(model)))


def test_shell_wrappers(tmp_path):
    """scripts/gpu_bench.sh passes its flags on ($PYTHON picks the interpreter); gpu_check.sh is
    its kernels + steps_demo stages."""
    env = dict(os.environ, PYTHON=sys.executable, XLA_FLAGS="")
    proc = subprocess.run(["scripts/gpu_bench.sh", str(tmp_path / "out"), "--stages", "torch,demo", "--budget_s", "1",
                           "--state_dir", str(tmp_path / "state")], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["stages_this_run"] == {"torch": "skipped", "demo": "skipped"} and res["budget_s"] == 1
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "exec scripts/gpu_bench.sh" in check and "--stages kernels,steps_demo" in check
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=ROOT).returncode == 0
