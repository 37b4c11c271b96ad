"""benchmarks.gpu_payload (issue 19): the demo weights in parts for a GPU host that receives at most
64 MiB per run. Split -> the parts arriving run by run -> verify -> reassemble, on a synthetic
file; every way a part can be wrong gives an error naming the part (and the run that carries it)
and leaves nothing half-written; the pure-Python `gguf` zip imports where `gguf` is not
installed; a tiny GGUF goes through pack -> prepare_target to the same directory the converter
writes from the original."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import gpu_payload
from benchmarks.gpu_payload import MIB, PayloadError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def packed(tmp_path):
    """A 10007-byte file packed in parts of at most 3000 bytes, with one extra."""
    src = tmp_path / "model.bin"
    data = np.random.default_rng(0).bytes(10_007)
    src.write_bytes(data)
    extra = tmp_path / "prompts.jsonl"
    extra.write_text('{"question": "What is 12 * 7?"}\n')
    out = tmp_path / "payload"
    manifest = gpu_payload.pack(src, out, part_bytes=3000, extras={"prompts.jsonl": extra}, tree_bytes=1234)
    return out, data, manifest


def _carry(src: Path, dst: Path, rel: str) -> None:
    """What a device run does with one carried path: copy it into the host's tree."""
    s, d = src / rel, dst / rel
    d.parent.mkdir(parents=True, exist_ok=True)
    if s.is_dir():
        shutil.copytree(s, d, dirs_exist_ok=True)
    else:
        shutil.copy(s, d)


def test_split_and_reassemble_round_trip(packed):
    out, data, m = packed
    parts = m["file"]["parts"]
    assert [p["size"] for p in parts] == [2502, 2502, 2502, 2501]          # equal parts, none over 3000
    assert m["file"]["size"] == len(data) and m["file"]["sha256"] == hashlib.sha256(data).hexdigest()
    offset = 0
    for p in parts:                                                        # each part is its slice
        blob = (out / "parts" / p["file"]).read_bytes()
        assert blob == data[offset:offset + p["size"]] and hashlib.sha256(blob).hexdigest() == p["sha256"]
        offset += p["size"]
    assert m["extras"]["prompts.jsonl"]["size"] == len('{"question": "What is 12 * 7?"}\n')
    # one run per part, each carrying the manifest, the extras and its part
    assert m["runs"] == [[f"{out}/manifest.json", f"{out}/extras", f"{out}/parts/model.bin.part-{i:03d}"]
                         for i in range(4)]
    assert m["run_bytes"] == 1234 + m["extras"]["prompts.jsonl"]["size"] + 64 * 1024 + 2502
    assert gpu_payload.check_payload(out).complete
    got = gpu_payload.assemble(out)
    assert got == out / "model.bin" and got.read_bytes() == data
    assert gpu_payload.assemble(out).read_bytes() == data                  # an intact copy is reused


def test_parts_arrive_run_by_run(packed, tmp_path):
    """The host receives the runs' carry lists one after another; until the last part is there
    the payload is incomplete and says which run brings what is missing."""
    out, data, m = packed
    host = tmp_path / "host"
    for i, carry in enumerate(m["runs"]):
        for path in carry:
            _carry(out, host, Path(path).relative_to(out).as_posix())
        check = gpu_payload.check_payload(host)
        if i < len(m["runs"]) - 1:
            assert not check.complete and len(check.missing) == len(m["runs"]) - 1 - i
            with pytest.raises(PayloadError, match=rf"{i + 1} of 4 parts intact; missing parts/model.bin.part-"
                                                   rf"{i + 1:03d} \(run {i + 2} of 4 carries it\)"):
                gpu_payload.assemble(host)
            assert not (host / "model.bin").exists()
    assert gpu_payload.check_payload(host).complete
    assert gpu_payload.assemble(host).read_bytes() == data
    assert gpu_payload.data_dir(host) is None                              # no gsm8k_test.jsonl among the extras


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_bad_part_is_named_and_nothing_is_left(packed, damage):
    out, _, _ = packed
    part = out / "parts" / "model.bin.part-002"
    blob = bytearray(part.read_bytes())
    if damage == "flip":
        blob[100] ^= 0xFF
        part.write_bytes(bytes(blob))
        want = (r"bad parts/model.bin.part-002: sha256 [0-9a-f]{64}, expected [0-9a-f]{64} \(corrupted\) "
                r"\(carry it again: run 3\)")
    elif damage == "truncate":
        part.write_bytes(bytes(blob[:-1]))
        want = r"bad parts/model.bin.part-002: 2501 bytes, expected 2502 \(truncated"
    else:
        part.unlink()
        want = r"missing parts/model.bin.part-002 \(run 3 of 4 carries it\)"
    with pytest.raises(PayloadError, match=want):
        gpu_payload.assemble(out)
    assert sorted(p.name for p in out.iterdir()) == ["extras", "manifest.json", "parts"]   # no partial output
    assert gpu_payload.main(["status", "--dir", str(out)]) == 1


