"""Offline teacher shards (dspark_jax/train/teacher.py) stored as float8 with per-row scales: the
reader returns exactly the dequantized values in the teacher's dtype, bf16 shards (and the
layout written before float8 existed) read as before, a shard that does not match its
directory fails naming the file and the field, and an interrupted float8 writer resumes to the
same bytes as an uninterrupted one. The trainer side of the shards: tests/train/test_train.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_arrays
from dspark_jax.train import teacher, teacher_shards
from dspark_jax.train.regen import Sample
from tests.gen_utils import answer_samples, tiny_draft, tiny_llama
from tests.train_utils import write_tiny_run_inputs

REPO = Path(__file__).resolve().parents[2]
G, H = 3, 16          # captured layers, hidden size


def _meta(dtype="bfloat16", aux_dtype=None, num_writers=1, shard_size=2) -> teacher_shards.ShardMeta:
    return teacher_shards.ShardMeta(num_writers=num_writers, shard_size=shard_size, aux_layer_ids=(0, 2, 4), hidden_size=H,
                             aux_width=G * H, dtype=dtype, target="t", max_len=64, aux_dtype=aux_dtype)


def _data(dtype, n=5, seed=0):
    """Samples of varied length with hidden states whose rows differ in scale by decades."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = 3 + 2 * i
        scale = 10.0 ** rng.uniform(-3, 3, (s, G + 1, 1))
        hid = (rng.standard_normal((s, G + 1, H)) * scale).astype(np.dtype(dtype))
        out.append((Sample(f"x{i}", rng.integers(0, 90, s).astype(np.int32), rng.random(s) < 0.7),
                    hid[:, :G].reshape(s, G * H), hid[:, G]))
    return out


def _write(directory, meta, data, writer=0):
    w = teacher_shards.ShardWriter(directory, writer, meta)
    for sample, aux, final in data:
        w.add(sample, aux, final)
    w.finish()


def _read_all(directory) -> list[teacher_shards.TeacherExample]:
    st = teacher_shards.ShardStream(directory, timeout_seconds=5)
    out = []
    while True:
        ex = next(st)
        if st.position.epoch > 0:
            return out
        out.append(ex)


