"""Reduced draft vocabulary (`draft_vocab_size` K < `vocab_size` V, EAGLE-3 `d2t`/`t2d` map):
config, inventory, byte-exact conversion, the restricted block pass against the torch reference,
lossless greedy and sampled verification, the loss bucket, and the frequency-based choice of K."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_jax.checkpoint.draft_convert import convert_draft
from dspark_jax.checkpoint.draft_io import load_draft, save_torch_draft
from dspark_jax.checkpoint.draft_layout import draft_inventory
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config.keys import ConfigError
from dspark_jax.config.draft import DraftConfig
from dspark_jax.decode import steps
from dspark_jax.decode.generate import generate
from dspark_jax.sampling import SamplingParams
from dspark_jax.train import vocab as vocab_lib
from dspark_jax.train.loss import token_terms
from tests.draft_utils import (
    K_TINY,
    KEPT_TINY,
    METADATA,
    TINY,
    draft_inputs,
    make_reduced_torch_draft,
    make_torch_draft,
)
from tests.float64 import assert_f32_close, x64
from tests.gen_utils import chi2_pvalue, prompts, same_tokens, tiny_draft, tiny_k3, tiny_llama

# ---------------------------------------------------------------------------------------------
# config, inventory, conversion


def test_config_and_inventory_of_a_reduced_draft():
    cfg = DraftConfig.from_dict(dict(TINY, draft_vocab_size=K_TINY))
    assert cfg.reduced_vocab and cfg.draft_vocab == K_TINY and cfg.vocab_size == 96
    inv = {t.name: t for t in draft_inventory(cfg).tensors}
    assert inv["d2t"].dtype == "I64" and inv["d2t"].shape == (K_TINY,)
    assert inv["t2d"].dtype == "BOOL" and inv["t2d"].shape == (96,)
    assert inv["markov_head.markov_w2.weight"].shape == (K_TINY, 6)      # output side: K rows
    assert inv["markov_head.markov_w1.weight"].shape == (96, 6)          # input side: all V
    full = {t.name: t for t in draft_inventory(DraftConfig.from_dict(TINY)).tensors}
    assert set(inv) - set(full) == {"d2t", "t2d"}
    assert not DraftConfig.from_dict(TINY).reduced_vocab                 # absent/equal: unchanged
    for bad in (0, 97):
        with pytest.raises(ConfigError, match="draft_vocab_size"):
            DraftConfig.from_dict(dict(TINY, draft_vocab_size=bad))


def test_reduced_draft_roundtrip_is_byte_identical(tmp_path):
    src, orb, back = tmp_path / "torch", tmp_path / "orbax", tmp_path / "back"
    make_reduced_torch_draft(src)
    assert convert_draft(src, orb, check=True) == "torch->orbax"
    assert convert_draft(orb, back, check=True) == "orbax->torch"
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    # both layouts load with the map; saving the model writes the same map tensors again
    for path in (src, orb):
        draft = load_draft(path, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(draft.draft_token_ids()), KEPT_TINY)
    cfg_dict = json.loads((src / "config.json").read_text())
    save_torch_draft(draft, cfg_dict, tmp_path / "saved")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert a["d2t"].dtype == torch.int64 and a["t2d"].dtype == torch.bool
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    assert b["d2t"].dtype == torch.int64 and b["t2d"].dtype == torch.bool


@pytest.mark.parametrize("case", ["t2d_disagrees", "d2t_unsorted", "d2t_missing", "map_on_full_vocab"])
def test_bad_vocab_map_is_named(tmp_path, case):
    src = tmp_path / "torch"
    make_reduced_torch_draft(src)
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if case == "t2d_disagrees":
        t2d = tensors["t2d"].clone()
        t2d[int(np.setdiff1d(np.arange(96), KEPT_TINY)[0])] = True
        tensors["t2d"], want = t2d, "'t2d' disagrees with 'd2t'"
    elif case == "d2t_unsorted":
        ids = KEPT_TINY.copy()
        ids[[3, 4]] = ids[[4, 3]]
        tensors["d2t"] = torch.from_numpy(ids - np.arange(K_TINY))
        want = "'d2t' target ids are not strictly increasing"
    elif case == "d2t_missing":
        del tensors["d2t"]
        want = "missing tensor 'd2t'.*draft_vocab_size=40 < vocab_size=96"
    else:
        cfg["draft_vocab_size"] = 96
        tensors["markov_head.markov_w2.weight"] = torch.zeros(96, 6, dtype=torch.bfloat16)
        want = "unexpected tensor 'd2t'"
    save_file(tensors, str(src / "model.safetensors"), metadata=METADATA)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=want):
        load_draft(src)


def test_restricted_block_forward_matches_torch_reference(tmp_path):
    """The reduced draft's logits are the reference's full-vocab logits at the kept ids (the
    gathered lm_head rows), and its greedy Markov drafts are the argmax over the kept ids with
    W2 restricted to them, returned as target ids."""
    ref, embed = make_reduced_torch_draft(tmp_path / "d", dtype=torch.float32, seed=3)
    draft = load_draft(tmp_path / "d", dtype=jnp.float32)
    aux, lm_head = draft_inputs(0)
    anchor, t = 17, 7
    base_r, _, _ = ref.block_forward(torch.from_numpy(aux), anchor, embed, torch.from_numpy(lm_head), t)
    base, drafts, _ = draft.block_forward(aux, anchor, embed.numpy(), lm_head, num_speculative_tokens=t)
    assert base.shape == (t, K_TINY)
    assert_f32_close(np.asarray(base), base_r.numpy()[:, KEPT_TINY], "reduced draft logits vs reference")
    w1 = ref.markov_head.markov_w1.weight.detach().numpy()
    w2k = ref.markov_head.markov_w2.weight.detach().numpy()[KEPT_TINY]
    prev, want = anchor, []
    for k in range(t):
        biased = base_r.numpy()[k, KEPT_TINY] + w1[prev] @ w2k.T
        top2 = np.sort(biased)[-2:]
        assert top2[1] - top2[0] > 1e-3                     # no near-tie decides the comparison
        prev = int(KEPT_TINY[np.argmax(biased)])
        want.append(prev)
    np.testing.assert_array_equal(np.asarray(drafts), want)


def test_remap_vocabulary_of_a_full_draft_equals_the_cut_checkpoint(tmp_path):
    """`remap_vocabulary` (train.distill --init_from FULL --draft_vocab) gives the draft an
    EAGLE-3-style trainer would save from the same weights: markov_w2 cut to the kept rows, the
    map set, everything else unchanged."""
    from dspark_jax import params as params_lib
    from dspark_jax.models.draft_surgery import remap_vocabulary
    make_torch_draft(tmp_path / "full", dtype=torch.float32, seed=3)
    make_reduced_torch_draft(tmp_path / "cut", dtype=torch.float32, seed=3)
    full = load_draft(tmp_path / "full", dtype=jnp.float32)
    small = remap_vocabulary(full, KEPT_TINY)
    want = load_draft(tmp_path / "cut", dtype=jnp.float32)
    assert small.cfg.draft_vocab == K_TINY and small.cfg.vocab_size == full.cfg.vocab_size
    np.testing.assert_array_equal(np.asarray(small.draft_token_ids()), KEPT_TINY)
    got, ref = params_lib.flat_params(small), params_lib.flat_params(want)
    assert sorted(got) == sorted(ref)
    for name in ref:
        np.testing.assert_array_equal(np.asarray(got[name].get_value()), np.asarray(ref[name].get_value()), name)
    aux, lm_head = draft_inputs(0)
    a = small.block_forward(aux, 17, np.zeros((96, TINY["hidden_size"]), np.float32), lm_head)
    b = want.block_forward(aux, 17, np.zeros((96, TINY["hidden_size"]), np.float32), lm_head)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_remap_vocabulary_of_a_reduced_draft_keeps_the_shared_rows(tmp_path):
    """A reduced draft moved to another vocabulary (train.distill --init_from REDUCED --draft_vocab
    NEW, e.g. one chosen over a wider answer set): markov_w2 row i is the old row of the same
    target id where the old vocabulary held it and zero where it did not; every other parameter is
    unchanged; and moving back to the old vocabulary restores the draft exactly."""
    from dspark_jax import params as params_lib
    from dspark_jax.models.draft_surgery import remap_vocabulary
    make_reduced_torch_draft(tmp_path / "cut", dtype=torch.float32, seed=5)
    old = load_draft(tmp_path / "cut", dtype=jnp.float32)
    rest = np.setdiff1d(np.arange(96), KEPT_TINY)
    new_ids = np.sort(np.concatenate([KEPT_TINY[::2], rest[:30]]))        # half the old ids, 30 new ones
    moved = remap_vocabulary(old, new_ids)
    assert moved.cfg.draft_vocab == new_ids.size
    np.testing.assert_array_equal(np.asarray(moved.draft_token_ids()), new_ids)
    w2_old = np.asarray(old.markov_head.markov_w2.weight.get_value())
    w2_new = np.asarray(moved.markov_head.markov_w2.weight.get_value())
    for i, tid in enumerate(new_ids):
        where = np.flatnonzero(KEPT_TINY == tid)
        want = w2_old[where[0]] if where.size else np.zeros(w2_old.shape[1], np.float32)
        np.testing.assert_array_equal(w2_new[i], want, f"row of target id {tid}")
    assert np.any(w2_new != 0)
    got, ref = params_lib.flat_params(moved), params_lib.flat_params(old)
    for name in ref:
        if name != "markov_head.markov_w2.weight":
            np.testing.assert_array_equal(np.asarray(got[name].get_value()), np.asarray(ref[name].get_value()), name)
    # the old vocabulary from a superset of it: the draft exactly as it was
    wide = remap_vocabulary(old, np.union1d(KEPT_TINY, rest[:10]))
    back = remap_vocabulary(wide, KEPT_TINY)
    np.testing.assert_array_equal(np.asarray(back.markov_head.markov_w2.weight.get_value()), w2_old)


# ---------------------------------------------------------------------------------------------
# verification stays lossless


def _kept(vocab: int, k: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(vocab, k, replace=False))


@pytest.mark.parametrize("family", ["llama", "k3"])
def test_lossless_greedy_with_reduced_vocab(family):
    if family == "llama":
        target = tiny_llama(0)
        draft = tiny_draft(target, 1, kept_ids=_kept(96, 48, 0))
        ps, n_new, t = prompts(4, 96, seed=5), 24, 7
    else:
        target = tiny_k3(0)
        v = target.cfg.vocab_size
        draft = tiny_draft(target, 1, layer_ids=(1, 3), kept_ids=_kept(v, v // 2, 0))
        ps, n_new, t = prompts(4, v, seed=6, hi=16), 12, 5
    kept = set(np.asarray(draft.draft_token_ids()).tolist())
    plain = generate(target, None, ps, max_new_tokens=n_new)
    spec = generate(target, draft, ps, max_new_tokens=n_new, num_speculative_tokens=t)
    same_tokens(plain, spec)
    # every proposal is a kept target id (not a draft index), checked below; on llama the drafts
    # were also accepted (the random k3 pair accepts none on these 4 prompts: its equality
    # check still covers the rejection path)
    if family == "llama":
        assert spec.stats["total_accepted_tokens"] > 0
    from dspark_jax.decode.config import EngineConfig
    from dspark_jax.decode.engine import Engine
    eng = Engine(target, draft, EngineConfig(num_speculative_tokens=t))
    caches = eng.new_caches(2, 64)
    toks = jnp.asarray([p[:4] + [0] * (8 - 4) for p in ps[:2]], jnp.int32)
    first, caches = eng.prefill(toks, jnp.asarray([4, 4], jnp.int32), jnp.arange(2, dtype=jnp.int32), caches,
                                jax.random.PRNGKey(0))
    lens = jnp.asarray([4, 4], jnp.int32)
    # the engine gathers the kept lm_head rows once; gathering them inside the program drafts the same
    from dspark_jax.decode.engine import embed_and_head
    np.testing.assert_array_equal(np.asarray(eng.draft_head), np.asarray(embed_and_head(target)[1])[sorted(kept)])
    inside, *_ = eng.propose_jit(eng.t_state, eng.d_state, first, lens, jax.tree.map(jnp.copy, caches),
                                 jax.random.PRNGKey(1))
    drafts, logits, _, _ = eng.propose(first, lens, caches, jax.random.PRNGKey(1))
    np.testing.assert_array_equal(np.asarray(drafts), np.asarray(inside))
    assert set(np.asarray(drafts).ravel().tolist()) <= kept
    assert logits.shape[-1] == target.cfg.vocab_size
    outside = np.setdiff1d(np.arange(target.cfg.vocab_size), sorted(kept))
    assert np.all(np.isneginf(np.asarray(logits)[..., outside]))


def test_draft_logits_over_the_target_vocabulary_are_minus_inf_outside_the_kept_set():
    """`gather_to_target`: draft index k's logit lands at its target id, -inf elsewhere, over any
    leading dimensions (what rejection sampling reads as the draft's distribution)."""
    target = tiny_llama(0)
    kept = _kept(96, 40, 3)
    draft = tiny_draft(target, 1, kept_ids=kept)
    logits = np.random.default_rng(2).normal(size=(2, 3, kept.size)).astype(np.float32)
    want = np.full((2, 3, 96), -np.inf, np.float32)
    want[..., kept] = logits
    np.testing.assert_array_equal(np.asarray(draft.gather_to_target(jnp.asarray(logits))), want)


def test_accept_sampling_with_zero_draft_mass_outside_the_kept_set():
    """The rejection sampler with q = 0 outside a kept set (-inf draft logits), drafts drawn from
    q: the emitted token at each position is distributed as p (chi-square, N=40000, alpha=1e-3).
    Power: the target puts >= 0.2 mass outside the kept set at every position, and the residual
    is the only way tokens outside it can be emitted; a sampler that drops it (emits only kept
    tokens after a rejection) is off by >= 0.2 in that mass, ~60 sigma at this N."""
    v, t, n = 8, 3, 40000
    rng = np.random.default_rng(0)
    kept = np.array([0, 2, 3, 6])
    tl = jnp.asarray(rng.normal(size=(t + 1, v)) * 1.5, jnp.float32)
    dl_k = rng.normal(size=(t, kept.size)) * 1.5
    dl = np.full((t, v), -np.inf, np.float32)
    dl[:, kept] = dl_k
    dl = jnp.asarray(dl)
    keys = jax.random.split(jax.random.PRNGKey(0), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, dl, axis=-1)
        acc = steps.accept_sampling(tl[None], dl[None], drafts[None], SamplingParams(1.0, 1.0), ka)
        return acc.num_accepted_B[0], acc.emitted_BT1[0]

    nacc, emitted = map(np.asarray, jax.jit(jax.vmap(one))(keys))
    p = np.asarray(jax.nn.softmax(tl, -1), np.float64)
    outside = np.setdiff1d(np.arange(v), kept)
    for pos in range(t + 1):
        got = emitted[nacc >= pos][:, pos]
        assert chi2_pvalue(np.bincount(got, minlength=v), p[pos]) > 1e-3, pos
        assert p[pos, outside].sum() >= 0.2
    assert nacc.mean() > 0.3                                  # drafts were accepted too


def _exact_marginals(target, prompt, temperature):
    """P(1st token), P(2nd token) under the target's own sampling at `temperature`, enumerated."""
    v = target.cfg.vocab_size
    p1 = np.asarray(jax.nn.softmax(target.forward(jnp.asarray([prompt])).logits[0, -1] / temperature), np.float64)
    batch = jnp.asarray([prompt + [t] for t in range(v)])
    p2 = np.asarray(jax.nn.softmax(target.forward(batch).logits[:, -1] / temperature, -1), np.float64)
    return p1, p1 @ p2


def test_speculative_sampling_with_reduced_vocab_matches_target_distribution():
    """End to end, vocab 12, the draft keeps 6 ids: 2000 sampled continuations at temperature 20
    (the tiny target's logits span ~50, so T=1 would be a point mass and test nothing); the first
    and second tokens (the second is the first one a speculative step emits) follow the target's
    exact marginals (chi-square, alpha=1e-3). Power: the target gives the 6 dropped ids >= 0.3 of
    the second token's mass (checked), which only the residual p - q can emit; a sampler that
    lost it would be off by >= 0.3 in that mass, ~30 sigma at N=2000."""
    target = tiny_llama(3, vocab=12)
    kept = np.array([1, 2, 4, 5, 8, 11])
    draft = tiny_draft(target, 4, kept_ids=kept)
    prompt, temp = [1, 5, 7, 2], 20.0
    p1, p2 = _exact_marginals(target, prompt, temp)
    dropped = np.setdiff1d(np.arange(12), kept)
    assert p2[dropped].sum() > 0.3
    n = 2000
    res = generate(target, draft, [prompt] * n, max_new_tokens=3, temperature=temp,
                   num_speculative_tokens=3, seed=11)
    first = np.array([o.token_ids[0] for o in res.outputs])
    second = np.array([o.token_ids[1] for o in res.outputs])
    assert chi2_pvalue(np.bincount(first, minlength=12), p1) > 1e-3
    assert chi2_pvalue(np.bincount(second, minlength=12), p2) > 1e-3
    assert res.stats["total_accepted_tokens"] > 0.1 * res.stats["total_draft_tokens"]


# ---------------------------------------------------------------------------------------------
# loss


def test_loss_bucket_l1_is_total_variation_by_hand():
    """K = 3 kept ids of V = 6, float64: L1 is twice the total-variation distance between the
    draft's distribution over target ids (zero outside the kept set) and the target's, computed
    by hand; acceptance = sum min(p, q); CE of a label outside the kept set is 0 (dropped), of a
    kept label -log q; top-1 comes back as target ids."""
    with x64():
        ids = jnp.asarray([0, 2, 5], jnp.int32)
        rng = np.random.default_rng(1)
        d = rng.normal(size=(1, 1, 2, 3))
        tg = rng.normal(size=(1, 1, 2, 6)) * 2
        labels = jnp.asarray([[[2, 3]]])              # kept, outside
        terms = token_terms(jnp.asarray(d), jnp.asarray(tg), None, labels, ids)
        q = np.exp(d) / np.exp(d).sum(-1, keepdims=True)
        p = np.exp(tg) / np.exp(tg).sum(-1, keepdims=True)
        q_full = np.zeros_like(p)
        q_full[..., [0, 2, 5]] = q
        tv = 0.5 * np.abs(q_full - p).sum(-1)
        assert np.asarray(terms.l1).dtype == np.float64
        np.testing.assert_allclose(np.asarray(terms.l1), 2 * tv, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(terms.accept), np.minimum(p, q_full).sum(-1), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(terms.ce)[0, 0], [-np.log(q[0, 0, 0, 1]), 0.0], rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(terms.draft_top1), np.asarray([0, 2, 5])[q.argmax(-1)])
        # the full-vocabulary path is the same formula with every id kept
        full = token_terms(jnp.asarray(np.log(q_full + 1e-300)), jnp.asarray(tg), None, labels)
        np.testing.assert_allclose(np.asarray(full.l1), 2 * tv, rtol=1e-12)


def test_distill_outputs_with_a_reduced_draft_uses_kept_rows_only():
    """The multi-anchor loss on a reduced draft (float32): the teacher's logits stay over V while
    the draft's are over K; the loss and the gradient of the K-row markov_w2 are finite, the
    gradient is nonzero, and the draft's top-1 comes back as kept target ids."""
    from flax import nnx

    from dspark_jax.decode.engine import embed_and_head
    from dspark_jax.train.loss import LossConfig, distill_outputs
    target = tiny_llama(0)
    kept = _kept(96, 48, 3)
    draft = tiny_draft(target, 1, kept_ids=kept)
    ids = jnp.asarray([prompts(1, 96, seed=2, lo=30, hi=31)[0]], jnp.int32)
    out = target.forward(ids, aux_layer_ids=draft.cfg.target_layer_ids)
    mask = jnp.ones_like(ids).at[:, :5].set(0)
    embed, head = embed_and_head(target)
    cfg = LossConfig(block_size=4, num_anchors=6)

    def loss(d):
        res = distill_outputs(d, embed, head, ids, mask, out.aux_hidden, out.final_hidden,
                              jax.random.PRNGKey(0), cfg)
        return res.sums.numerator / res.sums.weight, res

    (value, res), grads = nnx.value_and_grad(loss, has_aux=True)(draft)
    assert np.isfinite(float(value)) and float(res.sums.weight) > 0
    assert set(np.asarray(res.terms.draft_top1).ravel().tolist()) <= set(kept.tolist())
    g = grads["markov_head"]["markov_w2"]["weight"].get_value()
    assert g.shape == (48, 8) and np.all(np.isfinite(np.asarray(g))) and float(jnp.abs(g).sum()) > 0


# ---------------------------------------------------------------------------------------------
# choosing K


def test_select_vocab_smallest_frequent_set():
    counts = np.array([5, 0, 50, 20, 20, 5], np.int64)       # total 100
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.5), [2])
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.7), [2, 3])       # tie 3/4: smaller id
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.71), [2, 3, 4])
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.9, always=[1]), [1, 2, 3, 4])
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.95), [0, 2, 3, 4])        # exactly reached
    np.testing.assert_array_equal(vocab_lib.select_vocab(counts, 0.96), [0, 2, 3, 4, 5])
    assert vocab_lib.coverage_of([2, 3, 4], counts) == 0.9