def test_manifest_problems(packed, tmp_path):
    out, _, m = packed
    m["file"]["sha256"] = "0" * 64                                         # parts fine, whole digest not
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PayloadError, match="the manifest does not match its parts"):
        gpu_payload.assemble(out)
    assert not (out / "model.bin").exists() and not list(out.glob(".*.tmp"))
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(PayloadError, match="manifest.json: not valid JSON"):
        gpu_payload.load_manifest(out)
    with pytest.raises(PayloadError, match="no payload manifest .*gpu_payload pack"):
        gpu_payload.load_manifest(tmp_path / "elsewhere")
    bad_extra = out / "extras" / "prompts.jsonl"
    bad_extra.write_text("changed\n")
    (out / "manifest.json").write_text(json.dumps(packed[2]))
    check = gpu_payload.check_payload(out)
    assert "extras/prompts.jsonl" in check.bad and not check.complete


def test_part_size_fits_a_run_beside_the_tree():
    assert gpu_payload.auto_part_bytes(tree=int(22.3 * MIB), fixed=MIB) == 38 * MIB
    assert gpu_payload.auto_part_bytes(tree=MIB, fixed=0) == 60 * MIB         # capped
    with pytest.raises(PayloadError, match="no room for a part: the working tree"):
        gpu_payload.auto_part_bytes(tree=62 * MIB, fixed=MIB)
    tree = gpu_payload.working_tree_bytes()
    assert tree >= (ROOT / "README.md").stat().st_size + (ROOT / "benchmarks" / "gpu_payload.py").stat().st_size


def test_cli_pack_and_status(tmp_path, capsys):
    src = tmp_path / "w.bin"
    src.write_bytes(b"x" * 5000)
    out = tmp_path / "p"
    assert gpu_payload.main(["pack", "--dir", str(out), "--src", str(src), "--part_mib", str(2048 / MIB),
                             "--no_extras"]) == 0
    text = capsys.readouterr().out
    assert "w.bin" in text and "-> 3 parts" in text and text.count("carry=") == 3
    assert gpu_payload.main(["status", "--dir", str(out)]) == 0
    assert "complete, every part and extra intact" in capsys.readouterr().out
    (out / "parts" / "w.bin.part-001").unlink()
    assert gpu_payload.main(["status", "--dir", str(out)]) == 1
    assert "missing parts/w.bin.part-001 (run 2 of 3 carries it)" in capsys.readouterr().out
    assert gpu_payload.main(["assemble", "--dir", str(out)]) == 2
    assert "cannot reassemble w.bin" in capsys.readouterr().err


def test_gguf_zip_imports_where_gguf_is_not_installed(tmp_path):
    """The GPU image has no `gguf`: the zip from the extras is put on sys.path (simulated by
    refusing the installed package)."""
    z = gpu_payload.gguf_zip(tmp_path / "extras")
    script = f"""
import sys
from pathlib import Path
class Refuse:   # the installed gguf is not there; the zip, once on sys.path, is
    def find_spec(self, name, path=None, target=None):
        if name == "gguf" and not sys.path[0].endswith(".zip"):
            raise ImportError("no gguf installed (simulated)")
sys.meta_path.insert(0, Refuse())
from benchmarks import gpu_payload
import numpy as np
gpu_payload.ensure_gguf_importable(Path({str(tmp_path)!r}))
import gguf, gguf.quants
x = np.linspace(-1, 1, 64, dtype=np.float32)
q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
print(gguf.__file__, float(np.abs(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0) - x).max()))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, err = proc.stdout.split()
    assert where.startswith(str(z)) and float(err) < 1e-2
    script_missing = script.replace(f"Path({str(tmp_path)!r})", f"Path({str(tmp_path / 'none')!r})")
    proc = subprocess.run([sys.executable, "-c", script_missing], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "has no gguf-*.zip" in proc.stderr


def test_tiny_gguf_prepared_like_the_converter(tmp_path):
    from dspark_jax.checkpoint.gguf import convert_gguf
    from tests.test_gpu_bench import write_gguf

    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "payload"
    gpu_payload.pack(src, out, part_bytes=src.stat().st_size // 3 + 1, tree_bytes=0)
    target = gpu_payload.prepare_target(out)
    assert target == out / gpu_payload.TARGET_NAME
    direct = convert_gguf(src, tmp_path / "direct", dtype="f32")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).read_bytes() == (direct / name).read_bytes(), name
    stamp = (target / ".source_sha256").stat().st_mtime_ns
    (out / "parts" / "tiny.gguf.part-000").unlink()          # converted once: the parts are no longer needed
    assert gpu_payload.prepare_target(out) == target and (target / ".source_sha256").stat().st_mtime_ns == stamp
    assert os.path.getsize(target / "model.safetensors") > 0
