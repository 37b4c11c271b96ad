"""The DSpark draft (docs/architecture.md §3) and its converters: byte-identical torch <-> Orbax round trips, numerics
against an independent torch reference, the abstract full-size inventory, YaRN constants, and clear
errors (with nothing left behind) on bad input."""

import os

# The sharded-load test wants 8 host devices; `make test` sets this, a bare `pytest` gets it here.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import copy
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from dspark_jax import sharding
from dspark_jax.checkpoint import draft_io, orbax_io
from dspark_jax.checkpoint.draft_convert import convert_draft, orbax_to_torch, torch_to_orbax
from dspark_jax.checkpoint.draft_io import load_draft
from dspark_jax.checkpoint.draft_layout import abstract_draft, draft_inventory
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config.keys import ConfigError, yarn_mscale
from dspark_jax.config.draft import DraftConfig
from dspark_jax.layers.rope import yarn_correction_range
from dspark_jax.params import flat_params
from tests.draft_utils import METADATA, draft_inputs, make_torch_draft
from tests.float64 import TABLE_ULPS, TorchFloat64, assert_close, ulps, x64
from tests.torch_ref_dspark import DSparkDraftRef, yarn_tables

REPO = Path(__file__).resolve().parents[2]
K3_DRAFT_JSON = REPO / "dspark_jax" / "configs" / "kimi-k3-dspark.json"


def _leftovers(dst: Path) -> list[Path]:
    return [p for p in dst.parent.glob(f".{dst.name}*")]


# ---------------------------------------------------------------------------------------------
# (1) byte-identical round trip


@pytest.mark.parametrize("with_embed", [True, False])
def test_roundtrip_torch_orbax_torch_is_byte_identical(tmp_path, with_embed):
    src, orb, back = tmp_path / "torch", tmp_path / "orbax", tmp_path / "back"
    make_torch_draft(src, dtype=torch.bfloat16, with_embed=with_embed)
    assert convert_draft(src, orb, check=True) == "torch->orbax"
    assert convert_draft(orb, back, check=True) == "orbax->torch"
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert sorted(p.name for p in back.iterdir()) == ["config.json", "model.safetensors"]
    assert not _leftovers(orb) and not _leftovers(back)
    # the Orbax side is a plain Orbax checkpoint of the tensors in their stored dtype
    tree = ocp.load(orb / "params")
    theirs = load_file(str(src / "model.safetensors"))
    assert ("embed_tokens" in tree) == with_embed
    w = np.asarray(tree["layers"]["1"]["self_attn"]["kv_b_proj"]["weight"])
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(w.view(np.uint16),
                                  theirs["layers.1.self_attn.kv_b_proj.weight"].view(torch.int16).numpy()
                                  .view(np.uint16))


def test_trained_state_in_orbax_exports_torchspec_file(tmp_path):
    """An Orbax dir without the layout file, as training writes it (the NNX param state as a pure
    dict of jax arrays under params/, config.json beside), exports with the order and metadata of
    torch's save_file: the same bytes TorchSpec would have written."""
    src, orb, back = tmp_path / "torch", tmp_path / "orbax", tmp_path / "back"
    make_torch_draft(src, dtype=torch.bfloat16, with_embed=False)
    state = nnx.to_pure_dict(nnx.state(load_draft(src), nnx.Param))
    orb.mkdir()
    ocp.save(orb / "params", state)
    (orb / "config.json").write_bytes((src / "config.json").read_bytes())
    orbax_to_torch(orb, back, check=True)
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


