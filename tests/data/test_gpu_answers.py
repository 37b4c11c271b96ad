"""scripts/gpu_answers.sh on the CPU with the real target and two tiny pools: every pool answered
inside the budget, its archive written, the snapshot left for gpu_distill.sh, and a second call
that finds everything answered.

Most of a call's time is compiling the target's programs in each subprocess: the calls share one
persistent compilation cache (a later call loads what an earlier one compiled; the answers are
the same either way), and the pools fit one batch (one batch bucket compiled, not one per size
the running batch shrinks to; tests/decode/test_scheduler.py covers continuous batching)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.data import answer_cache

REPO = Path(__file__).resolve().parents[2]


def _pool(path: Path, name: str, n: int) -> list[dict]:
    recs = [{"id": f"{name}/{i}", "source": "t",
             "messages": [{"role": "user", "content": f"Name {i + 2} colours of the {name} kind."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def _summary(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla_cache")


def _run(work: Path, out: Path, pools: str, target: Path, xla_cache: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TARGET=str(target),
               WORK=str(work), BATCH="4", MAX_NEW_TOKENS="16", RESERVE="5", POOLS=pools,
               JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0") | env
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_answers.sh"), str(out), "500"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=700, check=False)


def test_gpu_answers_answers_the_pools_and_writes_their_archives(smollm2_dir, xla_cache, tmp_path):
    # two sizes, so each summary line must match its own pool; both within one batch of 4
    pools = {name: _pool(tmp_path / f"prompts-{name}.jsonl", name, n) for name, n in (("warm", 4), ("cool", 3))}
    spec = " ".join(f"{n}:{tmp_path}/prompts-{n}.jsonl:{tmp_path}/archive-{n}" for n in pools)
    out = tmp_path / "out"
    res = _run(tmp_path / "work", out, spec, smollm2_dir, xla_cache)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = _summary(out)
    assert [x["name"] for x in lines] == ["warm", "cool"]
    for x, (name, recs) in zip(lines, pools.items()):
        assert x["pool"] == x["answered"] == x["archived"] == x["snapshot"] == len(recs)
        snap = answer_cache.read_cache(tmp_path / "work" / f"answers-{name}.jsonl")
        assert [r["id"] for r in snap] == [r["id"] for r in recs]        # the pool's order
        assert all(r["dtype"] == "bfloat16" and 1 <= len(r["answer_ids"]) <= 16 for r in snap)
    assert sorted(p.name for p in out.iterdir()) == ["answers.jsonl", "gpu_answers.log"]
    for name in pools:
        arch = tmp_path / f"archive-{name}"
        assert (arch / "part-00000.jsonl.gz").is_file() and (arch / "meta.json").is_file()

    # a second call with a fresh WORK: the archives restore every answer, nothing is generated
    res = _run(tmp_path / "work2", tmp_path / "out2", spec, smollm2_dir, xla_cache)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (tmp_path / "out2" / "gpu_answers.log").read_text()
    for n in (4, 3):
        assert f"{n} already cached, 0 to generate" in log
    again = _summary(tmp_path / "out2")
    assert [x["snapshot"] for x in again] == [4, 3]
    for name in pools:
        assert (tmp_path / "work2" / f"answers-{name}.jsonl").read_bytes() == \
            (tmp_path / "work" / f"answers-{name}.jsonl").read_bytes()


def test_gpu_answers_samples_requests_into_a_new_pool_then_answers_it(smollm2_dir, registry_data_dir, aime_file,
                                                                    xla_cache, tmp_path):
    """SAMPLE: Magpie requests (steered) until SAMPLE_MAX new ones are accepted, the pool of the
    new ones less an earlier pool, decontaminated, answered, the grown Magpie archive written.

    Sampling stops at SAMPLE_MAX accepted requests or after SAMPLE_S seconds, whichever comes
    first: here the count (two requests, one at a time: one batch bucket compiled), with SAMPLE_S
    a backstop it never reaches; tests/data/test_magpie.py checks that a time budget stops sampling."""
    from dspark_jax.data import magpie

    cache, archive = tmp_path / "magpie.jsonl", tmp_path / "magpie.jsonl.gz"
    env = {"MAGPIE_CACHE": str(cache), "MAGPIE_ARCHIVE": str(archive), "MAGPIE_OPENERS": "Write a poem,Pretend you are",
           "SAMPLE_S": "300", "SAMPLE_MAX": "2", "BATCH": "1", "DSPARK_DATA_DIR": str(registry_data_dir),
           "DSPARK_DATA_CACHE": str(tmp_path / "data-cache"), "AIME": str(aime_file)}
    first = tmp_path / "prompts-1.jsonl"
    res = _run(tmp_path / "work", tmp_path / "out", "", smollm2_dir, xla_cache,
               SAMPLE=f"p1:{first}:{tmp_path}/answers-1", **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    pool1 = [json.loads(x) for x in first.read_text().splitlines()]
    accepted = magpie.queries(cache)
    assert len(accepted) == 2                                   # SAMPLE_MAX, not the time, stopped it
    assert 1 <= len(pool1) <= len(accepted) and {r["source"] for r in pool1} == {"magpie"}
    assert {r["id"] for r in pool1} <= {i for i, _ in accepted}
    assert magpie.restore_archive(archive, tmp_path / "restored.jsonl") == len(magpie.read_cache(cache))
    [line] = _summary(tmp_path / "out")
    assert line["name"] == "p1" and line["pool"] == line["answered"] == line["snapshot"] == len(pool1)

    # a second sampling round: its pool holds only the new requests (the first pool excluded)
    second = tmp_path / "prompts-2.jsonl"
    res = _run(tmp_path / "work", tmp_path / "out2", "", smollm2_dir, xla_cache,
               SAMPLE=f"p2:{second}:{tmp_path}/answers-2", MAGPIE_EXCLUDE=str(first), **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(magpie.queries(cache)) == 4                      # SAMPLE_MAX more than the first round's
    ids2 = {json.loads(x)["id"] for x in second.read_text().splitlines()}
    assert ids2 and not ids2 & {r["id"] for r in pool1}
