"""Warm start and training schedule/monitoring: tiny models, seconds."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.safetensors_io import save_arrays
from dspark_jax.config.draft import DraftConfig
from dspark_jax.decode.generate import generate
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.train import batches, loop, monitor
from dspark_jax.train import loss as L
from dspark_jax.train import trainer as T
from dspark_jax.train.warm_start import WarmStartError, plan, warm_start
from tests.gen_utils import answer_samples, randomize, tiny_draft, tiny_llama
from tests.train_utils import TINY_LLAMA

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, seed=1)


@pytest.fixture(scope="module")
def samples(pair):
    return answer_samples(pair[0], max_new_tokens=24)


def _flat(model) -> dict[str, np.ndarray]:
    return {n: np.array(p.get_value()) for n, p in params_lib.flat_params(model).items()}


def _fresh_draft(target, seed=1, **overrides) -> K3DSparkModel:
    base = tiny_draft(target, seed=seed)
    cfg = DraftConfig.from_dict(dict(base.cfg.raw, **overrides)) if overrides else base.cfg
    draft = K3DSparkModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(draft, seed)
    return draft


# ---------------------------------------------------------------------------------------------
# warm start


def test_warm_start_maps_each_tensor_from_its_source_and_leaves_the_rest(pair):
    target, _ = pair
    draft = _fresh_draft(target)             # 2 draft layers, target has 3: layers 1, 2 -> 0, 1
    before, tgt = _flat(draft), _flat(target)
    out = warm_start(draft, target)
    assert out is draft
    after = _flat(draft)
    want_from_target = {}
    for j, i in ((0, 1), (1, 2)):
        for t in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight"):
            want_from_target[f"layers.{j}.{t}"] = f"model.layers.{i}.{t}"
    want_from_target["final_norm.weight"] = "model.norm.weight"
    for dst, src in want_from_target.items():
        np.testing.assert_array_equal(after[dst], tgt[src], err_msg=dst)
        assert not np.array_equal(before[dst], after[dst]), dst       # it really changed
    # context_proj [H, n_aux * H_t]: identity on the last aux layer's block, zero elsewhere
    h, h_t = draft.cfg.hidden_size, draft.cfg.target_hidden_size
    w = after["context_proj.weight"]
    assert w.shape == (h, 2 * h_t)
    np.testing.assert_array_equal(w[:, h_t:], np.eye(h, h_t, dtype=np.float32))
    np.testing.assert_array_equal(w[:, :h_t], 0.0)
    np.testing.assert_array_equal(after["markov_head.markov_w2.weight"], 0.0)
    np.testing.assert_array_equal(after["confidence_head.proj.weight"], 0.0)
    np.testing.assert_array_equal(after["confidence_head.proj.bias"], 0.0)       # sigmoid(0) = 0.5
    changed = set(want_from_target) | {"context_proj.weight", "markov_head.markov_w2.weight",
                                       "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert {a.name for a in plan(draft, target)} == changed
    untouched = set(before) - changed
    assert any(n.startswith("layers.0.self_attn.") for n in untouched)          # attention stays random
    assert {"markov_head.markov_w1.weight", "context_norm.weight"} <= untouched
    for n in untouched:
        np.testing.assert_array_equal(after[n], before[n], err_msg=n)
    # the warm-started draft: zero Markov bias, neutral confidence 0.5 everywhere
    prev = jnp.arange(6).reshape(1, 6)
    np.testing.assert_array_equal(np.asarray(draft.markov_bias(prev)), 0.0)
    hid = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, h)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(draft.confidence(hid, prev)), 0.5)


def test_warm_start_skips_mismatched_shapes_and_checks_its_arguments(pair):
    target, _ = pair
    draft = _fresh_draft(target, intermediate_size=48)        # target MLP is 64 wide: not copied
    before, tgt = _flat(draft), _flat(target)
    warm_start(draft, target, context_scale=0.5, confidence_prior=0.8)
    after = _flat(draft)
    for t in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(after[f"layers.1.mlp.{t}.weight"], before[f"layers.1.mlp.{t}.weight"])
    np.testing.assert_array_equal(after["layers.1.input_layernorm.weight"], tgt["model.layers.2.input_layernorm.weight"])
    np.testing.assert_array_equal(after["context_proj.weight"][:, 32:], 0.5 * np.eye(32, dtype=np.float32))
    np.testing.assert_allclose(after["confidence_head.proj.bias"], np.log(0.8 / 0.2), rtol=1e-6)
    with pytest.raises(WarmStartError, match="confidence_prior"):
        plan(draft, target, confidence_prior=1.0)


# ---------------------------------------------------------------------------------------------
# schedules


def test_constant_schedule_warms_up_then_holds_and_cosine_is_unchanged(tmp_path):
    base = dict(run_dir=str(tmp_path), total_steps=100, lr=1e-3, warmup_frac=0.1, min_lr_frac=0.1)
    _, const = T.make_optimizer(T.TrainConfig(**base, lr_schedule="constant"))
    _, cos = T.make_optimizer(T.TrainConfig(**base))
    # step n uses the value at n + 1: warmup of 10 steps reaches the peak at step 9
    np.testing.assert_allclose([float(const(n)) for n in (0, 4, 9)], [1e-4, 5e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose([float(const(n)) for n in (10, 50, 99, 500)], 1e-3, rtol=1e-6)
    for n in (0, 4, 9):
        assert float(cos(n)) == pytest.approx(float(const(n)), rel=1e-6)
    assert float(cos(99)) == pytest.approx(1e-4, rel=1e-4)                   # cosine to min_lr_frac * lr
    assert 1e-4 < float(cos(50)) < 1e-3
    with pytest.raises(ValueError, match="lr_schedule"):
        T.make_optimizer(T.TrainConfig(**base, lr_schedule="linear"))


# ---------------------------------------------------------------------------------------------
# held-out eval: history, TensorBoard, PNG, resume


def _tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every tensorboardX event file under tb_dir (TFRecord framing, no tensorboard)."""
    from tensorboardX.proto import event_pb2
    out: dict[str, list] = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def _is_png(path: Path) -> bool:
    from PIL import Image
    if path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    with Image.open(path) as im:
        im.verify()
    return True