def _reference_fp8(x: np.ndarray, dtype) -> np.ndarray:
    """s = max|x| * fl(1/448) per row of H, x * fl(1/s) to e4m3fn, back as q * s, in float32:
    numpy, independently of fp8_rows."""
    x32 = x.astype(np.float32).reshape(len(x), -1, H)
    s = np.max(np.abs(x32), axis=-1, keepdims=True) * np.float32(1 / 448)
    q = (x32 * (np.float32(1) / s)).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float32) * s).astype(np.dtype(dtype)).reshape(x.shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_fp8_shards_read_back_as_quantize_dequantize_exactly(tmp_path, dtype):
    data = _data(dtype)
    meta = _meta(dtype, teacher_shards.FP8)
    _write(tmp_path, meta, data)
    got = _read_all(tmp_path)
    assert [e.sample.id for e in got] == [d[0].id for d in data]
    for ex, (sample, aux, final) in zip(got, data):
        np.testing.assert_array_equal(ex.sample.input_ids, sample.input_ids)
        np.testing.assert_array_equal(ex.sample.loss_mask, sample.loss_mask)
        assert ex.aux_SA.dtype == np.dtype(dtype) and ex.final_SH.dtype == np.dtype(dtype)
        for have, want in ((ex.aux_SA, _reference_fp8(aux, dtype)), (ex.final_SH, _reference_fp8(final, dtype))):
            assert have.tobytes() == want.tobytes()
        assert not np.array_equal(ex.aux_SA, aux)       # it is float8, not the input
    # the file holds float8 values and one float32 scale per token and stored layer
    sf = SafetensorsFile(tmp_path / teacher_shards.shard_name(0, 0))
    n = sf.tensors["input_ids"].shape[0]
    assert sf.tensors["aux_hidden"].dtype == sf.tensors["final_hidden"].dtype == "F8_E4M3"
    assert sf.tensors["aux_scale"].shape == (n, G) and sf.tensors["final_scale"].shape == (n, 1)
    meta_json = json.loads((tmp_path / teacher_shards.META_FILE).read_text())
    assert meta_json["version"] == 2 and meta_json["aux_dtype"] == "float8_e4m3fn" and meta_json["dtype"] == dtype


@pytest.mark.parametrize("aux_dtype", [None, teacher_shards.FP8])
def test_bytes_per_token_is_what_a_shard_holds(tmp_path, aux_dtype):
    """`bytes_per_token` (the figure train.plan prints) against the fields of a written shard
    (all but the per-sequence offsets)."""
    _write(tmp_path, _meta("bfloat16", aux_dtype, shard_size=5), _data("bfloat16"))
    sf = SafetensorsFile(tmp_path / teacher_shards.shard_name(0, 0))
    n = sf.tensors["input_ids"].shape[0]
    per_token = sum(i.nbytes for name, i in sf.tensors.items() if name != "offsets")
    stored = aux_dtype or "bfloat16"
    assert per_token == n * teacher_shards.bytes_per_token(H, G, stored)
    assert teacher_shards.bytes_per_token(H, G, stored) == ((G + 1) * H + (G + 1) * 4 + 5 if aux_dtype
                                                     else (G + 1) * H * 2 + 5)


def test_bf16_shards_keep_their_layout_and_read_as_before(tmp_path):
    """Without aux_dtype the writer writes the version-1 layout, and a version-1 directory as the
    writer wrote it before float8 storage existed reads unchanged."""
    data = _data("bfloat16")
    _write(tmp_path / "new", _meta("bfloat16"), data)
    old_json = {"format": "dspark_jax.teacher", "version": 1, "num_writers": 1, "shard_size": 2,
                "aux_layer_ids": [0, 2, 4], "hidden_size": H, "aux_width": G * H, "dtype": "bfloat16",
                "target": "t", "max_len": 64}
    assert json.loads((tmp_path / "new" / teacher_shards.META_FILE).read_text()) == old_json
    old = tmp_path / "old"
    old.mkdir()
    (old / teacher_shards.META_FILE).write_text(json.dumps(old_json, indent=1) + "\n")
    for j in range(3):      # shards as the version-1 writer wrote them
        part = data[2 * j:2 * j + 2]
        save_arrays(old / teacher_shards.shard_name(0, j), {
            "input_ids": np.concatenate([p[0].input_ids for p in part]).astype(np.int32),
            "loss_mask": np.concatenate([p[0].loss_mask for p in part]).astype(np.uint8),
            "offsets": np.concatenate([[0], np.cumsum([len(p[0].input_ids) for p in part])]).astype(np.int64),
            "aux_hidden": np.concatenate([p[1] for p in part]), "final_hidden": np.concatenate([p[2] for p in part])},
            {"format": teacher_shards.SHARD_FORMAT, "sample_ids": json.dumps([p[0].id for p in part])})
    (old / teacher_shards.done_name(0)).write_text(json.dumps({"num_shards": 3, "num_samples": 5}) + "\n")
    for d in ("new", "old"):
        got = _read_all(tmp_path / d)
        assert [e.sample.id for e in got] == [x[0].id for x in data]
        for ex, (_, aux, final) in zip(got, data):
            assert ex.aux_SA.dtype == ml_dtypes.bfloat16
            assert ex.aux_SA.tobytes() == aux.tobytes() and ex.final_SH.tobytes() == final.tobytes()
    for j in range(3):
        assert (tmp_path / "new" / teacher_shards.shard_name(0, j)).read_bytes() == \
            (old / teacher_shards.shard_name(0, j)).read_bytes()


def test_mixed_or_damaged_shards_fail_naming_the_file_and_the_field(tmp_path):
    data = _data("bfloat16")
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    _write(bf16, _meta("bfloat16"), data)
    _write(fp8, _meta("bfloat16", teacher_shards.FP8), data)

    # a writer with other storage than the directory's
    with pytest.raises(ValueError, match=r"meta\.json: written with other settings .*aux_dtype: 'bfloat16' vs "
                                         r"'float8_e4m3fn'"):
        teacher_shards.ShardWriter(bf16, 0, _meta("bfloat16", teacher_shards.FP8))

    def fails(directory, name, pattern):
        with pytest.raises(CheckpointError, match=pattern) as e:
            teacher_shards.read_shard(directory / name)
        assert str(directory / name) in str(e.value)

    # a bf16 shard among float8 ones, and the other way round
    shutil.copy(bf16 / teacher_shards.shard_name(0, 1), fp8 / "shard-w000-000009.safetensors")
    fails(fp8, "shard-w000-000009.safetensors", r"field 'aux_hidden' is BF16, meta\.json's aux_dtype "
                                                r"'float8_e4m3fn' needs F8_E4M3")
    shutil.copy(fp8 / teacher_shards.shard_name(0, 1), bf16 / "shard-w000-000009.safetensors")
    fails(bf16, "shard-w000-000009.safetensors", r"field 'aux_hidden' is F8_E4M3, meta\.json's aux_dtype "
                                                 r"'bfloat16' needs BF16")
    # float8 values without their scales
    sf = SafetensorsFile(fp8 / teacher_shards.shard_name(0, 0))
    arrays = {k: sf.read(k) for k in sf.keys() if k != "aux_scale"}
    save_arrays(fp8 / "shard-w000-000010.safetensors", arrays, sf.metadata)
    fails(fp8, "shard-w000-000010.safetensors", r"no field 'aux_scale'")
    # scales of the wrong shape (another run's layer count)
    arrays["aux_scale"] = np.ones((len(arrays["input_ids"]), G + 1), np.float32)
    save_arrays(fp8 / "shard-w000-000011.safetensors", arrays, sf.metadata)
    fails(fp8, "shard-w000-000011.safetensors", r"field 'aux_scale' has shape \[8, 4\], expected \[8, 3\]")
    # offsets that do not cover the tokens
    arrays["aux_scale"] = sf.read("aux_scale")
    arrays["offsets"] = arrays["offsets"] - 1
    save_arrays(fp8 / "shard-w000-000012.safetensors", arrays, sf.metadata)
    fails(fp8, "shard-w000-000012.safetensors", r"field 'offsets'")
    # a truncated float8 shard: cut inside the float8 values
    cut = fp8 / "shard-w000-000013.safetensors"
    raw = (fp8 / teacher_shards.shard_name(0, 0)).read_bytes()
    info = sf.tensors["aux_hidden"]
    cut.write_bytes(raw[:info.begin + info.nbytes // 2])
    fails(fp8, cut.name, r"truncated: tensor 'aux_hidden'")
    # the stream itself refuses a bf16 shard in the float8 directory when it reaches it
    os.replace(bf16 / teacher_shards.shard_name(0, 1), fp8 / teacher_shards.shard_name(0, 1))
    st = teacher_shards.ShardStream(fp8, timeout_seconds=5)
    next(st), next(st)
    with pytest.raises(CheckpointError, match=r"shard-w000-000001\.safetensors: field 'aux_hidden' is BF16"):
        next(st)
    # a meta.json claiming float8 storage in the version-1 layout
    bad = json.loads((fp8 / teacher_shards.META_FILE).read_text()) | {"version": 1}
    (fp8 / teacher_shards.META_FILE).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"meta\.json: version 1 with aux_dtype 'float8_e4m3fn'"):
        teacher_shards.read_meta(fp8)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0)
    return target, tiny_draft(target, seed=1)


@pytest.fixture(scope="module")
def samples(pair):
    return answer_samples(pair[0], max_new_tokens=20, n=10)


def test_interrupted_fp8_writer_resumes_to_the_same_bytes(pair, samples, tmp_path, monkeypatch):
    """Writer 1 of 2 stops after 3 of its samples (shard 0 published, the third sample pending and
    lost); rerun, it continues after shard 0 and its files equal an uninterrupted writer's."""
    target, draft = pair
    meta = teacher_shards.ShardMeta(num_writers=2, shard_size=2, aux_layer_ids=tuple(draft.cfg.target_layer_ids),
                             hidden_size=32, aux_width=64, dtype="float32", target="tiny", max_len=40,
                             aux_dtype=teacher_shards.FP8)
    for w in range(2):
        teacher_shards.write_teacher_shards(target, samples, tmp_path / "whole", writer=w, meta=meta, batch_size=2)

    add, calls = teacher_shards.ShardWriter.add_stored, []

    def dying_add(self, *a):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        add(self, *a)

    victim = tmp_path / "resumed"
    teacher_shards.write_teacher_shards(target, samples, victim, writer=0, meta=meta, batch_size=2)
    monkeypatch.setattr(teacher_shards.ShardWriter, "add_stored", dying_add)
    with pytest.raises(KeyboardInterrupt):
        teacher_shards.write_teacher_shards(target, samples, victim, writer=1, meta=meta, batch_size=2)
    monkeypatch.setattr(teacher_shards.ShardWriter, "add_stored", add)
    assert sorted(p.name for p in victim.glob("shard-w001-*")) == [teacher_shards.shard_name(1, 0)]
    assert not (victim / teacher_shards.done_name(1)).exists()
    out = teacher_shards.write_teacher_shards(target, samples, victim, writer=1, meta=meta, batch_size=2)
    assert out.num_samples == 5 and out.num_shards == 3
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in victim.iterdir())
    for name in names:
        assert (victim / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    # and what the trainer reads is the teacher's output through float8 (every sample, in order)
    got = _read_all(victim)
    assert [e.sample.id for e in got] == [samples[i].id for j in range(3) for w in range(2)
                                          for i in range(4 * j + w, min(4 * j + w + 4, 10), 2)]
    ex = got[0]
    n = len(ex.sample.input_ids)
    ref = teacher.teacher_outputs(target, ex.sample.input_ids[None], np.ones((1, n), bool), meta.aux_layer_ids)
    rel = np.max(np.abs(ex.aux_SA - np.asarray(ref.aux_BSA[0]))) / np.max(np.abs(np.asarray(ref.aux_BSA[0])))
    assert ex.aux_SA.dtype == np.float32 and 0 < rel <= 2.0 ** -4


def test_device_and_host_quantization_write_the_same_shards(pair, samples, tmp_path):
    """write_teacher_shards quantizes inside the jitted teacher step; the same teacher outputs
    quantized on the host by ShardWriter.add give the same files."""
    target, draft = pair
    meta = teacher_shards.ShardMeta(num_writers=1, shard_size=4, aux_layer_ids=tuple(draft.cfg.target_layer_ids),
                             hidden_size=32, aux_width=64, dtype="float32", target="tiny", max_len=40,
                             aux_dtype=teacher_shards.FP8)
    teacher_shards.write_teacher_shards(target, samples, tmp_path / "device", writer=0, meta=meta, batch_size=2)
    host = teacher_shards.ShardWriter(tmp_path / "host", 0, meta)
    fn = nnx.jit(teacher.teacher_outputs, static_argnums=3)
    for start in range(0, len(samples), 2):
        chunk = samples[start:start + 2]
        ids, _, valid = teacher.pad_batch(chunk, meta.max_len, 2)
        out = fn(target, jnp.asarray(ids), jnp.asarray(valid), meta.aux_layer_ids)
        for i, s in enumerate(chunk):
            host.add(s, np.asarray(out.aux_BSA[i]), np.asarray(out.final_hidden_BSH[i]))
    host.finish()
    names = sorted(p.name for p in (tmp_path / "device").iterdir())
    assert len(names) == 5 and names == sorted(p.name for p in (tmp_path / "host").iterdir())
    for name in names:
        assert (tmp_path / "device" / name).read_bytes() == (tmp_path / "host" / name).read_bytes(), name
    # stored rows of the wrong kind are refused before anything is written
    rows = teacher.StoredRows(np.zeros((3, 64), np.float32), np.zeros((3, 32), np.float32))
    with pytest.raises(ValueError, match=r"hidden states float32 without scales, the directory stores "
                                         r"float8_e4m3fn with scales"):
        host.add_stored(samples[0], rows)


def test_train_teacher_aux_dtype_flag(pair, samples, tmp_path):
    """`train.teacher` writes float8 shards by default; a second writer with other storage
    (`--aux_dtype auto`: the teacher's float32) stops before loading the target, naming meta.json,
    the field and the flag that would match."""
    inputs = write_tiny_run_inputs(tmp_path, pair, samples)
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    out = tmp_path / "shards"
    cmd = [sys.executable, "-m", "train.teacher", f"--target={inputs['target']}", f"--data={inputs['data']}",
           f"--draft_config={inputs['draft_config']}", f"--out={out}", "--num_writers=2", "--shard_size=2",
           "--batch_size=2", "--max_len=40"]
    kw = {"cwd": REPO, "env": env, "capture_output": True, "text": True, "timeout": 240}
    first = subprocess.run(cmd + ["--writer=0"], **kw)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "hidden states stored as float8_e4m3fn: 113 bytes per token" in first.stdout  # 3 x 32 + 3 x 4 + 5
    assert teacher_shards.read_meta(out).aux_dtype == teacher_shards.FP8
    assert SafetensorsFile(out / teacher_shards.shard_name(0, 0)).tensors["aux_hidden"].dtype == "F8_E4M3"
    second = subprocess.run(cmd + ["--writer=1", "--aux_dtype=auto"], **kw)
    assert second.returncode != 0
    assert f"{out / teacher_shards.META_FILE}: written with other settings" in second.stderr
    assert "aux_dtype: 'float8_e4m3fn' vs 'float32'); its storage is --aux_dtype float8_e4m3fn" in second.stderr
    assert not list(out.glob("shard-w001-*"))