@pytest.mark.parametrize("save_bytes, load_bytes", [(256, 256), (256, 1000), (40, 256)])
def test_tensors_bigger_than_a_chunk_stream_in_bands(tmp_path, monkeypatch, save_bytes, load_bytes):
    """With a tiny band size (`CHUNK_BYTES`) most tensors move in row bands: stored as several
    Orbax chunks (the last one short; at 40 bytes a 64-byte row is a chunk of its own), read
    back in bands of whole chunks (also when the band size differs from the one they were
    written with), and never read whole; the round trip stays byte-identical, Orbax restores
    the arrays, and load_draft reads them."""
    src, orb, back = tmp_path / "torch", tmp_path / "orbax", tmp_path / "back"
    make_torch_draft(src, dtype=torch.bfloat16)
    pieces = []                                    # (tensor, rows, bytes) of every read

    def recording(cls):
        real = cls.read

        def read(self, name, rows=None, out=None):
            arr = real(self, name, rows, out)
            pieces.append((name, rows, arr.nbytes))
            return arr
        monkeypatch.setattr(cls, "read", read)

    recording(draft_io.TorchDraft)
    recording(draft_io.OrbaxDraft)
    monkeypatch.setattr(draft_io, "CHUNK_BYTES", save_bytes)
    torch_to_orbax(src, orb, check=True)
    monkeypatch.setattr(draft_io, "CHUNK_BYTES", load_bytes)
    orbax_to_torch(orb, back, check=True)
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()

    theirs = load_file(str(src / "model.safetensors"))
    stored = orbax_io.flatten(ocp.metadata(orb / "params").metadata)
    tree = orbax_io.flatten(ocp.load(orb / "params"))
    banded = 0
    for name, t in theirs.items():
        nbytes, row = t.numel() * 2, t[0].numel() * 2
        chunk = stored[name].storage_metadata.chunk_shape
        assert tuple(chunk[1:]) == tuple(t.shape[1:])          # chunks are bands of full rows
        if nbytes > save_bytes and t.shape[0] > 1:
            assert chunk[0] < t.shape[0] and chunk[0] * row <= save_bytes + row
            banded += 1
        else:
            assert chunk[0] == t.shape[0]
        assert tree[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(tree[name].view(np.uint16), t.view(torch.int16).numpy().view(np.uint16))
        # tensors bigger than the band are only ever read in pieces that are whole rows
        for _, rows, got in (p for p in pieces if p[0] == name):
            if nbytes > max(save_bytes, load_bytes) + row:
                assert rows is not None and got < nbytes and got <= max(save_bytes, load_bytes) + row
    assert banded >= 20
    # the tiny placeholders Orbax wrote first are gone: every array has its real shape
    assert {n: tuple(m.shape) for n, m in stored.items()} == {n: tuple(t.shape) for n, t in theirs.items()}
    a, b = flat_params(load_draft(src)), flat_params(load_draft(orb))
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k].get_value()), np.asarray(b[k].get_value()))