def test_heldout_eval_measures_the_weights_it_is_given(pair, samples):
    """One evaluator (one engine, compiled once) over different drafts: each result equals a fresh
    generate() with that draft, so a stale swapped-in state would show."""
    target, draft = pair
    prompts = [s.input_ids[:int(np.argmax(s.loss_mask))].tolist() for s in samples[:2]]
    other = tiny_draft(target, seed=3)
    ev = monitor.HeldOutEval(target, prompts, max_new_tokens=8)
    got = [ev(d)["tok_per_fwd"] for d in (draft, other, draft)]
    want = [generate(target, d, prompts, max_new_tokens=8).stats["average_tokens_per_forward"] for d in (draft, other)]
    assert want[0] != want[1]                         # the two drafts are distinguishable here
    assert got == pytest.approx([want[0], want[1], want[0]], abs=1e-12)


def test_heldout_eval_writes_history_tensorboard_and_curve_and_resumes(pair, samples, tmp_path):
    target, draft = pair
    prompts = [s.input_ids[:int(np.argmax(s.loss_mask))].tolist() for s in samples[:2]]
    run_dir = tmp_path / "run"
    cfg = T.TrainConfig(run_dir=str(run_dir), total_steps=3, global_batch=4, micro_batch=2, max_len=48, lr=3e-3,
                        compute_dtype="float32", save_every=1000, export=False, eval_every=1,
                        lr_schedule="constant", loss=L.LossConfig(num_anchors=16))
    ev = monitor.HeldOutEval(target, prompts, max_new_tokens=8)
    tr = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft, log=lambda m: None)
    loop.run(tr, batches.SampleSource(samples, 0), stop_after=2, evaluator=ev)
    rows = monitor.EvalHistory(run_dir).rows()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["sequences_seen"] for r in rows] == [0, 4, 8]
    assert rows[0]["train_tau"] is None and rows[1]["train_tau"] > 1.0
    assert all(1.0 <= r["tok_per_fwd"] <= 8.0 and r["prompts"] == 2 for r in rows)
    # the eval measures the weights of its step: a fresh generate() with the step-2 draft agrees,
    # as does the step-0 row with the initial draft (the engine's swapped state is live)
    want2 = generate(target, tr.draft(), prompts, max_new_tokens=8).stats["average_tokens_per_forward"]
    want0 = generate(target, draft, prompts, max_new_tokens=8).stats["average_tokens_per_forward"]
    assert rows[2]["tok_per_fwd"] == pytest.approx(want2, abs=1e-9)
    assert rows[0]["tok_per_fwd"] == pytest.approx(want0, abs=1e-9)
    png = run_dir / monitor.CURVE_FILE
    assert _is_png(png)
    first_png = png.read_bytes()
    # a torn last line (killed mid-write) and a row past the checkpoint (step 2 is the checkpoint)
    with open(run_dir / monitor.EVAL_FILE, "a") as f:
        f.write(json.dumps(dict(rows[-1], step=5)) + "\n" + '{"step": 6, "tok_')

    # resume: a new trainer restores step 2 and continues the same history and curve (from the run
    # directory: the evaluator keeps no history, so its compiled engine is reused)
    tr2 = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft, log=lambda m: None)
    loop.run(tr2, batches.SampleSource(samples, 0), evaluator=ev)
    rows2 = monitor.EvalHistory(run_dir).rows()
    assert [r["step"] for r in rows2] == [0, 1, 2, 3]
    assert rows2[:3] == rows
    assert _is_png(png) and png.read_bytes() != first_png
    tb = _tb_scalars(run_dir / "tb")
    assert sorted(s for s, _ in tb["eval/tok_per_fwd"]) == [0, 1, 2, 3]
    assert dict(tb["eval/tok_per_fwd"])[3] == pytest.approx(rows2[3]["tok_per_fwd"], rel=1e-6)
    assert sorted(tb["train/sequences_seen"]) == [(1, 4.0), (2, 8.0), (3, 12.0)]
    assert "eval/accept_at_1" in tb and "train/lr" in tb


