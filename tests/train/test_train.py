"""Distillation (docs/architecture.md §4): anchors, masks, loss terms, teacher paths, sharding, resume, a short run."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax import sharding
from dspark_jax.checkpoint.draft_io import load_draft, save_torch_draft
from dspark_jax.data import answer_cache
from dspark_jax.kernels.dispatch import use_kernels
from dspark_jax.train import batches, loop, monitor, regen, teacher, teacher_shards, torchspec
from dspark_jax.train import loss as L
from dspark_jax.train import trainer as T
from dspark_jax.train.regen import Sample
from tests.gen_utils import answer_samples, tiny_draft, tiny_llama
from tests.train_utils import CharTokenizer as _CharTokenizer
from tests.train_utils import write_tiny_run_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, seed=1)


@pytest.fixture(scope="module")
def samples(pair):
    """The tiny target's own greedy answers to random prompts (what regen produces)."""
    return answer_samples(pair[0], max_new_tokens=28)


def _cfg(run_dir, **kw) -> T.TrainConfig:
    base = {"run_dir": str(run_dir), "total_steps": 4, "global_batch": 4, "micro_batch": 2, "max_len": 48,
            "compute_dtype": "float32", "save_every": 1000, "export": False, "loss": L.LossConfig(num_anchors=16)}
    base.update(kw)
    return T.TrainConfig(**base)


# ---------------------------------------------------------------------------------------------
# anchors, labels, masks


