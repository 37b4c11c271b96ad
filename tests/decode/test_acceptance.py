"""benchmarks.acceptance on the real target and the shipped draft (a few prompts, few tokens): the
JSON's aggregate tok/fwd, per position and per prompt agree with each other; the paired comparison
of two drafts' results (`--compare`) on rows made here; the measurement itself
(dspark_jax/decode/acceptance.py) on a tiny pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.decode.stats import SpecStats, paired_difference, paired_mean_difference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sampled_run(smollm2_dir, registry_data_dir, tmp_path_factory) -> tuple[dict, str]:
    """benchmarks.acceptance on the shipped draft, sampled at temperature 1 (seed 3): two GSM8K
    prompts and two MT-Bench first turns, each set one batch of 2. Its JSON and stdout; one run
    (one model load and compilation) serves the bookkeeping and the temperature checks below: the
    per-prompt counts add up whether the drafts were greedy or sampled."""
    tmp_path = tmp_path_factory.mktemp("acceptance")
    out = tmp_path / "acc.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", DSPARK_DATA_DIR=str(registry_data_dir),
               DSPARK_DATA_CACHE=str(tmp_path / "data-cache"))
    res = subprocess.run([sys.executable, "-m", "benchmarks.acceptance", f"--model={smollm2_dir}",
                          "--drafts=smollm2-135m-dspark", "--max_new_tokens=12", "--batch_size=2",
                          f"--output_json={out}", "--gsm8k=2", "--mt_bench=2", "--temperature=1.0", "--seed=3"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


def test_acceptance_reports_per_prompt_tokens_per_forward(sampled_run):
    got, stdout = sampled_run
    [row] = got["results"]
    for name, n in (("gsm8k", 2), ("mt_bench_turn1", 2)):
        r = row[name]
        per = r["per_prompt_tok_per_fwd"]
        assert len(per) == n and all(1.0 <= x <= 8.0 for x in per)
        # the aggregate is a mean over all verify steps: between the prompts' own figures
        assert min(per) - 1e-9 <= r["tok_per_fwd"] <= max(per) + 1e-9
        assert abs(r["tok_per_fwd"] - (1 + sum(r["per_position_acceptance"]))) < 1e-9
        # the per-prompt counts add up to the aggregate, and give each prompt's own figure
        steps, acc = r["per_prompt_verify_steps"], r["per_prompt_accepted"]
        assert sum(steps) == r["num_verify_steps"]
        assert abs(r["tok_per_fwd"] - (1 + sum(acc) / sum(steps))) < 1e-9
        assert all(abs(x - (1 + a / s)) < 1e-9 for x, a, s in zip(per, acc, steps))
    assert "| smollm2-135m-dspark |" in stdout


def test_acceptance_samples_at_a_temperature(sampled_run):
    got, _ = sampled_run
    # the row holds the requested sets only
    assert got["temperature"] == 1.0 and got["seed"] == 3 and list(got["results"][0]) == ["draft", "gsm8k",
                                                                                          "mt_bench_turn1"]
    r = got["results"][0]["gsm8k"]
    assert len(r["per_prompt_tok_per_fwd"]) == 2
    assert abs(r["tok_per_fwd"] - (1 + sum(r["per_position_acceptance"]))) < 1e-9


def _row(steps, accepted) -> dict:
    return {"prompts": len(steps), "tok_per_fwd": 1 + sum(accepted) / sum(steps), "draft_vocab_coverage": 1.0,
            "per_prompt_verify_steps": list(steps), "per_prompt_accepted": list(accepted)}


def test_paired_difference_of_two_drafts_on_the_same_prompts():
    base = _row([10, 20, 30, 40], [5, 10, 15, 20])
    assert paired_difference(base, base) == (0.0, 0.0, 0.0)
    # one more accepted draft per ten verify steps on every prompt: +0.1 whichever prompts are drawn
    d, lo, hi = paired_difference(base, _row([10, 20, 30, 40], [6, 12, 18, 24]))
    assert d == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    # better on some prompts, worse on others: an interval around the difference that holds 0
    rng = np.random.default_rng(0)
    steps = rng.integers(50, 100, 20)
    a, b = (np.minimum(steps, (steps * rng.uniform(0.5, 1.0, 20)).astype(int)) for _ in range(2))
    d, lo, hi = paired_difference(_row(steps, a), _row(steps, b))
    assert d == pytest.approx(b.sum() / steps.sum() - a.sum() / steps.sum())
    assert lo < d < hi and lo < 0 < hi
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference(base, _row([10, 20], [5, 10]))


def test_paired_mean_difference_of_per_prompt_values():
    base = [1.2, 1.5, 2.0, 1.1]
    assert paired_mean_difference(base, base) == (0.0, 0.0, 0.0)
    # the same shift on every prompt: that shift, whichever prompts are drawn
    d, lo, hi = paired_mean_difference(base, [x + 0.25 for x in base])
    assert d == pytest.approx(0.25) and lo == pytest.approx(0.25) and hi == pytest.approx(0.25)
    # per-prompt differences around +0.1 with spread 0.3 on 400 prompts: the interval holds 0.1 and
    # not 0 (its half-width about 1.96 x 0.3 / 20 = 0.03); the prompts' own spread cancels in the pairing
    rng = np.random.default_rng(1)
    a = rng.uniform(1.0, 3.0, 400)
    b = a + 0.1 + 0.3 * rng.standard_normal(400)
    d, lo, hi = paired_mean_difference(a, b)
    assert d == pytest.approx(np.mean(b - a)) and lo < 0.1 < hi and lo > 0 and 0.04 < hi - lo < 0.08
    with pytest.raises(ValueError, match="same prompts"):
        paired_mean_difference(base, base[:3])


def test_compare_reads_separate_result_files_without_a_model(tmp_path):
    def write(name, rows):
        doc = {"model": "m", "max_new_tokens": 128, "num_speculative_tokens": 7, "temperature": 0.0, "seed": 0,
               "results": [{"draft": name, "gsm8k": rows[0], "mt_bench_turn1": rows[1]}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        return str(tmp_path / f"{name}.json")
    a = write("a", [_row([10, 20], [5, 10]), _row([10, 10], [2, 4])])
    b = write("b", [_row([10, 20], [6, 12]), _row([10, 10], [2, 4])])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "benchmarks.acceptance", f"--compare={a},{b}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| b | +0.100 [+0.100, +0.100] | +0.000 [+0.000, +0.000] |" in res.stdout
    doc = json.loads(Path(a).read_text())
    del doc["results"][0]["gsm8k"]["per_prompt_verify_steps"]
    Path(a).write_text(json.dumps(doc))
    res = subprocess.run([sys.executable, "-m", "benchmarks.acceptance", f"--compare={a},{b}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0 and "has no per_prompt_verify_steps" in res.stderr


def test_measure_acceptance_keeps_each_prompts_statistics():
    """`measure_acceptance` (the card's, the benchmark's and the training monitor's measurement):
    every prompt's statistics are its own generate() call's at temperature 0 whatever the batch, and the
    aggregate merges them."""
    from dspark_jax.decode.acceptance import measure_acceptance
    from dspark_jax.decode.generate import generate
    from tests.gen_utils import prompts, tiny_draft, tiny_llama

    target = tiny_llama(0)
    draft = tiny_draft(target, 1)
    ps = prompts(3, target.cfg.vocab_size, seed=3)          # a whole batch of 2 and a last one of 1
    done = []
    run = measure_acceptance(target, draft, ps, max_new_tokens=10, num_speculative_tokens=4, batch_size=2,
                             on_batch=lambda n, r: done.append((n, len(r.outputs))))
    assert done == [(2, 2), (3, 3)]
    total = SpecStats(4)
    for p, out, stats in zip(ps, run.outputs, run.per_prompt):
        alone = generate(target, draft, [p], max_new_tokens=10, num_speculative_tokens=4).outputs[0]
        assert out.token_ids == alone.token_ids and out.stats == alone.stats == stats.to_dict()
        total.merge(stats)
    assert run.stats.to_dict() == total.to_dict() and run.stats.to_dict()["num_verify_steps"] > 0
    assert run.generated_tokens == sum(len(o.token_ids) for o in run.outputs)


def test_spec_stats_read_back_from_their_dict():
    stats = SpecStats(3)
    for n, verified in ((0, 3), (2, 3), (3, 3), (1, 2)):
        stats.update(n, verified)
    stats.plain_steps = 2
    back = SpecStats.from_dict(stats.to_dict())
    assert back == stats and SpecStats.from_dict(SpecStats(0).to_dict()) == SpecStats(0)
