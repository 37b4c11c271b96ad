"""scripts/gpu_distill.sh on the CPU with a tiny pair: probe, planned runs at once, the averaged
drafts written, and a second call (STEPS=N) that resumes a run to its planned end."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dspark_jax.checkpoint.draft_io import load_draft, save_torch_draft
from dspark_jax.data import answer_cache
from dspark_jax.train.vocab import choose_from_rows, write_choice
from tests.gen_utils import answer_samples, tiny_draft, tiny_llama
from tests.train_utils import write_tiny_run_inputs

REPO = Path(__file__).resolve().parents[2]


def _inputs(root: Path) -> dict[str, str]:
    target = tiny_llama(0)
    pair = (target, tiny_draft(target, seed=1))
    tiny = write_tiny_run_inputs(root, pair, answer_samples(target, max_new_tokens=28))
    save_torch_draft(pair[1], dict(pair[1].cfg.raw), root / "init")
    # run b's own flag: a reduced vocabulary of the 48 most frequent answer tokens
    write_choice(choose_from_rows(answer_cache.read_cache(tiny["data"]), target.cfg.vocab_size, 0.5, heldout_fraction=0.0,
                                  min_size=48), root / "vocab.json")
    return {"TARGET": str(tiny["target"]), "INIT": str(root / "init"), "DATA": str(tiny["data"]),
            "RUNS": f"a:1e-3:1 b:3e-3:2:--draft_vocab={root / 'vocab.json'},--weight_decay=0.01"}


def _run(root: Path, out: Path, budget: int, **env) -> subprocess.CompletedProcess:
    base = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
                WORK=str(root / "work"), BATCH="4", MICRO="2",
                MAX_LEN="48", ANCHORS="16", PROBE="4", AVG="2", RESERVE="5")
    base.update(env)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_distill.sh"), str(out), str(budget)], cwd=REPO,
                          env=base, capture_output=True, text=True, timeout=budget + 120, check=False)


def _model(out: Path, name: str) -> bytes:
    return (out / name / "model.safetensors").read_bytes()


def test_gpu_distill_plans_runs_writes_drafts_and_resumes(tmp_path):
    env = _inputs(tmp_path)
    out = tmp_path / "out"
    res = _run(tmp_path, out, 160, **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    planned = summary["planned_steps"]
    assert planned >= 10 and summary["probe_step_seconds"] > 0 and summary["global_batch"] == 4
    assert [r["name"] for r in summary["runs"]] == ["a", "b"]
    for r in summary["runs"]:
        assert hashlib.sha256(_model(out, r["name"])).hexdigest() == r["sha256"]
        assert 1 <= r["last_step"]["step"] <= planned          # planned, or stopped by --time_budget
        assert json.loads((out / r["name"] / "config.json").read_text()) == r["config"]
        draft = load_draft(out / r["name"])                     # a loadable draft
        kept = draft.draft_token_ids()
        assert (kept is None) == (r["name"] == "a") and (kept is None or len(kept) == 48)
    flags_b = json.loads((tmp_path / "work" / "main-b" / "flags.json").read_text())
    flags_a = json.loads((tmp_path / "work" / "main-a" / "flags.json").read_text())
    assert flags_b["weight_decay"] == 0.01 and flags_a["weight_decay"] == 0.0 and not flags_a["draft_vocab"]
    a, b = (_model(out, n) for n in "ab")
    assert a != b                                               # two runs (lr, seed), not one twice

    # the second call: no probe, both runs resume to the planned step and decay their lr to 0
    out2 = tmp_path / "out2"
    res = _run(tmp_path, out2, 100, STEPS=str(planned), OVERHEAD="20", **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary2 = json.loads((out2 / "summary.json").read_text())
    assert summary2["probe_step_seconds"] == 0 and summary2["planned_steps"] == planned
    for r in summary2["runs"]:
        assert r["last_step"]["step"] == planned and r["last_step"]["lr"] == 0.0
        assert hashlib.sha256(_model(out2, r["name"])).hexdigest() == r["sha256"]
    assert not list((tmp_path / "work").glob("probe-b"))        # the probe ran the first run alone

    # a known step time instead of a probe: the length planned from it, the runs trained to it
    out3 = tmp_path / "out3"
    res = _run(tmp_path, out3, 100, STEP_S="2", OVERHEAD="30", WORK=str(tmp_path / "work3"), **env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary3 = json.loads((out3 / "summary.json").read_text())
    assert summary3["probe_step_seconds"] == 2.0 and 10 <= summary3["planned_steps"] <= (100 - 5 - 30 - 30) // 2 + 1
    assert not (tmp_path / "work3" / "probe-a").exists()
    assert all(1 <= r["last_step"]["step"] <= summary3["planned_steps"] for r in summary3["runs"])
