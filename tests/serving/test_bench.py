"""`python -m serve.bench`: the card's table, the ratio table, JSON and the PNG.

The `--limit 5` run uses the tiny served pair (tests/serve_utils.py: SmolLM2's tokenizer and chat
template over a 3-layer random Llama) on the real benchmark prompts, with a synthetic 5-row AIME
file (the real one is not ours to ship). A second, shorter run takes the default models (the demo
pair, or its documented fallback while the demo draft is not shipped) to exercise that path; it
is cut to one GSM8K prompt and 4 new tokens because SmolLM2's compilations dominate CI time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import load_draft, load_target
from dspark_jax.data.eval_sets import load_benchmark
from dspark_jax.decode.generate import generate
from dspark_jax.serving import card
from tests.serve_utils import write_tiny_draft, write_tiny_target

ROOT = Path(__file__).resolve().parents[2]
T = 4


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, smollm2_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench_pair")
    return write_tiny_target(root / "target", Path(smollm2_dir)), write_tiny_draft(root / "draft")


@pytest.fixture(scope="module")
def aime_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("aime") / "aime_synthetic.jsonl"
    rows = [{"id": f"s-{i}", "problem": f"Find the remainder when {7 ** (i + 3)} is divided by {11 + i}.",
             "answer": str(7 ** (i + 3) % (11 + i))} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "serve.bench", "--dtype", "checkpoint", *args], cwd=ROOT,
                          capture_output=True, text=True,
                          env=dict(os.environ, XLA_FLAGS="", **(env or {})), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _png_ok(path: Path) -> None:
    import matplotlib.image
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100 and np.ptp(img) > 0      # not a blank canvas


def test_bench_limit5_table_json_png(pair_dirs, aime_file, tmp_path):
    target_dir, draft_dir = pair_dirs
    out = tmp_path / "bench.json"
    proc = _run(["--model", str(target_dir), "--draft_model", str(draft_dir), "--limit", "5",
                 "--aime_file", str(aime_file), "--benchmarks", "gsm8k,humaneval,mtbench,aime26",
                 "--num_speculative_tokens", str(T), "--max_new_tokens", "24", "--max_model_len", "1024",
                 "--reference_draft", f"untrained:{draft_dir / 'config.json'}", "--output_json", str(out),
                 "--journal_dir", str(tmp_path / "journal")])
    # every conversation journaled, per benchmark and draft, after its settings line
    for role in ("draft", "reference"):
        for name in ("gsm8k", "humaneval", "mt_bench", "aime"):
            lines = (tmp_path / "journal" / f"{role}-{name}.jsonl").read_text().splitlines()
            header, *entries = (json.loads(x) for x in lines)
            assert header["benchmark"] == name and header["max_new_tokens"] == 24 and len(entries) == 5
    # the card's table and the ratio table on stdout
    for row in ("| GSM8K |", "| HumanEval |", "| MT-Bench |", "| AIME 2026 |", "| mean |"):
        assert proc.stdout.count(row) == 2, row
    assert "| benchmark | tok/fwd | acceptance % | prompts |" in proc.stdout
    assert "| benchmark | tok/fwd | reference tok/fwd | ratio |" in proc.stdout
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert list(res) == ["gsm8k", "humaneval", "mt_bench", "aime"]
    assert all(r["prompts"] == 5 for r in res.values())
    assert res["mt_bench"]["turns"] == 10 and res["gsm8k"]["turns"] == 5     # both MT-Bench turns ran
    for r in res.values():
        st = r["mtp_stats"]
        steps = sum(st["distribution"].values())
        assert steps > 0 and st["total_draft_tokens"] == T * steps
        assert r["tok_per_fwd"] == pytest.approx(1 + st["total_accepted_tokens"] / steps)
        assert r["generated_tokens"] == sum(t["generated_tokens"] for it in r["items"] for t in it["turns"])
    assert set(doc["ratio"]) == {"gsm8k", "humaneval", "mt_bench", "aime", "mean"}
    for n, ratio in doc["ratio"].items():
        if n != "mean":
            assert ratio == pytest.approx(res[n]["tok_per_fwd"] / doc["reference"][n]["tok_per_fwd"])
    assert doc["settings"]["temperature"] == 0.0 and doc["settings"]["concurrency"] == 1
    _png_ok(out.with_suffix(".png"))

    # the bench's first GSM8K conversation is exactly generate() on the same chat prompt
    target, draft = load_target(target_dir, dtype="checkpoint"), load_draft(draft_dir, dtype="checkpoint")
    item = load_benchmark("gsm8k", 1)[0]
    g = generate(target, draft, [item.conversation()], max_new_tokens=24, num_speculative_tokens=T)
    turn = res["gsm8k"]["items"][0]["turns"][0]
    assert turn["generated_tokens"] == len(g.outputs[0].token_ids)
    assert turn["verify_steps"] == g.outputs[0].stats["num_verify_steps"]
    assert turn["tok_per_fwd"] == pytest.approx(g.outputs[0].stats["average_tokens_per_forward"])


def test_bench_default_models(smollm2_dir, tmp_path):
    """No model flags: the demo pair (SmolLM2 + the shipped demo draft)."""
    out = tmp_path / "demo.json"
    _run(["--limit", "1", "--benchmarks", "gsm8k", "--max_new_tokens", "4", "--max_model_len", "512",
          "--output_json", str(out), "--noprogress"], env={"DSPARK_CACHE": str(Path(smollm2_dir).parent)})
    doc = json.loads(out.read_text())
    assert doc["settings"]["model"] == "smollm2-135m"
    assert doc["settings"]["draft_model"] == "smollm2-135m-dspark"
    assert doc["results"]["gsm8k"]["prompts"] == 1
    _png_ok(out.with_suffix(".png"))


def test_benchmark_names_and_tables():
    assert card.resolve_benchmarks(["GSM8K", "mtbench", "aime26", "gsm8k"]) == ["gsm8k", "mt_bench", "aime"]
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        card.resolve_benchmarks(["mmlu"])
    stats = card.SpecStats(7)
    for n in (7, 0, 3, 2):
        stats.update(n)
    r = card.BenchResult("gsm8k", 4, stats)
    assert r.tok_per_fwd == pytest.approx(1 + 12 / 4) and r.acceptance_rate == pytest.approx(12 / 28)
    table = card.card_table({"gsm8k": r})
    assert "| GSM8K | 4.00 | 42.9 | 4 |" in table


def test_aime_needs_a_file(pair_dirs):
    target_dir, draft_dir = pair_dirs
    proc = subprocess.run([sys.executable, "-m", "serve.bench", "--model", str(target_dir), "--draft_model",
                           str(draft_dir), "--benchmarks", "aime"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "--aime_file" in proc.stderr


def test_journal_resumes_and_extends_a_run(pair_dirs, aime_file, tmp_path):
    """A journaled run cut short (the last line half written) and rerun with a larger limit
    generates only the missing items, and its results equal one uninterrupted run's; a journal
    of other settings is refused with the differing field named."""
    from dspark_jax.decode.config import EngineConfig, SchedulerConfig
    from dspark_jax.decode.requests import tokenizer_for

    target_dir, draft_dir = pair_dirs
    target, draft = load_target(target_dir, dtype="checkpoint"), load_draft(draft_dir, dtype="checkpoint")
    runner = card.Runner(target, draft, tokenizer_for(target),
                         EngineConfig(num_speculative_tokens=T), SchedulerConfig(max_model_len=512),
                         max_new_tokens=12)
    items = load_benchmark("aime", None, aime_file=aime_file)
    settings = {"benchmark": "aime", "draft_sha": "a", "max_new_tokens": 12}
    whole = card.run_benchmark(runner, "aime", items, progress=False)

    path = tmp_path / "draft-aime.jsonl"
    card.run_benchmark(runner, "aime", items[:3], progress=False, journal=card.Journal(path, settings))
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4                                   # settings + 3 items
    path.write_bytes(b"".join(lines[:3]) + lines[3][:25])    # item 3 cut mid-line by a crash
    ran = []
    run_item = runner.run_item
    runner.run_item = lambda item, stats: (ran.append(item.id), run_item(item, stats))[1]
    resumed = card.run_benchmark(runner, "aime", items, progress=False, journal=card.Journal(path, settings))
    assert ran == [it.id for it in items[2:]]
    assert resumed.stats == whole.stats and resumed.items == whole.items
    assert resumed.generated_tokens == whole.generated_tokens and resumed.turns == whole.turns
    assert len(path.read_bytes().splitlines()) == 1 + len(items)

    with pytest.raises(ValueError, match="draft_sha was 'a', now 'b'"):
        card.Journal(path, dict(settings, draft_sha="b"))
    changed = [card.BenchItem(items[0].id, ("another prompt",))]
    with pytest.raises(ValueError, match=f"item {items[0].id}'s prompt differs"):
        card.run_benchmark(runner, "aime", changed, progress=False, journal=card.Journal(path, settings))


def test_decode_speed_times_steps_from_a_config_alone(pair_dirs, tmp_path):
    """`benchmarks.decode_speed --steps_only --random_weights` (the GPU check's step timing) needs
    only the target's config file: no weights, tokenizer or prompts."""
    target_dir, draft_dir = pair_dirs
    config_only = tmp_path / "target.json"
    config_only.write_bytes((target_dir / "config.json").read_bytes())
    out = tmp_path / "steps.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode_speed", "--steps_only", "--random_weights",
                           "--model", str(config_only), "--draft_model", str(draft_dir), "--batch_sizes", "1,2",
                           "--step_reps", "2", "--output_json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=""), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        block, verify, one = r["draft_block_ms"], r["verify_ms"], r["one_token_step_ms"]
        assert min(block, verify, one) > 0
        assert r["break_even_tok_per_fwd"] == pytest.approx((block + verify) / one)
        assert r["draft_share_of_step"] == pytest.approx(block / (block + verify))
    assert "break-even tok/fwd" in proc.stdout
    # a draft's config is refused by name, before anything is built
    bad = subprocess.run([sys.executable, "-m", "benchmarks.decode_speed", "--steps_only", "--random_weights",
                          "--model", str(draft_dir / "config.json")],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=""), timeout=600)
    assert bad.returncode != 0 and "a DSpark draft config, not a target's" in bad.stderr
