"""`python -m benchmarks.peers` and its library (dspark_jax/bench/peers.py): the measurement protocol on fake systems (alternation,
warm-up, repeating runs that compiled, best/median aggregation, greedy agreement, table, JSON),
and one short run of the script on the tiny served pair (tests/serve_utils.py) with transformers
as the peer; llama.cpp is not needed (it is reported unavailable when it cannot run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_jax.bench import peers
from tests.serve_utils import write_tiny_draft, write_tiny_target

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake(key, clock, calls, seconds_per_token, tokens_for, compile_on=(), reference=None):
    """A system whose run advances the fake clock by seconds_per_token * tokens and returns
    tokens_for(prompt); it 'compiles' on the calls whose index is in compile_on."""
    state = {"compiles": 0}

    def run(ids, n):
        i = len([c for c in calls if c[0] == key])
        calls.append((key, tuple(ids), n))
        if i in compile_on:
            state["compiles"] += 1
        out = tokens_for(ids)[:n]
        clock.now += seconds_per_token[min(i, len(seconds_per_token) - 1)] * len(out)
        return out

    return peers.System(key, key.split(":")[0], key.split(":")[1], run, lambda: state["compiles"],
                        reference=reference)


def test_measure_alternates_repeats_compiling_runs_and_aggregates(tmp_path, monkeypatch):
    clock, calls = FakeClock(), []
    # the protocol collects garbage before every timed run; counted here instead of run: the fake
    # systems leave nothing to collect, and a full collection of a long-lived test process's heap
    # takes seconds each time
    collections = []
    monkeypatch.setattr(peers, "gc", SimpleNamespace(collect=lambda: collections.append(len(calls))))
    prompts = [[1, 2, 3], [4, 5]]
    def same(ids):
        return [7] * 8
    # plain: warm-up, then the first prompt's run compiles (repeated once); 0.1 s/token afterwards
    plain = _fake("ours_plain:float32", clock, calls, [0.1], same, compile_on={1})
    # spec: slower in round 1 (0.2 s/token), faster in round 2 (0.05); best and median differ
    spec = _fake("ours_spec:float32", clock, calls, [0.2, 0.2, 0.2, 0.05], same,
                 reference="ours_plain:float32")
    spec.own_plain = "ours_plain:float32"
    # peer: differs from ours on prompt 1 from token 3 on
    peer = _fake("hf_greedy:float32", clock, calls, [0.4],
                 lambda ids: [7, 7, 7, 9, 9, 9, 9, 9] if ids[0] == 4 else [7] * 8, reference="ours_plain:float32")
    gone = peers.System("llamacpp_plain", "llama.cpp, plain", "gguf", unavailable="not installed")
    # a bf16 system on a smaller workload (first prompt, 4 tokens): no ratio to the f32 baseline
    small = _fake("ours_plain:bfloat16", clock, calls, [0.5], same)
    small.num_prompts, small.max_new_tokens = 1, 4
    systems = [plain, spec, peer, gone, small]
    recs = peers.measure(systems, prompts, 8, rounds=2, warmup_tokens=2, clock=clock, pause=0, log=lambda s: None)

    # warm-up: every live system once on prompts[0] with the warm-up length, nothing for the unavailable one
    assert calls[:4] == [(s.key, (1, 2, 3), 2) for s in (plain, spec, peer, small)]
    timed = [c[0] for c in calls[4:]]
    # round 1: prompt by prompt, systems in order; plain's compiling run repeated at once
    p, s, h, b = plain.key, spec.key, peer.key, small.key
    assert timed[:8] == [p, p, s, h, b, p, s, h]
    # round 2: the order rotated by one; the bf16 system only on its one prompt
    assert timed[8:] == [s, h, b, p, s, h, p]
    assert {c[2] for c in calls[4:] if c[0] == b} == {4}
    assert len(recs) == 14 and sum(r.repeats for r in recs) == 1
    assert collections == list(range(4, len(calls)))          # one collection before each timed run

    rows = peers.summarize(systems, recs, baseline=p, max_new_tokens=8)
    row = {r["system"]: r for r in rows}
    assert row[p]["tokens_per_s_best"] == pytest.approx(10.0)
    # spec per prompt: round 1 0.2*8 = 1.6 s, round 2 0.05*8 = 0.4 s -> best 0.4, median 1.0
    assert row[s]["seconds_best"] == pytest.approx(0.8) and row[s]["seconds_median"] == pytest.approx(2.0)
    assert row[s]["tokens_per_s_best"] == pytest.approx(20.0)
    assert row[s]["ratio_vs_baseline_best"] == pytest.approx(2.0)
    assert row[s]["identical_to_reference"] == 2 and row[s]["first_difference"] == {}
    assert row[h]["identical_to_reference"] == 1 and row[h]["first_difference"] == {"1": 3}
    assert row[h]["matching_prefix_tokens"] == 11 and row[h]["reference_tokens"] == 16
    assert row[h]["ratio_vs_baseline_best"] == pytest.approx(0.25)
    assert all(row[k]["deterministic"] for k in (p, s, h))
    assert row["llamacpp_plain"]["unavailable"] == "not installed"
    assert row[b]["prompts"] == 1 and row[b]["max_new_tokens"] == 4 and row[b]["generated_tokens"] == 4
    assert "ratio_vs_baseline_best" not in row[b] and row[b]["ratio_vs_ours_plain_same_dtype_best"] == 1.0

    table = peers.markdown_table(rows, "ours plain f32")
    lines = table.splitlines()
    assert len(lines) == 2 + len(systems)
    assert "| ours_spec | f32 | 2 x 8 | 20.0 | 8.0 | 2.00x | 2.00x |  | 2/2 | 2/2 |" in table
    assert row[s]["identical_to_own_plain"] == 2 and "identical_to_own_plain" not in row[h]
    assert "1/2 (first difference at token 3)" in table
    assert "unavailable: not installed" in table
    assert "| ours_plain | bf16 | 1 x 4 | 2.0 | 2.0 | n/a | 1.00x |  | (reference) |  |" in table

    out = tmp_path / "sub" / "peers.json"
    peers.write_json(out, {"systems": rows})
    assert json.loads(out.read_text())["systems"][1]["tokens_per_s_best"] == pytest.approx(20.0)
    assert not out.with_name("peers.json.tmp").exists()


def test_cpu_info_states_flags():
    info = peers.cpu_info()
    assert info["cpus"] >= 1 and "bf16_flags" in info
    text = peers.describe_cpu(dict(info, threads={"torch": 2}))
    assert "bf16 matmul flags" in text and "torch 2" in text


def test_peers_script_on_tiny_pair(tmp_path, smollm2_dir):
    """The script end to end on a tiny random Llama (SmolLM2's tokenizer and chat template) and a
    tiny draft: ours plain/spec and transformers greedy/prompt lookup, f32, one prompt, 4 tokens."""
    pytest.importorskip("transformers")
    target = write_tiny_target(tmp_path / "target", Path(smollm2_dir))
    draft = write_tiny_draft(tmp_path / "draft")
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--model", str(target), "--draft_model", str(draft),
         "--num_prompts", "1", "--max_new_tokens", "4", "--warmup_tokens", "2", "--rounds", "1",
         "--dtypes", "float32", "--num_speculative_tokens", "3", "--threads", "1",
         "--systems", "ours_plain,ours_spec,hf_greedy,hf_pld,llamacpp_plain", "--output_json", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=""),
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| system | dtype | prompts x max tokens | tok/s (best)" in proc.stdout
    assert "bf16 matmul flags" in proc.stdout
    res = json.loads(out.read_text())
    rows = {r["system"]: r for r in res["systems"]}
    assert set(rows) == {"ours_plain:float32", "ours_spec:float32", "hf_greedy:float32", "hf_pld:float32",
                         "llamacpp_plain"}
    # no GGUF for a directory model: llama.cpp is listed as unavailable, with the reason
    assert "unavailable" in rows["llamacpp_plain"]
    for key in ("ours_plain:float32", "ours_spec:float32", "hf_greedy:float32", "hf_pld:float32"):
        assert rows[key]["generated_tokens"] >= 1 and rows[key]["tokens_per_s_best"] > 0
    assert rows["ours_spec:float32"]["identical_to_reference"] == 1 and res["speculative_equals_plain"]
    assert rows["ours_spec:float32"]["tok_per_fwd"] >= 1.0
    assert res["baseline"] == "ours_plain:float32" and res["prompts"]["count"] == 1