def test_failure_mid_stream_waits_for_band_writes_and_leaves_nothing(tmp_path, monkeypatch):
    """A source read failing while earlier bands are still being written: the error is raised
    and the staging dir is removed only after those writes finish (nothing recreated)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_torch_draft(src, dtype=torch.bfloat16)
    monkeypatch.setattr(draft_io, "CHUNK_BYTES", 256)
    calls, real = [], draft_io.TorchDraft.read

    def failing(self, name, rows=None, out=None):
        calls.append(name)
        if len(calls) == 40:
            raise CheckpointError(f"injected failure reading {name!r}")
        return real(self, name, rows, out)

    monkeypatch.setattr(draft_io.TorchDraft, "read", failing)
    with pytest.raises(CheckpointError, match="injected failure"):
        torch_to_orbax(src, dst)
    assert len(calls) == 40 and not dst.exists() and not _leftovers(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---------------------------------------------------------------------------------------------
# (2) numerics against the torch reference


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    ref, embed = make_torch_draft(root / "torch", seed=3)
    torch_to_orbax(root / "torch", root / "orbax")
    return root, ref, embed


def _float64_reference(ref: DSparkDraftRef, inv_freq: np.ndarray) -> DSparkDraftRef:
    """A float64 copy of the torch reference holding our float32 YaRN table (both build it in
    float32 from docs/architecture.md §3.4; checked to agree to TABLE_ULPS here and for the K3 draft in
    test_k3_yarn_constants_reach_the_attention), so the float64 comparison is not decided by the
    last bit of two pow() implementations."""
    ref64 = copy.deepcopy(ref).double()
    for layer in ref64.layers:
        assert np.all(ulps(inv_freq, layer.self_attn.inv_freq.numpy()) <= TABLE_ULPS)
        layer.self_attn.inv_freq = torch.from_numpy(np.array(inv_freq, np.float64))
    return ref64


def test_block_forward_matches_torch_reference(tiny_f32):
    """Float64 on both sides (tests/float64.py): the reference runs `.double()` under
    TorchFloat64 (its `.float()` casts become float64), our draft under x64 from the same
    float32 checkpoint (torch and Orbax layouts)."""
    root, ref, embed = tiny_f32
    aux, lm_head = draft_inputs(0)
    aux, lm_head = aux.astype(np.float64), lm_head.astype(np.float64)
    anchor, t = 17, 7
    with x64():
        drafts64 = [load_draft(path, dtype=jnp.float64) for path in (root / "torch", root / "orbax")]
    ref = _float64_reference(ref, drafts64[0].layers[0].self_attn.rope.inv_freq)
    embed = embed.double()
    with torch.no_grad(), TorchFloat64():
        base_r, drafts_r, conf_r = ref.block_forward(torch.from_numpy(aux), anchor, embed,
                                                     torch.from_numpy(lm_head), t)
    # the greedy drafts are only comparable if no step is a near-tie
    w1, w2 = ref.markov_head.markov_w1.weight.detach(), ref.markov_head.markov_w2.weight.detach()
    prevs = [anchor] + drafts_r[:-1].tolist()
    biased = torch.stack([base_r[k] + w1[p] @ w2.T for k, p in enumerate(prevs)])
    top2 = torch.topk(biased, 2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
    # and the Markov bias must matter here, else the test would not see a broken head
    assert (biased.argmax(-1) != base_r.argmax(-1)).any()

    for draft in drafts64:
        with x64():
            base, drafts, conf = draft.block_forward(aux, anchor, embed.numpy(), lm_head, num_speculative_tokens=t)
        assert_close(np.asarray(base), base_r, "base logits")
        np.testing.assert_array_equal(np.asarray(drafts), drafts_r.numpy())
        assert_close(np.asarray(conf), conf_r, "confidence")


def test_torch_and_orbax_loads_are_identical_and_dtype_cast(tiny_f32, tmp_path):
    root, _, _ = tiny_f32
    a = flat_params(load_draft(root / "torch"))
    b = flat_params(load_draft(root / "orbax"))
    assert a.keys() == b.keys() and "embed_tokens.weight" not in a
    for k in a:
        assert a[k].get_value().dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a[k].get_value()), np.asarray(b[k].get_value()))
    # a bf16 checkpoint loads as bf16, or as float32 on request
    make_torch_draft(tmp_path / "bf16", seed=3, dtype=torch.bfloat16)
    assert load_draft(tmp_path / "bf16").context_proj.weight.get_value().dtype == jnp.bfloat16
    up = load_draft(tmp_path / "bf16", dtype=jnp.float32).context_proj.weight.get_value()
    assert up.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(up), np.asarray(a["context_proj.weight"].get_value()), rtol=1e-2)


def test_sharded_load_matches_single_device(tiny_f32):
    """load_draft places every tensor straight into its logical-axis sharding (heads / mlp /
    vocab over `tensor`), and the sharded block pass equals the single-device one."""
    root, _, embed = tiny_f32
    n = len(jax.devices())
    mesh = sharding.make_mesh(tensor=n, fsdp=1, data=1)
    sharded = load_draft(root / "orbax", dtype=jnp.float32, mesh=mesh)
    spec = sharded.layers[0].self_attn.q_b_proj.weight.get_value().sharding.spec
    assert spec[0] == ("tensor" if n > 1 else None)   # 4 heads x 16 = 64 rows split over the devices
    aux, lm_head = draft_inputs(2)
    single = load_draft(root / "orbax", dtype=jnp.float32)
    got = sharded.block_forward(aux, 5, embed.numpy(), lm_head, 7)
    want = single.block_forward(aux, 5, embed.numpy(), lm_head, 7)
    # same fp32 math, different partial-sum order across devices
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_batched_pieces_match_block_forward_and_mask_context(tiny_f32):
    """context_rows + block_hidden + markov_sample_greedy + confidence (the batched API that
    steps.py and training use) with a context mask equal block_forward on the visible prefix; the
    absorbed and expanded MLA forms agree."""
    root, _, embed = tiny_f32
    draft = load_draft(root / "torch", dtype=jnp.float32)
    aux, lm_head = draft_inputs(1, n=6)
    t, visible = 4, 4

    @nnx.jit(static_argnames="absorbed")
    def pieces(m, aux_BNA, embed_VD, lm_head_VD, anchors_B, starts_B, absorbed):
        b, n = aux_BNA.shape[:2]
        kv_LBNL = m.context_rows(aux_BNA, jnp.broadcast_to(jnp.arange(n), (b, n)))
        ids_BT = jnp.concatenate([anchors_B[:, None], jnp.full((b, t - 1), 95)], 1)
        pos_BT = starts_B[:, None] + jnp.arange(t)
        mask_BTS = jnp.broadcast_to(jnp.arange(n)[None, None, :] < starts_B[:, None, None], (b, t, n))
        h_BTD = m.block_hidden(jnp.take(embed_VD, ids_BT, axis=0), pos_BT, kv_LBNL, mask_BTS, absorbed=absorbed)
        base_BTV = jnp.einsum("btd,vd->btv", h_BTD, lm_head_VD)
        drafts_BT = m.markov_sample_greedy(base_BTV, anchors_B)
        conf_BT = m.confidence(h_BTD, jnp.concatenate([anchors_B[:, None], drafts_BT[:, :-1]], 1))
        return kv_LBNL, h_BTD, base_BTV, drafts_BT, conf_BT

    # sequence 0 sees all 6 context rows (block at 6..9); sequence 1 only rows 0..3 (block at 4..7)
    args = (jnp.asarray(np.stack([aux, aux])), jnp.asarray(embed.numpy()), jnp.asarray(lm_head),
            jnp.array([11, 29]), jnp.array([6, visible]))
    kv, h, base, drafts, conf = pieces(draft, *args, absorbed=False)
    _, h_abs, _, _, _ = pieces(draft, *args, absorbed=True)
    assert kv.shape == (2, 2, 6, 16 + 8)
    np.testing.assert_allclose(np.asarray(h_abs), np.asarray(h), rtol=1e-4, atol=1e-5)  # fp32 reassociation
    base_ref, drafts_ref, conf_ref = draft.block_forward(aux[:visible], 29, embed.numpy(), lm_head, t)
    np.testing.assert_allclose(np.asarray(base[1]), np.asarray(base_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(drafts[1]), np.asarray(drafts_ref))
    np.testing.assert_allclose(np.asarray(conf[1]), np.asarray(conf_ref), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# (3) full-size inventory, abstractly; (4) YaRN constants of the K3 draft


def test_full_size_inventory_is_computed_abstractly():
    cfg = DraftConfig.from_json(K3_DRAFT_JSON)
    inv = draft_inventory(cfg)
    assert len(inv.tensors) == 68
    assert inv.num_params == 3_562_312_961
    assert inv.header_size == 7_520
    assert inv.file_bytes == 7_124_633_450 == 8 + 7_520 + 2 * 3_562_312_961
    assert {t.dtype for t in inv.tensors} == {"BF16"}
    shapes = {t.name: t.shape for t in inv.tensors}
    assert shapes["embed_tokens.weight"] == (163840, 7168)
    assert shapes["context_proj.weight"] == (7168, 35840)
    assert shapes["confidence_head.proj.weight"] == (1, 7424) and shapes["confidence_head.proj.bias"] == (1,)
    assert shapes["layers.4.self_attn.kv_b_proj.weight"] == (16384, 512)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (7168, 8192)
    owned = draft_inventory(cfg, include_embed=False)
    assert len(owned.tensors) == 67 and owned.num_params == 2_387_907_841
    # nothing was materialised: the abstract model's params are shape/dtype structs
    abstract = abstract_draft(cfg)
    assert all(isinstance(p.get_value(), jax.ShapeDtypeStruct) for p in flat_params(abstract).values())


def test_k3_yarn_constants_reach_the_attention():
    cfg = DraftConfig.from_json(K3_DRAFT_JSON)
    attn = abstract_draft(cfg).layers[0].self_attn
    assert yarn_correction_range(cfg.rope, cfg.qk_rope_head_dim) == (15, 26)
    assert yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) == pytest.approx(1.3465736, abs=1e-7)
    assert attn.softmax_scale == pytest.approx(0.13086080, abs=1e-8)
    assert attn.rope.interleaved and attn.rope.attention_factor == 1.0
    # the frequency table equals the reference's, written independently from docs/architecture.md §3.4
    inv_freq, mult, scale, low, high = yarn_tables(json.loads(K3_DRAFT_JSON.read_text()))
    assert (low, high) == (15, 26) and mult == 1.0 and scale == pytest.approx(attn.softmax_scale, rel=1e-12)
    assert np.all(ulps(attn.rope.inv_freq, inv_freq.numpy()) <= TABLE_ULPS)   # both float32 (tests/float64.py)


# ---------------------------------------------------------------------------------------------
# (5) bad inputs


def _rewrite(src: Path, edit) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(src / "model.safetensors"), metadata=METADATA)


def _edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def _truncate(src: Path) -> None:
    p = src / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


BAD_TORCH = {
    "missing": (lambda s: _rewrite(s, lambda t: t.pop("layers.1.mlp.up_proj.weight")),
                ["missing tensor 'layers.1.mlp.up_proj.weight'"]),
    "extra": (lambda s: _rewrite(s, lambda t: t.update({"layers.0.self_attn.g_proj.weight": torch.zeros(32, 32)})),
              ["unexpected tensor 'layers.0.self_attn.g_proj.weight' (no DSpark draft layer has it)"]),
    "misshaped": (lambda s: _rewrite(s, lambda t: t.update({"context_proj.weight": torch.zeros(32, 64)})),
                  ["'context_proj.weight' has shape [32, 64]", "len(target_layer_ids) * target_hidden_size = 96"]),
    "mistyped": (lambda s: _rewrite(s, lambda t: t.update({"final_norm.weight": t["final_norm.weight"].half()})),
                 ["'final_norm.weight' is F16", "torch_dtype 'float32'"]),
    "truncated": (_truncate, ["model.safetensors", "truncated"]),
    "config_hidden": (lambda s: _edit_config(s, hidden_size=40),
                      ["config.json hidden_size = 40", "'context_norm.weight'"]),
    "config_layers": (lambda s: _edit_config(s, num_hidden_layers=3),
                      ["missing tensor 'layers.2.input_layernorm.weight'", "num_hidden_layers=3"]),
    "config_key": (lambda s: _edit_config(s, kv_lora_rank=None), ["config.json", "'kv_lora_rank'"]),
    "config_json": (lambda s: (s / "config.json").write_text("{not json"), ["config.json", "not valid JSON"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TORCH))
def test_bad_torch_input_is_named_and_leaves_nothing(tmp_path, case):
    edit, needles = BAD_TORCH[case]
    src, dst = tmp_path / "src", tmp_path / "out" / "dst"
    make_torch_draft(src)
    edit(src)
    with pytest.raises((CheckpointError, ConfigError)) as e:
        convert_draft(src, dst)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    assert not dst.exists() and not _leftovers(dst)


def test_bad_orbax_input_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    src, orb = tmp_path / "src", tmp_path / "orbax"
    make_torch_draft(src)
    torch_to_orbax(src, orb)
    # config.json no longer fits the tensors recorded in the layout
    good_cfg = (orb / "config.json").read_bytes()
    _edit_config(orb, intermediate_size=64)
    dst = tmp_path / "back"
    with pytest.raises(CheckpointError, match=r"'layers\.0\.mlp\.down_proj\.weight'.*intermediate_size = 64"):
        convert_draft(orb, dst)
    assert not dst.exists() and not _leftovers(dst)
    # a failure while streaming (here: the 5th tensor read) removes the partly written output
    (orb / "config.json").write_bytes(good_cfg)
    calls, real_read = [], draft_io.OrbaxDraft.read

    def failing_read(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise CheckpointError(f"injected failure reading {name!r}")
        return real_read(self, name)

    monkeypatch.setattr(draft_io.OrbaxDraft, "read", failing_read)
    with pytest.raises(CheckpointError, match="injected failure"):
        convert_draft(orb, dst)
    assert len(calls) == 5 and not dst.exists() and not _leftovers(dst)
    monkeypatch.undo()
    # the Orbax data files are gone: named as an unreadable Orbax checkpoint
    for f in (orb / "params").rglob("d/*"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"orbax/params: not a readable Orbax checkpoint"):
        convert_draft(orb, dst)
    assert not dst.exists() and not _leftovers(dst)


def test_check_catches_a_changed_tensor(tmp_path, monkeypatch):
    """--check compares what was written against the source: one flipped bit fails the
    conversion, names the tensor, and leaves nothing behind."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_torch_draft(src)
    real_read = draft_io.OrbaxDraft.read

    def flipped(self, name):
        arr = real_read(self, name)
        if name == "layers.0.mlp.down_proj.weight":
            arr.view(np.uint8)[0] ^= 1
        return arr

    monkeypatch.setattr(draft_io.OrbaxDraft, "read", flipped)
    with pytest.raises(CheckpointError, match=r"--check: tensor 'layers\.0\.mlp\.down_proj\.weight' differs"):
        convert_draft(src, dst, check=True)
    assert not dst.exists() and not _leftovers(dst)


def test_nonempty_destination_is_refused_untouched(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_torch_draft(src)
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        convert_draft(src, dst)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and not _leftovers(dst)
    # an empty directory is a fine destination
    (dst / "keep.txt").unlink()
    convert_draft(src, dst)
    assert (dst / "params").is_dir()


def test_cli_converts_both_ways_and_reports_errors(tmp_path):
    src, orb, back = tmp_path / "src", tmp_path / "orbax", tmp_path / "back"
    make_torch_draft(src, dtype=torch.bfloat16)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    run = lambda s, d: subprocess.run([sys.executable, "-m", "convert.draft", f"--src={s}", f"--dst={d}", "--check"],
                                      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    for s, d in ((src, orb), (orb, back)):
        r = run(s, d)
        assert r.returncode == 0, r.stderr
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    r = run(src, orb)                       # orb exists and is not empty
    assert r.returncode == 1 and "not an empty directory" in r.stderr
