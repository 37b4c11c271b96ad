"""`python -m benchmarks.peers` and its libraries (dspark_jax/bench/peers.py, llama_cpp.py): the measurement protocol on fake systems (alternation,
warm-up, repeating runs that compiled, best/median aggregation, greedy agreement, table, JSON),
and one short run of the script on the tiny served pair (tests/serve_utils.py) with transformers
as the peer; llama.cpp is not needed (llama-cpp-python is reported unavailable when it cannot run;
llama-bench is a fake script printing llama-bench's JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_jax.bench import llama_cpp, peers
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


def _llama_bench_json(gguf: str, threads: int, n_prompt: int, n_gen: int, tg: float, size: int) -> str:
    """What llama-bench -o json prints (the fields benchmarks.peers reads, and some it does not)."""
    tests = []
    for p, g, ts in ((n_prompt, 0, 7 * tg), (0, n_gen, tg)):
        tests.append({"build_commit": "0c1e570", "build_number": 1, "cpu_info": "Some CPU", "backends": "CPU",
                      "model_filename": gguf, "model_type": "llama 256M BF16", "model_size": size,
                      "model_n_params": size // 2, "n_batch": 2048, "n_threads": threads, "type_k": "f16",
                      "n_prompt": p, "n_gen": g, "n_depth": 0, "test_time": "2026-01-01T00:00:00Z",
                      "avg_ns": int(1e9 * (p or g) / ts), "stddev_ns": 1000, "avg_ts": ts, "stddev_ts": 0.5,
                      "samples_ns": [1, 2, 3], "samples_ts": [ts, ts, ts]})
    return json.dumps(tests, indent=2)


FAKE_LLAMA_BENCH = """#!{python}
import sys
sys.path.insert(0, {root!r})
from tests.bench.test_peers import _llama_bench_json
a = sys.argv[1:]
opt = dict(zip(a[::2], a[1::2]))
assert sorted(opt) == ["-m", "-n", "-o", "-p", "-r", "-t"] and opt["-o"] == "json" and opt["-r"] == "3", a
tg = 100.0 if opt["-m"].endswith("-bf16.gguf") else 250.0
print(_llama_bench_json(opt["-m"], int(opt["-t"]), int(opt["-p"]), int(opt["-n"]), tg,
                        1000 if tg == 100.0 else 500))
"""


FAKE_LLAMA_SERVER = """#!{python}
# llama-server's /health and /completion: the continuation counts up from the prompt's last id,
# n_predict tokens, or stops on EOS (id 2, left out of "tokens") after 3 when the prompt has id 7
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
a = sys.argv[1:]
opt = dict(zip(a[::2], a[1::2]))
assert {{"-m", "-t", "-c", "-np", "--host", "--port"}} <= set(opt) and opt.get("--spec-type", "none") in (
    "none", "ngram-simple"), a


