"""benchmarks.acceptance on the real target and the shipped draft (a few prompts, few tokens): the
JSON's aggregate tok/fwd, per position and per prompt agree with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")


def _acceptance(smollm2_dir, tmp_path, *flags_) -> tuple[dict, str]:
    """Run benchmarks.acceptance on the shipped draft; its JSON and stdout."""
    out = tmp_path / "acc.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", DSPARK_DATA_DIR=str(SHARED),
               DSPARK_DATA_CACHE=str(tmp_path / "data-cache"))
    res = subprocess.run([sys.executable, "-m", "benchmarks.acceptance", f"--model={smollm2_dir}",
                          "--drafts=smollm2-135m-dspark", "--max_new_tokens=12", "--batch_size=2",
                          f"--output_json={out}", *flags_],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


def test_acceptance_reports_per_prompt_tokens_per_forward(smollm2_dir, tmp_path):
    got, stdout = _acceptance(smollm2_dir, tmp_path, "--gsm8k=3", "--mt_bench=2")
    [row] = got["results"]
    for name, n in (("gsm8k", 3), ("mt_bench_turn1", 2)):
        r = row[name]
        per = r["per_prompt_tok_per_fwd"]
        assert len(per) == n and all(1.0 <= x <= 8.0 for x in per)
        # the aggregate is a mean over all verify steps: between the prompts' own figures
        assert min(per) - 1e-9 <= r["tok_per_fwd"] <= max(per) + 1e-9
        assert abs(r["tok_per_fwd"] - (1 + sum(r["per_position_acceptance"]))) < 1e-9
    assert "| smollm2-135m-dspark |" in stdout


def test_acceptance_samples_at_a_temperature(smollm2_dir, tmp_path):
    got, _ = _acceptance(smollm2_dir, tmp_path, "--gsm8k=2", "--mt_bench=0", "--temperature=1.0", "--seed=3")
    assert got["temperature"] == 1.0 and got["seed"] == 3 and list(got["results"][0]) == ["draft", "gsm8k"]
    r = got["results"][0]["gsm8k"]
    assert len(r["per_prompt_tok_per_fwd"]) == 2
    assert abs(r["tok_per_fwd"] - (1 + sum(r["per_position_acceptance"]))) < 1e-9