def test_choose_from_rows_reports_heldout_coverage_and_cli(tmp_path):
    rng = np.random.default_rng(0)
    zipf = np.minimum(rng.zipf(1.3, size=(400, 60)), 200) - 1        # heavy-tailed answer tokens
    rows = [{"id": f"r{i}", "answer_ids": zipf[i].tolist(), "kept": True, "prompt_ids": [1]} for i in range(400)]
    rows.append({"id": "dropped", "answer_ids": [199] * 1000, "kept": False, "prompt_ids": [1]})
    choice = vocab_lib.choose_from_rows(rows, 200, 0.9, heldout_fraction=0.2, always=[7])
    assert choice.train_coverage >= 0.9 and 7 in choice.token_ids
    assert choice.heldout_tokens > 0 and 0.8 < choice.heldout_coverage <= 1.0
    assert choice.train_tokens + choice.heldout_tokens == 400 * 60     # the dropped row is not counted
    assert choice.token_ids == sorted(choice.token_ids)
    # without the last kept id (other than forced ones) the training coverage falls below 0.9
    counts = vocab_lib.token_counts([r["answer_ids"] for r in rows[:-1] if not vocab_lib.is_heldout(r["id"], 0.2)], 200)
    least = min((i for i in choice.token_ids if i != 7), key=lambda i: (counts[i], -i))
    assert vocab_lib.coverage_of([i for i in choice.token_ids if i != least], counts) < 0.9
    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "train.vocab", f"--data={data}", "--vocab_size=200",
                          "--coverage=0.9", "--heldout=0.2", "--always=7", f"--out={tmp_path / 'v.json'}"],
                         cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"K = {choice.k} of 200" in out.stdout and "held-out" in out.stdout
    assert vocab_lib.read_choice(tmp_path / "v.json") == choice.token_ids
    # --min_size: the coverage set, then more answer tokens by count, then unseen ids from the smallest
    seen = set(np.flatnonzero(counts).tolist())
    big = vocab_lib.choose_from_rows(rows, 200, 0.9, heldout_fraction=0.2, always=[7], min_size=len(seen) + 5)
    assert set(choice.token_ids) <= set(big.token_ids) and seen <= set(big.token_ids)
    assert big.token_ids == sorted(seen | set(sorted(set(range(200)) - seen)[:5]) | {7})
    out = subprocess.run([sys.executable, "-m", "train.vocab", f"--data={data}", "--vocab_size=200",
                          "--coverage=0.9", "--heldout=0.2", "--always=7", f"--min_size={len(seen) + 5}",
                          f"--out={tmp_path / 'v2.json'}"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert vocab_lib.read_choice(tmp_path / "v2.json") == big.token_ids