def _budget_trainer(pair, run_dir, **kw):
    """A factory of fresh trainers on one run dir (each call resumes from its checkpoints)."""
    target, draft = pair
    cfg = T.TrainConfig(run_dir=str(run_dir), global_batch=4, micro_batch=2, max_len=48, lr=3e-3,
                        compute_dtype="float32", save_every=1000, loss=L.LossConfig(num_anchors=16), **kw)
    return lambda: T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft, log=lambda m: None)


def test_cpu_budget_stops_the_run_and_its_total_survives_resumption(pair, samples, tmp_path):
    """Equal-CPU-time ablations: each step records its process CPU seconds and the running total;
    a budget stops the run at the first step that reaches it, with a checkpoint there; a resumed
    run continues the total instead of starting it again."""
    run_dir = tmp_path / "run"
    trainer = _budget_trainer(pair, run_dir, total_steps=6, export=False, lr_schedule="constant")
    first = loop.run(trainer(), batches.SampleSource(samples, 0), cpu_budget=1e-9)   # spent by the first step
    assert [m["step"] for m in first] == [1]
    assert first[0]["step_cpu_seconds"] > 0 and first[0]["cpu_seconds"] == first[0]["step_cpu_seconds"]
    again = trainer()
    assert loop.run(again, batches.SampleSource(samples, 0), cpu_budget=1e-9) == []   # already spent: no step
    assert int(again.state.step) == 1                                        # it restored the budget stop
    spent = first[0]["cpu_seconds"]
    rest = loop.run(trainer(), batches.SampleSource(samples, 0), cpu_budget=spent + 1e6)   # runs to total_steps
    assert [m["step"] for m in rest] == [2, 3, 4, 5, 6]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["cpu_seconds"] for r in rows] == pytest.approx(np.cumsum([r["step_cpu_seconds"] for r in rows]).tolist(),
                                                             rel=1e-12)