def test_anchors_never_cross_loss_mask_gaps():
    rng = np.random.default_rng(3)
    s, a = 40, 12
    mask = rng.random((6, s)) < 0.7
    mask[0] = False                                  # no valid anchor at all
    mask[1, :] = True                                # more candidates (39) than anchors
    ids = rng.integers(0, 50, (6, s)).astype(np.int32)
    cfg = L.LossConfig(block_size=5, num_anchors=a)
    anchors = L.sample_anchors(jnp.asarray(mask), a, jax.random.PRNGKey(0))
    blocks = L.make_blocks(jnp.asarray(ids), jnp.asarray(mask), anchors, cfg, mask_token_id=99)
    pos, keep = np.asarray(anchors.positions_BA), np.asarray(anchors.keep_BA)
    for b in range(6):
        valid = [x for x in range(s - 1) if mask[b, x] and mask[b, x + 1]]
        kept = pos[b][keep[b]]
        assert len(kept) == min(a, len(valid)) and set(kept) <= set(valid) and len(set(kept)) == len(kept)
        assert list(kept) == sorted(kept) and np.all(pos[b][~keep[b]] == 0)
        assert np.all(keep[b][:len(kept)])           # kept anchors first, padding after
        for j in range(a):
            x = int(pos[b, j])
            want_ids = [ids[b, x] if keep[b, j] else 99] + [99] * 4
            assert list(np.asarray(blocks.input_ids_BAT[b, j])) == want_ids
            ev = []
            ok = bool(keep[b, j])
            for k in range(5):                       # label k is x_{a+k+1}; cumulative eval mask
                ok = ok and x + k + 1 < s and bool(mask[b, x + k + 1])
                ev.append(ok)
                if x + k + 1 < s:
                    assert blocks.labels_BAT[b, j, k] == ids[b, x + k + 1]
                assert blocks.prev_BAT[b, j, k] == ids[b, min(x + k, s - 1)]
            assert list(np.asarray(blocks.eval_mask_BAT[b, j])) == ev
            np.testing.assert_allclose(blocks.weights_BAT[b, j], np.array(ev) * np.exp(-np.arange(5) / 4.0), rtol=1e-6)
    # uniform without replacement: over many draws each valid candidate is picked about equally
    m1 = jnp.asarray(np.tile(mask[1], (1, 1)))
    counts = np.zeros(s)
    for i in range(200):
        an = L.sample_anchors(m1, a, jax.random.PRNGKey(i))
        counts[np.asarray(an.positions_BA[0])] += 1
    # each of the 39 candidates is picked with p = 12/39 per draw: 200 draws give 61.5 +- 6.5
    assert counts[:39].min() > 35 and counts[:39].max() < 90


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_terms_equal_numpy():
    rng = np.random.default_rng(1)
    b, a, t, v = 2, 3, 7, 11
    d_logits = rng.normal(size=(b, a, t, v)) * 2
    t_logits = rng.normal(size=(b, a, t, v)) * 2
    conf = rng.normal(size=(b, a, t))
    labels = rng.integers(0, v, (b, a, t))
    terms = L.token_terms(jnp.asarray(d_logits, jnp.float32), jnp.asarray(t_logits, jnp.float32),
                          jnp.asarray(conf, jnp.float32), jnp.asarray(labels))
    lp = _np_log_softmax(d_logits)
    ce = -np.take_along_axis(lp, labels[..., None], -1)[..., 0]
    pt = np.exp(_np_log_softmax(t_logits))
    l1 = np.abs(np.exp(lp) - pt).sum(-1)
    acc = np.clip(1 - l1 / 2, 0, 1)
    # acceptance = sum_v min(p, q) for two distributions
    np.testing.assert_allclose(acc, np.minimum(np.exp(lp), pt).sum(-1), rtol=1e-6, atol=1e-6)
    bce = -(acc * np.log(1 / (1 + np.exp(-conf))) + (1 - acc) * np.log(1 - 1 / (1 + np.exp(-conf))))
    # fp32 softmax/log over 11 logits: relative error ~1e-6
    for got, want in ((terms.ce, ce), (terms.l1, l1), (terms.accept, acc), (terms.bce, bce)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    # pooled reduction
    keep = np.array([[True, True, False], [True, False, False]])
    ev = np.ones((b, a, t), bool) & keep[..., None]
    ev[0, 1, 4:] = False
    w = ev * np.exp(-np.arange(t) / 4.0)
    blocks = L.Blocks(L.Anchors(jnp.zeros((b, a), jnp.int32), jnp.asarray(keep)), None, None, jnp.asarray(labels),
                      None, jnp.asarray(ev), jnp.asarray(w, jnp.float32))
    cfg = L.LossConfig()
    sums = L.reduce_terms(terms, blocks, cfg)
    want_loss = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + 1.0 * (w * bce).sum()) / w.sum()
    np.testing.assert_allclose(float(sums.numerator / sums.weight), want_loss, rtol=1e-5)
    tau = sum(1 + np.cumprod(acc[i, j] * ev[i, j]).sum() for i in range(b) for j in range(a) if keep[i, j]) / keep.sum()
    m = L.metrics_from_sums(sums, cfg)
    np.testing.assert_allclose(float(m["tau_probabilistic"]), tau, rtol=1e-5)
    np.testing.assert_allclose(float(m["accept@1"]), acc[..., 0][keep].mean(), rtol=1e-5)
    agree = (d_logits.argmax(-1) == t_logits.argmax(-1))[ev].mean()
    np.testing.assert_allclose(float(m["teacher_agreement"]), agree, rtol=1e-6)
    np.testing.assert_allclose(float(m["top1_acc"]), (d_logits.argmax(-1) == labels)[ev].mean(), rtol=1e-6)


# one jitted teacher for the module: the tests of one batch shape share its compiled program
_TEACHER = nnx.jit(teacher.teacher_outputs, static_argnums=3)


def _teacher(target, ids, valid, draft):
    return _TEACHER(target, jnp.asarray(ids), jnp.asarray(valid), tuple(draft.cfg.target_layer_ids))