class H(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0 and req["cache_prompt"] is False and req["return_tokens"], req
        eos = 7 in req["prompt"]
        n = min(3, req["n_predict"]) if eos else req["n_predict"]
        self.reply({{"tokens": [req["prompt"][-1] + 1 + i for i in range(n)],
                    "stop_type": "eos" if eos else "limit"}})


ThreadingHTTPServer((opt["--host"], int(opt["--port"])), H).serve_forever()
"""


def _fake_binaries(tmp_path, types=("bf16", "q8_0"), model="target") -> Path:
    lc = tmp_path / "llama.cpp"
    (lc / "bin").mkdir(parents=True)
    (lc / "gguf").mkdir()
    for name, text in (("llama-bench", FAKE_LLAMA_BENCH), ("llama-server", FAKE_LLAMA_SERVER)):
        (lc / "bin" / name).write_text(text.format(python=sys.executable, root=str(ROOT)))
        (lc / "bin" / name).chmod(0o755)
    for t in types:
        (lc / "gguf" / f"{model}-{t}.gguf").write_bytes(b"GGUF")
    return lc


def test_llama_server_and_streams(tmp_path):
    lc = _fake_binaries(tmp_path)
    assert set(llama_cpp.llama_cpp_ggufs(lc, "target")) == {"bf16", "q8_0"}
    with pytest.raises(FileNotFoundError, match="convert_gguf.sh"):
        llama_cpp.llama_cpp_ggufs(lc, "other")
    with pytest.raises(FileNotFoundError, match="build_llama_cpp.sh"):
        llama_cpp.binary(lc, "llama-cli")
    srv_bin = llama_cpp.binary(lc, "llama-server")
    with llama_cpp.LlamaServer(srv_bin, lc / "gguf" / "target-bf16.gguf", 1, 64) as a, \
            llama_cpp.LlamaServer(srv_bin, lc / "gguf" / "target-bf16.gguf", 1, 64, spec_type="ngram-simple") as b:
        assert a.port != b.port and "--spec-type" not in a.command and b.command[-2:] == ["--spec-type",
                                                                                            "ngram-simple"]
        assert a.complete([5, 10], 4, eos=[2]) == [11, 12, 13, 14]
        assert a.complete([7, 10], 8, eos=[2]) == [11, 12, 13, 2]       # stopped on EOS: appended
        systems = llama_cpp.server_systems({("bf16", "none"): a, ("bf16", "ngram-simple"): b}, [2], "ours_plain:x")
        assert [s.key for s in systems] == ["lcpp_server:bf16", "lcpp_server_ngram-simple:bf16"]
        assert systems[1].own_plain == "lcpp_server:bf16" and systems[0].own_plain is None
        assert systems[1].run([1], 2) == [2, 3] and systems[0].dtype == "gguf-bf16"
        res = llama_cpp.best_of(lambda: llama_cpp.concurrent_streams(lambda ids, n: a.complete(ids, n, [2]),
                                                                      [[1], [7, 20], [30]], 5), rounds=2)
        assert res["output_token_ids"] == [[2, 3, 4, 5, 6], [21, 22, 23, 2], [31, 32, 33, 34, 35]]
        assert res["streams"] == 3 and res["generated_tokens"] == 14 and len(res["seconds"]) == 2
    assert a.proc.poll() is not None and b.proc.poll() is not None      # ended on exit
    dead = llama_cpp.LlamaServer(lc / "bin" / "llama-bench", lc / "gguf" / "target-bf16.gguf", 1, 64)
    with pytest.raises(RuntimeError, match="exited with"):
        dead.__enter__()


def test_parse_llama_bench_and_rows():
    res = llama_cpp.parse_llama_bench(_llama_bench_json("m.gguf", 2, 512, 128, 100.0, 2_000_000_000), "m.gguf")
    assert res["tg"] == {"tokens": 128, "tokens_per_s": 100.0, "stddev": 0.5, "samples": [100.0] * 3}
    assert res["pp"]["tokens"] == 512 and res["pp"]["tokens_per_s"] == 700.0
    assert res["model_size_bytes"] == 2_000_000_000 and res["n_threads"] == 2
    q8 = llama_cpp.parse_llama_bench(_llama_bench_json("q.gguf", 2, 0, 128, 160.0, 1_000_000_000), "q.gguf")
    assert "pp" not in q8                                  # -p 0: generation only
    ours = [{"system": "ours_plain:bfloat16", "label": "ours, plain", "dtype": "bfloat16", "prompts": 2,
             "max_new_tokens": 16, "tokens_per_s_best": 50.0, "weight_bytes": 3_000_000_000},
            {"system": "ours_spec:bfloat16", "label": "ours, speculative (T=7)", "dtype": "bfloat16", "prompts": 2,
             "max_new_tokens": 16, "tokens_per_s_best": 120.0, "tok_per_fwd": 2.5},
            {"system": "hf_greedy:bfloat16", "label": "transformers", "dtype": "bfloat16", "prompts": 2,
             "max_new_tokens": 16, "tokens_per_s_best": 10.0}]
    rows = {r["system"]: r for r in llama_cpp.llama_cpp_rows({"bf16": res, "q8_0": q8}, ours)}
    assert set(rows) == {"llama.cpp:bf16", "llama.cpp:q8_0", "ours_plain:bfloat16", "ours_spec:bfloat16"}
    assert rows["llama.cpp:bf16"]["effective_gb_per_s"] == pytest.approx(200.0)
    assert rows["llama.cpp:q8_0"]["ratio_vs_llama_cpp_bf16_tg"] == pytest.approx(1.6)
    assert rows["ours_plain:bfloat16"]["effective_gb_per_s"] == pytest.approx(150.0)
    assert rows["ours_plain:bfloat16"]["ratio_vs_llama_cpp_bf16_tg"] == pytest.approx(0.5)
    assert rows["ours_spec:bfloat16"]["ratio_vs_llama_cpp_bf16_tg"] == pytest.approx(1.2)
    assert "effective_gb_per_s" not in rows["ours_spec:bfloat16"]
    with_bw = {r["system"]: r for r in llama_cpp.llama_cpp_rows({"bf16": res}, ours, bandwidth_gb_s=400.0)}
    assert with_bw["llama.cpp:bf16"]["bandwidth_fraction"] == pytest.approx(0.5)
    assert "bandwidth_fraction" not in with_bw["ours_spec:bfloat16"]
    table = llama_cpp.llama_cpp_table(list(rows.values()))
    assert "| llama.cpp llama-bench, plain | Q8_0 (other weights: 8-bit blocks) GGUF | 1 | 160.0 ± 0.5 (tg128) |" in table
    assert "| ours, plain | bf16 | 1 | 50.0 (2 prompts x 16) |  | 150.0 | 0.50x |  |" in table
    no_tg = _llama_bench_json("m", 1, 512, 0, 1.0, 1)      # a prompt test only
    for bad, msg in (("not json", "not JSON"), ("[]", "non-empty list"), ('[{"n_gen": 1}]', "lacks model_type"),
                     (no_tg, "no generation test")):
        with pytest.raises(ValueError, match=msg):
            llama_cpp.parse_llama_bench(bad, "x.gguf")


def test_peers_script_on_tiny_pair(tmp_path, smollm2_dir):
    """The script end to end on a tiny random Llama (SmolLM2's tokenizer and chat template) and a
    tiny draft: ours plain/spec and transformers greedy/prompt lookup, f32, one prompt, 4 tokens;
    llama.cpp through a fake llama-bench on two GGUF names and a fake llama-server (plain, n-gram,
    2 slots)."""
    pytest.importorskip("transformers")
    target = write_tiny_target(tmp_path / "target", Path(smollm2_dir))
    draft = write_tiny_draft(tmp_path / "draft")
    lc = _fake_binaries(tmp_path)
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--model", str(target), "--draft_model", str(draft),
         "--num_prompts", "1", "--max_new_tokens", "4", "--warmup_tokens", "2", "--rounds", "1",
         "--dtypes", "float32", "--num_speculative_tokens", "3", "--threads", "1", "--llama_cpp_dir", str(lc),
         "--llama_server_weights", "bf16", "--llama_server_slots", "2",
         "--systems", "ours_plain,ours_spec,hf_greedy,hf_pld,llamacpp_plain", "--output_json", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=""),
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| system | dtype | prompts x max tokens | tok/s (best)" in proc.stdout
    assert "bf16 matmul flags" in proc.stdout
    res = json.loads(out.read_text())
    rows = {r["system"]: r for r in res["systems"]}
    assert set(rows) == {"ours_plain:float32", "ours_spec:float32", "hf_greedy:float32", "hf_pld:float32",
                         "llamacpp_plain", "lcpp_server:bf16", "lcpp_server_ngram-simple:bf16"}
    # the fake server's outputs are not the model's: counted against ours plain, not asserted
    assert rows["lcpp_server:bf16"]["compared_prompts"] == 1 and rows["lcpp_server:bf16"]["generated_tokens"] == 4
    assert rows["lcpp_server_ngram-simple:bf16"]["identical_to_own_plain"] == 1
    # no GGUF for a directory model: llama.cpp is listed as unavailable, with the reason
    assert "unavailable" in rows["llamacpp_plain"]
    for key in ("ours_plain:float32", "ours_spec:float32", "hf_greedy:float32", "hf_pld:float32"):
        assert rows[key]["generated_tokens"] >= 1 and rows[key]["tokens_per_s_best"] > 0
    assert rows["ours_spec:float32"]["identical_to_reference"] == 1 and res["speculative_equals_plain"]
    assert rows["ours_spec:float32"]["tok_per_fwd"] >= 1.0
    assert res["baseline"] == "ours_plain:float32" and res["prompts"]["count"] == 1
    lc_rows = {r["system"]: r for r in res["llama_cpp"]}
    assert set(lc_rows) == {"llama.cpp:bf16", "llama.cpp:q8_0", "ours_plain:float32", "ours_spec:float32",
                            "lcpp_server:bf16", "lcpp_server_ngram-simple:bf16", "lcpp_server_np2:bf16",
                            "ours_plain_batch2:bfloat16"}
    assert lc_rows["lcpp_server:bf16"]["weight_bytes"] == 1000 and lc_rows["lcpp_server_np2:bf16"]["batch"] == 2
    assert lc_rows["lcpp_server_np2:bf16"]["generated_tokens"] == 8 and "-np 2" in lc_rows["lcpp_server_np2:bf16"][
        "command"]
    assert lc_rows["ours_plain_batch2:bfloat16"]["streams"] == 2
    assert lc_rows["llama.cpp:bf16"]["tg_tokens_per_s"] == 100.0 and lc_rows["llama.cpp:bf16"]["pp_tokens"] == 512
    assert lc_rows["llama.cpp:q8_0"]["ratio_vs_llama_cpp_bf16_tg"] == pytest.approx(2.5)
    assert "-t 1 -p 512 -n 128 -r 3 -o json" in lc_rows["llama.cpp:bf16"]["command"]
    plain = lc_rows["ours_plain:float32"]
    assert plain["weight_bytes"] > 0 and plain["effective_gb_per_s"] == pytest.approx(
        plain["weight_bytes"] * rows["ours_plain:float32"]["tokens_per_s_best"] / 1e9)
    assert "| llama.cpp llama-bench, plain | BF16 GGUF | 1 | 100.0 ± 0.5 (tg128) | 700 (pp512) | 0.0 (0%) | 1.00x |" \
        in proc.stdout