def test_time_budget_stops_with_a_checkpoint_and_export_and_a_rerun_continues(pair, samples, tmp_path):
    """A machine held for a fixed time: the wall-clock budget of one invocation stops the run
    after the first step that reaches it, saved and exported there; the next invocation (its own
    budget) resumes from that step and finishes the schedule."""
    run_dir = tmp_path / "run"
    trainer = _budget_trainer(pair, run_dir, total_steps=4, export=True, lr_schedule="cosine")
    first = loop.run(trainer(), batches.SampleSource(samples, 0), time_budget=1e-9)   # spent by the first step
    assert [m["step"] for m in first] == [1]
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["step_0000001"]
    rest = loop.run(trainer(), batches.SampleSource(samples, 0), time_budget=1e6)
    assert [m["step"] for m in rest] == [2, 3, 4]
    assert rest[-1]["lr"] == pytest.approx(0.0, abs=1e-12)             # the cosine schedule ran to its end
    assert (run_dir / "export" / "step_0000004" / "model.safetensors").is_file()


def test_stop_at_ends_a_constant_lr_run_at_that_step_and_a_rerun_trains_nothing(pair, samples, tmp_path):
    """A run stopped at a chosen step (not a multiple of save_every) is saved and exported there;
    a rerun to the same step restores it and trains nothing; a later stop continues it."""
    run_dir = tmp_path / "run"
    trainer = _budget_trainer(pair, run_dir, total_steps=4, export=True, lr_schedule="constant")
    assert [m["step"] for m in loop.run(trainer(), batches.SampleSource(samples, 0), stop_at=2)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "export").iterdir())[-1] == "step_0000002"
    again = trainer()
    assert loop.run(again, batches.SampleSource(samples, 0), stop_at=2) == [] and int(again.state.step) == 2
    assert [m["step"] for m in loop.run(trainer(), batches.SampleSource(samples, 0), stop_at=3)] == [3]
    assert sorted(p.name for p in (run_dir / "export").iterdir())[-1] == "step_0000003"


# ---------------------------------------------------------------------------------------------
# the program: flags


def _distill_inputs(pair, samples, tmp_path) -> tuple[list[str], dict]:
    """A tiny target directory, draft config and regen cache on disk; the train.distill command
    line reading them (without --run_dir) and its environment."""
    target, draft = pair
    tdir = tmp_path / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_arrays(tdir / "model.safetensors", {k: np.asarray(v.get_value()) for k, v in params_lib.flat_params(target).items()})
    (tmp_path / "draft.json").write_text(json.dumps(dict(draft.cfg.raw)))
    with open(tmp_path / "regen.jsonl", "w") as f:
        for s in samples:
            n = int(np.argmax(s.loss_mask))
            f.write(json.dumps({"id": s.id, "source": "t", "prompt_ids": s.input_ids[:n].tolist(),
                                "answer_ids": s.input_ids[n:].tolist(), "finish_reason": "length", "kept": True,
                                "answer_text": ""}) + "\n")
    with open(tmp_path / "heldout.jsonl", "w") as f:
        for s in samples[:2]:
            f.write(json.dumps({"prompt_ids": s.input_ids[:int(np.argmax(s.loss_mask))].tolist()}) + "\n")
    cmd = [sys.executable, "-m", "train.distill", f"--target={tdir}", f"--data={tmp_path / 'regen.jsonl'}",
           f"--draft_config={tmp_path / 'draft.json'}", "--global_batch=4", "--micro_batch=2", "--max_len=48",
           "--num_anchors=16", "--compute_dtype=float32", "--lr=1e-3"]
    return cmd, dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")


