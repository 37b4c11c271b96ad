"""scripts/gpu_answers.sh on the CPU with the real target and two tiny pools: every pool answered
inside the budget, its archive in the returned tar, the snapshot left for gpu_distill.sh, and a
second call that finds everything answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from dspark_jax.train import regen

REPO = Path(__file__).resolve().parents[1]


def _pool(path: Path, name: str, n: int) -> list[dict]:
    recs = [{"id": f"{name}/{i}", "source": "t",
             "messages": [{"role": "user", "content": f"Name {i + 2} colours of the {name} kind."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def _run(work: Path, out: Path, pools: str, target: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TARGET=str(target),
               WORK=str(work), DSPARK_GPU_PAYLOAD=str(work / "no-payload"), BATCH="4",
               MAX_NEW_TOKENS="16", RESERVE="5", POOLS=pools)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_answers.sh"), str(out), "500"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=700, check=False)


def test_gpu_answers_answers_the_pools_and_returns_their_archives(smollm2_dir, tmp_path):
    pools = {name: _pool(tmp_path / f"prompts-{name}.jsonl", name, n) for name, n in (("warm", 6), ("cool", 5))}
    spec = " ".join(f"{n}:{tmp_path}/prompts-{n}.jsonl:{tmp_path}/archive-{n}" for n in pools)
    out = tmp_path / "out"
    res = _run(tmp_path / "work", out, spec, smollm2_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines] == ["warm", "cool"]
    for x, (name, recs) in zip(lines, pools.items()):
        assert x["pool"] == x["answered"] == x["archived"] == x["snapshot"] == len(recs)
        snap = regen.read_cache(tmp_path / "work" / f"answers-{name}.jsonl")
        assert [r["id"] for r in snap] == [r["id"] for r in recs]        # the pool's order
        assert all(r["dtype"] == "bfloat16" and 1 <= len(r["answer_ids"]) <= 16 for r in snap)
    with tarfile.open(out / "answers.tar") as tar:
        names = tar.getnames()
    for name in pools:
        arch = str(tmp_path / f"archive-{name}").lstrip("/")
        assert f"{arch}/part-00000.jsonl.gz" in names and f"{arch}/meta.json" in names

    # a second call on a fresh machine: the archives restore every answer, nothing is generated
    res = _run(tmp_path / "work2", tmp_path / "out2", spec, smollm2_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (tmp_path / "out2" / "gpu_answers.log").read_text()
    for n in (6, 5):
        assert f"{n} already cached, 0 to generate" in log
    again = [json.loads(x) for x in (tmp_path / "out2" / "answers.jsonl").read_text().splitlines()]
    assert [x["snapshot"] for x in again] == [6, 5]
    for name in pools:
        assert (tmp_path / "work2" / f"answers-{name}.jsonl").read_bytes() == \
            (tmp_path / "work" / f"answers-{name}.jsonl").read_bytes()
