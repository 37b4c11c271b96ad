"""The answer cache's committable archive: whole gzipped parts in cache order, restored on a
fresh machine so answer generation resumes where the archive ends."""

from __future__ import annotations

import json

import pytest

from dspark_jax.data import answer_cache
from dspark_jax.train import regen


def _write(cache, rows):
    with open(cache, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _rows(lo, hi):
    return [{"id": f"p{i}", "source": "s", "prompt_ids": [1, 2], "answer_ids": list(range(i % 7 + 14)),
             "finish_reason": "stop", "kept": True, "answer_text": f"answer {i}"} for i in range(lo, hi)]


def test_archive_then_restore_on_a_fresh_machine(tmp_path):
    cache, archive = tmp_path / "a" / "regen.jsonl", tmp_path / "archive"
    cache.parent.mkdir()
    _write(cache, _rows(0, 7))
    answer_cache.meta_path(cache).write_text('{"target": "t"}\n')
    assert regen.archive_cache(cache, archive, part_size=3) == 6          # two whole parts, 1 row left
    parts = sorted(p.name for p in archive.glob("part-*"))
    assert parts == ["part-00000.jsonl.gz", "part-00001.jsonl.gz"]
    first = (archive / parts[0]).read_bytes()
    _write(cache, _rows(7, 10))
    assert regen.archive_cache(cache, archive, part_size=3) == 9
    assert (archive / parts[0]).read_bytes() == first                     # parts are immutable

    fresh = tmp_path / "b" / "regen.jsonl"
    assert regen.restore_cache(archive, fresh) == 9
    assert [r["id"] for r in answer_cache.read_cache(fresh)] == [f"p{i}" for i in range(9)]
    assert answer_cache.read_cache(fresh) == answer_cache.read_cache(cache)[:9]
    assert answer_cache.meta_path(fresh).read_text() == '{"target": "t"}\n'
    assert regen.restore_cache(archive, fresh) == 0                       # already there: untouched


def test_a_complete_cache_archives_its_tail_as_a_last_short_part(tmp_path):
    cache, archive = tmp_path / "regen.jsonl", tmp_path / "archive"
    _write(cache, _rows(0, 7))
    assert regen.archive_cache(cache, archive, part_size=3) == 6
    assert regen.archive_cache(cache, archive, part_size=3, complete=True) == 7
    assert regen.archive_cache(cache, archive, part_size=3, complete=True) == 7     # idempotent
    fresh = tmp_path / "fresh.jsonl"
    assert regen.restore_cache(archive, fresh) == 7
    assert answer_cache.read_cache(fresh) == answer_cache.read_cache(cache)
    _write(cache, _rows(7, 10))                      # rows after the short part: refused, not misnumbered
    with pytest.raises(ValueError, match="part-00002.jsonl.gz is the archive's last, short part"):
        regen.archive_cache(cache, archive, part_size=3)


def test_restore_keeps_answers_the_cache_already_has(tmp_path):
    cache, archive = tmp_path / "regen.jsonl", tmp_path / "archive"
    _write(cache, _rows(0, 4))
    regen.archive_cache(cache, archive, part_size=2)
    other = tmp_path / "other.jsonl"
    _write(other, _rows(10, 12))                                           # answered elsewhere
    assert regen.restore_cache(archive, other) == 4
    assert [r["id"] for r in answer_cache.read_cache(other)] == ["p0", "p1", "p2", "p3", "p10", "p11"]


def test_an_archive_of_another_cache_is_refused(tmp_path):
    a, b, archive = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "archive"
    _write(a, _rows(0, 4))
    regen.archive_cache(a, archive, part_size=2)
    _write(b, _rows(4, 8))
    with pytest.raises(ValueError, match="part-00000.jsonl.gz: its answers are not rows 0..1"):
        regen.archive_cache(b, archive, part_size=2)


def test_regen_batch_benchmark_reports_rates_with_and_without_compilation(smollm2_dir, tmp_path):
    """`benchmarks.regen_batch` on the real target (tiny run): a row per batch size, the wall-clock
    rate, the compilation JAX reported inside the timed pass, and the rate without it."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    pool = tmp_path / "prompts.jsonl"
    _write(pool, [{"id": f"q{i}", "source": "s", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
                  for i in range(6)])
    out = tmp_path / "rb.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.regen_batch", f"--prompts={pool}", f"--model={smollm2_dir}",
                          "--batch_sizes=1,2", "--rounds=1", "--max_new_tokens=6", f"--output_json={out}"],
                         cwd=repo, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tokens"] > 0 and 0 <= r["compile_s"] <= r["wall_s"]
        assert r["tok_per_s_compiled"] >= r["tok_per_s"] > 0
        # the slots-full window ends where the queue ran empty: before the drain, inside the pass
        assert 0 < r["full_tokens"] < r["tokens"] and 0 < r["full_s"] < r["wall_s"]
        assert r["full_compile_s"] <= r["compile_s"] + 1e-9 and r["tok_per_s_full_compiled"] > 0
    assert "| batch | prompts | tokens | wall s | compiling s |" in res.stdout


def test_archived_head_is_the_pool_head_the_parts_hold(tmp_path):
    # answers finish out of pool order: p3 before p2, so the first part (3 rows) holds p0, p1, p3
    cache, archive = tmp_path / "regen.jsonl", tmp_path / "archive"
    rows = _rows(0, 6)
    _write(cache, [rows[0], rows[1], rows[3], rows[2], rows[4]])
    assert regen.archive_cache(cache, archive, part_size=3) == 3
    pool = [{"id": f"p{i}"} for i in range(6)]
    assert regen.archived_head(pool, archive) == ["p0", "p1"]
    assert regen.archived_head(pool[2:], archive) == []
    _write(cache, [rows[5]])
    regen.archive_cache(cache, archive, part_size=3)
    assert regen.archived_head(pool, archive) == [f"p{i}" for i in range(6)]
    assert regen.archived_head(pool, tmp_path / "none") == []