def test_distill_flags_warm_start_constant_schedule_and_eval(pair, samples, tmp_path):
    base, env = _distill_inputs(pair, samples, tmp_path)
    run_dir = tmp_path / "run"
    cmd = base + [f"--run_dir={run_dir}", "--total_steps=2", "--save_every=100", "--warm_start",
                  "--lr_schedule=constant", "--eval_every=2", f"--eval_prompts_file={tmp_path / 'heldout.jsonl'}",
                  "--eval_max_new_tokens=8", "--ce_weight=1.0", "--l1_weight=0.0"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "warm start: 11 tensors copied from the target" in res.stdout
    assert "held-out eval every 2 steps: 2 prompts" in res.stdout
    rows = monitor.EvalHistory(run_dir).rows()
    assert [r["step"] for r in rows] == [0, 2]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3, 1e-3])          # warmup of 1 step, then constant
    for m in metrics:                    # --ce_weight 1 --l1_weight 0: the loss is CE + BCE, no L1 in it
        assert m["l1"] > 0.1 and m["loss"] == pytest.approx(m["ce"] + m["bce"], rel=1e-5)
    flags = json.loads((run_dir / "flags.json").read_text())
    assert flags["warm_start"] is True and flags["lr_schedule"] == "constant" and flags["eval_every"] == 2
    assert flags["ce_weight"] == 1.0 and flags["l1_weight"] == 0.0
    assert _is_png(run_dir / monitor.CURVE_FILE)
    bad = subprocess.run(cmd + [f"--init_from={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "cannot be combined with --init_from" in bad.stderr
    bad = subprocess.run(cmd + ["--ce_weight=0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--ce_weight and --l1_weight are both 0" in bad.stderr


def test_distill_trains_a_reduced_vocabulary_draft_and_pins_its_map(pair, samples, tmp_path):
    from dspark_jax.checkpoint.draft_io import load_draft
    from dspark_jax.train.vocab import VocabChoice, write_choice

    base, env = _distill_inputs(pair, samples, tmp_path)
    counts = np.bincount(np.concatenate([s.input_ids[s.loss_mask] for s in samples]), minlength=96)
    kept = sorted(int(i) for i in np.argsort(-counts, kind="stable")[:40])
    write_choice(VocabChoice(kept, 96, 0.9, 0.9, None, int(counts.sum()), 0), tmp_path / "vocab.json")
    run_dir = tmp_path / "run"
    cmd = base + [f"--run_dir={run_dir}", "--total_steps=1", "--save_every=1", "--warm_start",
                  f"--draft_vocab={tmp_path / 'vocab.json'}"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "reduced draft vocabulary: 40 of 96 target ids" in res.stdout
    assert json.loads((run_dir / "vocab.json").read_text())["token_ids"] == kept
    export = run_dir / "export" / "step_0000001"
    assert json.loads((export / "config.json").read_text())["draft_vocab_size"] == 40
    draft = load_draft(export, dtype=jnp.float32)
    assert np.asarray(draft.draft_token_ids()).tolist() == kept
    assert draft.markov_head.markov_w2.weight.get_value().shape[0] == 40
    # a resume must see the same vocabulary (checkpoints hold parameters, not the map)
    other = kept[1:] + [max(set(range(96)) - set(kept))]
    write_choice(VocabChoice(sorted(other), 96, 0.9, 0.9, None, 1, 0), tmp_path / "vocab2.json")
    bad = subprocess.run(base + [f"--run_dir={run_dir}", "--total_steps=2", f"--draft_vocab={tmp_path / 'vocab2.json'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "differs from the vocabulary this run started with" in bad.stderr


def test_gsm8k_heldout_prompts_are_outside_the_benchmark_prompts():
    from dspark_jax.data.eval_sets import load_gsm8k
    got = monitor.gsm8k_heldout_prompts(3)
    every = [it.conversation() for it in load_gsm8k()]
    assert got == every[60:63]
    assert not any(p in every[:60] for p in got)
    with pytest.raises(ValueError, match=">= 60"):
        monitor.gsm8k_heldout_prompts(3, start=10)