@pytest.mark.parametrize("num_anchors", [6, 8])
def test_full_objective_matches_serving_block_and_numpy(pair, samples, num_anchors):
    """Every anchor's draft logits equal the serving-side cacheless block pass over exactly the
    context rows before the anchor (so the training mask sees nothing at/after the anchor and no
    other block); the loss terms then equal numpy on those logits and the target's lm_head.
    6 anchors: A*T = 42 < S = 48, the target's lm_head and softmax on the gathered rows; 8: A*T =
    56 > S, on the S positions, then their rows gathered."""
    target, draft = pair
    ids, mask, valid = teacher.pad_batch(samples[:2], 48)
    tout = _teacher(target, ids, valid, draft)
    embed, head = teacher.frozen_tables(target)
    cfg = L.LossConfig(num_anchors=num_anchors)
    out = jax.jit(lambda *a: L.distill_outputs(draft, embed, head, *a, cfg))(
        jnp.asarray(ids), jnp.asarray(mask), tout.aux_BSA, tout.final_hidden_BSH, jax.random.PRNGKey(5))
    w1 = np.asarray(draft.markov_head.markov_w1.weight.get_value())
    w2 = np.asarray(draft.markov_head.markov_w2.weight.get_value())
    aux, fin, headn = np.asarray(tout.aux_BSA), np.asarray(tout.final_hidden_BSH), np.asarray(head)
    pos, keep = np.asarray(out.blocks.anchors.positions_BA), np.asarray(out.blocks.anchors.keep_BA)
    checked = 0
    for b in range(2):
        kept = np.flatnonzero(keep[b])
        for j in (kept[0], kept[-1]):    # one compilation per context length
            a = int(pos[b, j])
            base, _, _ = draft.block_forward(aux[b, :a], ids[b, a], embed, head, num_speculative_tokens=7)
            prev = np.array([ids[b, min(a + k, 47)] for k in range(7)])
            d_logits = np.asarray(base) + w1[prev] @ w2.T
            t_logits = fin[b, a:a + 7] @ headn.T if a + 7 <= 48 else None
            lp = _np_log_softmax(d_logits.astype(np.float64))
            labels = np.asarray(out.blocks.labels_BAT[b, j])
            np.testing.assert_allclose(np.asarray(out.terms.ce[b, j]), -lp[np.arange(7), labels], rtol=1e-4, atol=1e-4)
            if t_logits is not None:
                l1 = np.abs(np.exp(lp) - np.exp(_np_log_softmax(t_logits.astype(np.float64)))).sum(-1)
                np.testing.assert_allclose(np.asarray(out.terms.l1[b, j]), l1, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == 4


def test_later_teacher_features_do_not_reach_earlier_blocks(pair, samples):
    """Gradients of each block's loss w.r.t. the teacher aux features vanish at and after its
    anchor; perturbing the features at a position leaves every block anchored at or before it
    unchanged; one block's hidden states do not depend on another block's inputs."""
    target, draft = pair
    ids, mask, valid = teacher.pad_batch(samples[:1], 48)
    tout = _teacher(target, ids, valid, draft)
    embed, head = teacher.frozen_tables(target)
    cfg = L.LossConfig(num_anchors=8)
    key = jax.random.PRNGKey(2)
    args = (jnp.asarray(ids), jnp.asarray(mask))

    @jax.jit
    def per_block(aux):
        out = L.distill_outputs(draft, embed, head, *args, aux, tout.final_hidden_BSH, key, cfg)
        w = out.blocks.weights_BAT
        return jnp.sum(w * (out.terms.ce + out.terms.l1 + out.terms.bce), axis=-1)[0]     # [A]

    base = per_block(tout.aux_BSA)
    anchors = L.sample_anchors(args[1], cfg.num_anchors, key)
    pos, keep = np.asarray(anchors.positions_BA[0]), np.asarray(anchors.keep_BA[0])
    p = int(pos[keep][len(pos[keep]) // 2])
    after = per_block(tout.aux_BSA.at[0, p].add(10.0))
    earlier = keep & (pos <= p)
    # masked keys get exactly zero attention weight, so the untouched blocks are bit-identical
    np.testing.assert_array_equal(np.asarray(after)[earlier], np.asarray(base)[earlier])
    assert np.any(np.asarray(after)[keep & (pos > p)] != np.asarray(base)[keep & (pos > p)])

    # gradients of each block's hidden states w.r.t. the context rows and the other blocks' inputs
    blocks = L.make_blocks(*args, anchors, cfg, draft.cfg.mask_token_id)
    kv = draft.context_rows(tout.aux_BSA, jnp.arange(48)[None])
    emb = jnp.take(embed, blocks.input_ids_BAT, axis=0)
    per_block_h = lambda e, c: L.multi_anchor_hidden(draft, e, blocks.positions_BAT, c, anchors).sum(axis=(2, 3))[0]
    jac_kv = np.abs(np.asarray(jax.jit(jax.jacrev(per_block_h, argnums=1))(emb, kv))).sum(axis=(1, 2, 4))  # [A, S]
    for j in np.flatnonzero(keep):
        assert np.all(jac_kv[j, pos[j]:] == 0), f"block {j} (anchor {pos[j]}) sees context at/after its anchor"
        assert np.all(jac_kv[j, :pos[j]] > 0)
    assert np.all(jac_kv[~keep] == 0)                                                              # dropped blocks
    jac_e = np.abs(np.asarray(jax.jit(jax.jacrev(per_block_h))(emb, kv))[:, 0]).sum(axis=(2, 3))    # [A out, A in]
    assert np.all(jac_e[~np.eye(len(pos), dtype=bool)] == 0) and np.all(np.diag(jac_e) > 0)


def test_block_sparse_kernel_gives_the_reference_loss_and_gradients(pair, samples):
    """Training's multi-anchor attention through the Pallas block-sparse kernel (forced on:
    interpret mode on CPU) gives the loss and every draft gradient of the reference path (kernels
    off: the draft's absorbed attention, one batch row per block). f32: the two differ only by the
    absorbed vs expanded MLA form and the online softmax, < 1e-6 relative here; a kernel mask
    letting every block see one more context row moves the loss by 7e-3 relative and the
    gradients by 7e-2 (measured)."""
    target, draft = pair
    ids, mask, valid = teacher.pad_batch(samples[2:4], 48)      # prompts unsupervised, padded tails
    mask[1, np.flatnonzero(mask[1])[4:]] = False                  # 3 anchor candidates for 6 anchors
    tout = _teacher(target, ids, valid, draft)
    embed, head = teacher.frozen_tables(target)
    cfg = L.LossConfig(num_anchors=6)
    keep = np.asarray(L.sample_anchors(jnp.asarray(mask), 6, jax.random.PRNGKey(4)).keep_BA)
    assert keep[0].all() and keep[1].sum() == 3                    # dropped blocks in the batch
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

    def loss(p):
        return L.distill_loss(nnx.merge(graphdef, p, rest), embed, head, jnp.asarray(ids), jnp.asarray(mask),
                              tout.aux_BSA, tout.final_hidden_BSH, jax.random.PRNGKey(4), cfg)

    def run(mode):
        with use_kernels(mode):     # the mode is read while tracing: one fresh trace per mode
            traced = jax.jit(jax.value_and_grad(loss)).trace(params)
        assert ("pallas_call" in str(traced.jaxpr)) == (mode != "off"), f"mode {mode}: wrong attention path"
        return traced.lower().compile()(params)

    (want_loss, want_g), (got_loss, got_g) = run("off"), run("interpret")
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for (path, g), gw in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
        g, gw = np.asarray(g), np.asarray(gw)
        err = np.max(np.abs(g - gw)) / np.max(np.abs(gw))
        assert err <= 2e-5, f"{jax.tree_util.keystr(path)}: gradient error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# teacher paths


def test_online_and_offline_teacher_give_the_same_loss(pair, samples, tmp_path):
    target, draft = pair
    cfg = _cfg(tmp_path / "run")
    meta = teacher_shards.ShardMeta(num_writers=2, shard_size=3, aux_layer_ids=tuple(draft.cfg.target_layer_ids),
                             hidden_size=32, aux_width=64, dtype="float32", target="tiny", max_len=48)
    for w in range(2):
        teacher_shards.write_teacher_shards(target, samples, tmp_path / "shards", writer=w, meta=meta, batch_size=2)
    stream = teacher_shards.ShardStream(tmp_path / "shards", timeout_seconds=5)
    offline_src = batches.ShardSource(stream)
    examples = offline_src.take(4)
    # canonical order: shard j of writer 0, then of writer 1: samples 0, 2, 4 then 1, ...
    assert [e.sample.id for e in examples] == ["s0", "s2", "s4", "s1"]
    online_batch = batches.collate([batches.Example(e.sample) for e in examples], cfg, offline=False)
    offline_batch = batches.collate(examples, cfg, offline=True)
    on = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft).eval_sums(online_batch, 0)
    off = T.Trainer(cfg, draft.cfg, target, online=False, init_draft=draft).eval_sums(offline_batch, 0)
    # same jitted teacher function on the same padded shapes; fusion inside the training step may
    # reorder fp32 sums: agreement to ~1e-6 relative
    for f in L.LossSums._fields:
        np.testing.assert_allclose(np.asarray(getattr(on, f)), np.asarray(getattr(off, f)), rtol=1e-5, atol=1e-6)
    assert float(on.weight) > 0


def test_shards_stream_live_from_several_writers(tmp_path):
    """Three writer threads publish shards at random times while a reader consumes them; the
    reader sees every sample once, in the canonical order, and a restarted writer resumes."""
    meta = teacher_shards.ShardMeta(num_writers=3, shard_size=2, aux_layer_ids=(0,), hidden_size=2, aux_width=2,
                             dtype="float32", target="t", max_len=8)
    data = [Sample(f"x{i}", np.arange(3 + i % 4, dtype=np.int32), np.ones(3 + i % 4, bool)) for i in range(17)]
    got: list[str] = []

    def writer(k):
        rng = np.random.default_rng(k)
        w = teacher_shards.ShardWriter(tmp_path, k, meta)
        for s in data[k::3]:
            time.sleep(rng.uniform(0, 0.03))
            n = len(s.input_ids)
            w.add(s, np.full((n, 2), float(s.id[1:]), np.float32), np.zeros((n, 2), np.float32))
        w.finish()

    def reader():
        st = teacher_shards.ShardStream(tmp_path, poll_seconds=0.005, timeout_seconds=30)
        while True:
            ex = next(st)
            if st.position.epoch > 0:
                break
            assert float(ex.aux_SA[0, 0]) == float(ex.sample.id[1:])
            got.append(ex.sample.id)

    threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    canonical = [f"x{k + 3 * (2 * j + i)}" for j in range(3) for k in range(3) for i in range(2)
                 if k + 3 * (2 * j + i) < 17]
    assert got == canonical and sorted(got) == sorted(s.id for s in data)
    assert not list(tmp_path.glob(".*tmp*"))          # no temp files left behind

    # a writer killed after two shards (no .done) continues with its third
    d2 = tmp_path / "again"
    w = teacher_shards.ShardWriter(d2, 0, teacher_shards.ShardMeta(1, 2, (0,), 2, 2, "float32", "t", 8))
    for s in data[:5]:
        w.add(s, np.zeros((len(s.input_ids), 2), np.float32), np.zeros((len(s.input_ids), 2), np.float32))
    w2 = teacher_shards.ShardWriter(d2, 0, w.meta)
    assert w2.samples_done == 4 and w2.num_shards == 2


# ---------------------------------------------------------------------------------------------
# sharding


def test_one_and_eight_devices_give_the_same_loss(pair):
    devices = jax.devices()
    assert len(devices) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    target, draft = pair
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        ids = rng.integers(0, 90, 40).astype(np.int32)
        m = np.zeros(40, bool)
        m[8:] = True
        samples.append(Sample(str(i), ids, m))
    out = {}
    for name, devs in (("one", devices[:1]), ("eight", devices[:8])):
        cfg = T.TrainConfig(run_dir="unused", total_steps=3, global_batch=8, micro_batch=8, max_len=40, lr=1e-3,
                            compute_dtype="float32", export=False, loss=L.LossConfig(num_anchors=12))
        mesh = sharding.make_mesh(fsdp=len(devs), tensor=1, data=1, devices=devs)
        tr = T.Trainer(cfg, draft.cfg, target, online=True, mesh=mesh, init_draft=draft)
        batch = batches.collate([batches.Example(s) for s in samples], cfg, offline=False)
        w = tr.state.params["context_proj"]["weight"]
        out[name] = {"shards": len({str(s.index) for s in w.addressable_shards}),
                     "losses": [float(tr.step(batch)["loss"]) for _ in range(3)]}
    assert out["one"]["shards"] == 1 and out["eight"]["shards"] == 8       # the draft is FSDP-sharded
    # the trainers donated copies: the caller's draft is intact after steps on either mesh
    assert not [x for x in jax.tree.leaves(nnx.state(draft)) if x.is_deleted()]
    # three training steps; sharded reductions reorder fp32 sums: agreement to 1e-5 relative
    np.testing.assert_allclose(out["eight"]["losses"], out["one"]["losses"], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the program: kill and resume


def _distill_cmd(inputs, run_dir, steps):
    return [sys.executable, "-m", "train.distill", f"--target={inputs['target']}", f"--data={inputs['data']}",
            f"--draft_config={inputs['draft_config']}", f"--run_dir={run_dir}", f"--total_steps={steps}",
            "--global_batch=4", "--micro_batch=2", "--max_len=48", "--num_anchors=16", "--save_every=2",
            "--compute_dtype=float32", "--lr=1e-3", "--seed=7"]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_sigkill_then_resume_continues_exactly(pair, samples, tmp_path):
    inputs = write_tiny_run_inputs(tmp_path, pair, samples)
    steps = 8
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    kw = {"cwd": REPO, "env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    ref = subprocess.Popen(_distill_cmd(inputs, tmp_path / "ref", steps), **kw)
    victim = subprocess.Popen(_distill_cmd(inputs, tmp_path / "victim", steps), **kw)
    deadline = time.time() + 240
    while len(_metrics(tmp_path / "victim")) < 4:
        assert victim.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = len(_metrics(tmp_path / "victim"))
    assert killed_at < steps
    resumed = subprocess.run(_distill_cmd(inputs, tmp_path / "victim", steps), timeout=240, check=False, **kw)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step" in resumed.stdout
    ref_out, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, ref_out[-3000:]
    a, b = _metrics(tmp_path / "ref"), _metrics(tmp_path / "victim")
    assert [m["step"] for m in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        for k in ("loss", "ce", "l1", "bce", "grad_norm", "tau_probabilistic", "lr"):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
    assert (tmp_path / "victim" / "tb").is_dir() and list((tmp_path / "victim" / "tb").iterdir())
    exported = load_draft(next((tmp_path / "victim" / "export").iterdir()), dtype=jnp.float32)
    assert exported.cfg.target_layer_ids == pair[1].cfg.target_layer_ids


# ---------------------------------------------------------------------------------------------
# a short run


def test_short_run_lowers_loss_and_raises_tokens_per_forward(pair, samples, tmp_path):
    target, draft = pair
    prompts = [s.input_ids[:int(np.argmax(s.loss_mask))].tolist() for s in samples]
    # served tok/fwd before and after through one kept engine (its programs compiled once; that it
    # measures the weights it is given, as a fresh generate() would: tests/train/test_train_monitor.py)
    served = monitor.HeldOutEval(target, prompts, max_new_tokens=28)
    before = served(draft)["tok_per_fwd"]
    cfg = _cfg(tmp_path / "run", total_steps=40, lr=3e-3, warmup_frac=0.1, global_batch=8, micro_batch=4)
    tr = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft)
    hist = loop.run(tr, batches.SampleSource(samples, 0))
    first, last = np.mean([h["loss"] for h in hist[:3]]), np.mean([h["loss"] for h in hist[-3:]])
    after = served(tr.draft())["tok_per_fwd"]
    assert last < 0.7 * first, (first, last)
    assert after > before + 0.3, (before, after)


# ---------------------------------------------------------------------------------------------
# regen cache, torch export, TorchSpec


def test_regen_cache_resumes_and_masks_the_last_turn(pair, tmp_path):
    target, _ = pair
    tok = _CharTokenizer()
    recs = [{"id": f"r{i}", "source": "t", "messages": [{"role": "user", "content": "q" * (3 + i)}]} for i in range(3)]
    recs.append({"id": "r3", "source": "t", "messages": [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "old"},
                                                         {"role": "user", "content": "b"},
                                                         {"role": "assistant", "content": "dropped"}]})
    st = regen.RegenSettings(target="tiny", max_new_tokens=16, temperature=0.0, seed=0, chat_template_sha256="x")
    out = tmp_path / "regen.jsonl"
    regen.regenerate(target, tok, recs[:2], out, settings=st, batch_size=2)
    with open(out, "a") as f:
        f.write('{"id": "torn')                                  # killed mid-line
    counts = regen.regenerate(target, tok, recs, out, settings=st, batch_size=2)
    assert counts["cached_before"] == 2 and counts["written"] == 2
    rows = answer_cache.read_cache(out)
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert {r["dtype"] for r in rows} == {"float32"}                      # the target's compute dtype
    r3 = rows[3]
    assert r3["prompt_ids"] == tok.encode("<user>a<assistant>old<user>b<assistant>")   # trailing turn regenerated
    samples = list(regen.samples_from_cache(rows))
    for r, s in zip(rows, samples):
        assert s.loss_mask.sum() == len(r["answer_ids"]) == 16 and not s.loss_mask[:len(r["prompt_ids"])].any()
    assert list(regen.samples_from_cache(rows[:1], max_len=len(rows[0]["prompt_ids"]) + 13)) == []  # truncated
    short = dict(rows[0], answer_ids=rows[0]["answer_ids"][:13])
    assert list(regen.samples_from_cache([short])) == []                                  # < 14 loss tokens
    with pytest.raises(ValueError, match="other settings"):
        regen.regenerate(target, tok, recs, out, settings=regen.RegenSettings("tiny", 8, 0.0, 0, "x"))

    # a snapshot: the rows of the given prompts in that order, with the settings file
    snap = tmp_path / "first3.jsonl"
    assert regen.write_snapshot(out, ["r2", "r0", "r1"], snap) == 3
    assert answer_cache.read_cache(snap) == [rows[2], rows[0], rows[1]]
    assert answer_cache.meta_path(snap).read_text() == answer_cache.meta_path(out).read_text()
    with pytest.raises(ValueError, match="1 of the 2 prompts have no answer yet .first: 'r9'"):
        regen.write_snapshot(out, ["r0", "r9"], tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()


def test_regen_time_budget_answers_the_first_prompts_and_a_rerun_finishes(pair, tmp_path, monkeypatch):
    target, _ = pair
    tok = _CharTokenizer()
    recs = [{"id": f"r{i}", "source": "t", "messages": [{"role": "user", "content": "q" * (3 + i)}]} for i in range(6)]
    st = regen.RegenSettings(target="tiny", max_new_tokens=16, temperature=0.0, seed=0, chat_template_sha256="x")
    whole = tmp_path / "whole.jsonl"
    regen.regenerate(target, tok, recs, whole, settings=st, batch_size=2)
    clock = itertools.count()                   # every reading of the clock is one second later
    monkeypatch.setattr(regen, "time", SimpleNamespace(time=lambda: float(next(clock))))
    out = tmp_path / "budget.jsonl"
    counts = regen.regenerate(target, tok, recs, out, settings=st, batch_size=2, deadline=3.0)
    answered = sorted(r["id"] for r in answer_cache.read_cache(out))
    assert 0 < len(answered) < 6 and counts["unanswered"] == 6 - len(answered)
    assert answered == [f"r{i}" for i in range(len(answered))]        # the first prompts, whole answers
    monkeypatch.undo()
    assert regen.regenerate(target, tok, recs, out, settings=st, batch_size=2)["written"] == 6 - len(answered)
    by_id = {r["id"]: r["answer_ids"] for r in answer_cache.read_cache(whole)}
    assert {r["id"]: r["answer_ids"] for r in answer_cache.read_cache(out)} == by_id


def test_torchspec_checkpoint_maps_to_a_train_state(pair, tmp_path):
    import torch
    target, draft = pair
    cfg = _cfg(tmp_path / "run")
    tr = T.Trainer(cfg, draft.cfg, target, online=True, init_draft=draft)
    names = T.flat_names(tr.state.params)
    rng = np.random.default_rng(0)
    flat = {n: np.asarray(v.get_value()) for n, v in params_lib.flat_params(draft).items()}

    def theirs(n):   # TorchSpec's wrapper prefix and internal names
        n = n.replace("context_proj.", "fc.").replace("final_norm.", "norm.")
        return "draft_model." + n

    masters = {theirs(n): torch.tensor(flat[n] + 1.0) for n in names}
    state = {i: {"step": torch.tensor(17.0), "exp_avg": torch.tensor(rng.normal(size=flat[n].shape)),
                 "exp_avg_sq": torch.tensor(rng.random(flat[n].shape))} for i, n in enumerate(names)}
    ckpt = {"model_state": {"model": {theirs(n): torch.tensor(flat[n]).to(torch.bfloat16) for n in names}
                            | {"draft_model.embed_tokens.weight": torch.zeros(96, 32)}},
            "optim_state": {"optim": {"state": state, "param_groups": [{"params": list(range(len(names))), "lr": 1e-4}]},
                            "fp32_params": masters}}
    (tmp_path / "training_checkpoint").mkdir()
    torch.save(ckpt, tmp_path / "training_checkpoint" / "checkpoint_17.pt")
    torch.save({"model": {}}, tmp_path / "training_checkpoint" / "checkpoint_3.pt")
    ts = torchspec.read_torchspec_checkpoint(tmp_path, set(names))
    assert ts.step == 17
    params, opt = torchspec.to_train_state(ts, tr.state.params, tr.tx)
    tr.set_state(params, opt, ts.step)
    for i, n in enumerate(names):
        np.testing.assert_array_equal(np.asarray(_leaf(tr.state.params, n)), flat[n] + 1.0)
    from optax import tree_utils
    mu = tree_utils.tree_get(tr.state.opt_state, "mu")
    np.testing.assert_allclose(np.asarray(_leaf(mu, names[0])), state[0]["exp_avg"].numpy(), rtol=1e-6)
    assert [int(c) for _, c in tree_utils.tree_get_all_with_path(tr.state.opt_state, "count")] == [17, 17]
    with pytest.raises(torchspec.TorchSpecError, match="matches no draft parameter"):
        torchspec.map_name("draft_model.bogus.weight", set(names))


def _leaf(tree, name):
    for k in name.split("."):
        tree = tree[k]
    return tree


def test_export_and_init_from_round_trip(pair, tmp_path):
    _, draft = pair
    cfg = dict(draft.cfg.raw, torch_dtype="float32")
    save_torch_draft(draft, cfg, tmp_path / "d")
    back = load_draft(tmp_path / "d", dtype=jnp.float32)
    for n, p in params_lib.flat_params(draft).items():
        np.testing.assert_array_equal(np.asarray(params_lib.flat_params(back)[n].get_value()), np.asarray(p.get_value()))


def test_data_paths_keep_order_and_repeats(tmp_path):
    """`--data a,b,a` reads a twice (a k-fold oversampled mixture); a glob's matches come sorted;
    a part that names nothing is a usage error naming the flag."""
    from absl import app

    from train import paths
    for name in ("b.jsonl", "a-2.jsonl", "a-1.jsonl"):
        (tmp_path / name).write_text("")
    a, b = str(tmp_path / "a-1.jsonl"), str(tmp_path / "b.jsonl")
    assert paths.expand(f"{a},{b},{a}", flag="data", what="cache", exists=Path.is_file) == [a, b, a]
    assert paths.expand(f"{tmp_path}/a-*.jsonl, {b}", flag="data", what="cache", exists=Path.is_file) == \
        [a, str(tmp_path / "a-2.jsonl"), b]
    with pytest.raises(app.UsageError, match="--data: no cache at"):
        paths.expand(f"{a},{tmp_path}/missing.jsonl", flag="data", what="cache", exists=Path.is_file)
