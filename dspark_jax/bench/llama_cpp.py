"""llama.cpp's own binaries beside ours (`python -m benchmarks.peers --llama_cpp_dir DIR`), run as
its users run them: `llama-bench` per GGUF (tg / pp tokens/s from its JSON) and `llama-server`
(HTTP `/completion` with our prompt token ids, temperature 0) at one slot, plain and with its
n-gram speculative mode, and at 8 slots with 8 concurrent requests. DIR is a build of
scripts/build_llama_cpp.sh with GGUFs of scripts/convert_gguf.sh in DIR/gguf."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dspark_jax.bench.peers import DTYPE_SHORT, System

# GGUF output types of scripts/convert_gguf.sh -> table label; Q8_0 is not our weights
LLAMA_CPP_WEIGHTS = {"bf16": "BF16", "f16": "F16", "q8_0": "Q8_0 (other weights: 8-bit blocks)"}
# llama-server's speculative modes measured: --spec-type value -> label (defaults of this build's
# options; ngram-simple drafts the continuation of the last earlier match of the context's last n-gram)
SERVER_SPEC = {"none": "plain", "ngram-simple": "n-gram lookup (ngram-simple)"}


def llama_cpp_ggufs(llama_cpp_dir: str | os.PathLike, model: str) -> dict[str, Path]:
    """The GGUFs scripts/convert_gguf.sh wrote: DIR/gguf/MODEL-{bf16,f16,q8_0}.gguf, those present."""
    found = {t: Path(llama_cpp_dir) / "gguf" / f"{model}-{t}.gguf" for t in LLAMA_CPP_WEIGHTS}
    found = {t: p for t, p in found.items() if p.is_file()}
    if not found:
        raise FileNotFoundError(f"no GGUF {Path(llama_cpp_dir) / 'gguf' / (model + '-{bf16,f16,q8_0}.gguf')}: "
                                f"run scripts/convert_gguf.sh {llama_cpp_dir} {model}")
    return found


def binary(llama_cpp_dir: str | os.PathLike, name: str) -> Path:
    path = Path(llama_cpp_dir) / "bin" / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"no executable {path}: run scripts/build_llama_cpp.sh {llama_cpp_dir}")
    return path


# ---------------------------------------------------------------------------------------------
# llama-bench

def llama_bench_command(binary: str | os.PathLike, gguf: str | os.PathLike, threads: int, n_gen: int = 128,
                        n_prompt: int = 512, repetitions: int = 3) -> list[str]:
    """tg`n_gen` (decoding from an empty context) and pp`n_prompt` (one prompt batch) as two tests."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
            "-r", str(repetitions), "-o", "json"]


def parse_llama_bench(text: str, source: str) -> dict[str, Any]:
    """llama-bench's `-o json` output (a list, one object per test) -> model facts and, per test
    ("tg" n_gen > 0 and no prompt, "pp" a prompt and no generation), tokens/s mean and stddev."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: llama-bench output is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{source}: llama-bench JSON is not a non-empty list of tests")
    need = ("model_type", "model_size", "n_threads", "n_prompt", "n_gen", "avg_ts", "stddev_ts")
    out: dict[str, Any] = {}
    for i, t in enumerate(tests):
        missing = [k for k in need if not isinstance(t, dict) or k not in t]
        if missing:
            raise ValueError(f"{source}: llama-bench test {i} lacks {', '.join(missing)}")
        kind = "tg" if t["n_gen"] > 0 and t["n_prompt"] == 0 else "pp" if t["n_prompt"] > 0 and t["n_gen"] == 0 \
            else None
        if kind is None:
            continue
        out.update(model_type=t["model_type"], model_size_bytes=int(t["model_size"]),
                   model_n_params=t.get("model_n_params"), n_threads=t["n_threads"],
                   build_commit=t.get("build_commit"), cpu_info=t.get("cpu_info"))
        out[kind] = {"tokens": t["n_prompt"] or t["n_gen"], "tokens_per_s": float(t["avg_ts"]),
                     "stddev": float(t["stddev_ts"]), "samples": t.get("samples_ts")}
    if "tg" not in out:
        raise ValueError(f"{source}: llama-bench printed no generation test (n_gen > 0, n_prompt = 0)")
    return out


def run_llama_bench(binary: str | os.PathLike, gguf: str | os.PathLike, threads: int, n_gen: int = 128,
                    n_prompt: int = 512, repetitions: int = 3) -> dict[str, Any]:
    cmd = llama_bench_command(binary, gguf, threads, n_gen, n_prompt, repetitions)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    res = parse_llama_bench(proc.stdout, str(gguf))
    res["command"] = shlex.join(cmd)
    return res


# ---------------------------------------------------------------------------------------------
# llama-server

class LlamaServer:
    """One `llama-server` process on a free local port, started and ready on enter, ended on exit
    (its log goes to a temporary file, whose tail a failed start reports)."""

    def __init__(self, binary: str | os.PathLike, gguf: str | os.PathLike, threads: int, n_ctx: int,
                 slots: int = 1, spec_type: str = "none", start_timeout: float = 300.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # -c is the whole KV cache, split over the slots
        self.command = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(n_ctx * slots),
                        "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port)]
        if spec_type != "none":
            self.command += ["--spec-type", spec_type]
        self.timeout, self.proc, self.log = start_timeout, None, None

    def __enter__(self) -> "LlamaServer":
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                self._fail(f"exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self._fail(f"not ready after {self.timeout:.0f} s")
            time.sleep(0.2)

    def _fail(self, why: str):
        self.log.seek(0)
        tail = self.log.read()[-2000:]
        self.__exit__()
        raise RuntimeError(f"{shlex.join(self.command)} {why}: {tail}")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()

    def complete(self, ids: Sequence[int], n: int, eos: Sequence[int]) -> list[int]:
        """Greedy continuation of prompt token ids (no prompt cache across requests), EOS included
        when it stopped on one (the server leaves it out of `tokens`)."""
        body = json.dumps({"prompt": list(ids), "n_predict": n, "temperature": 0.0, "cache_prompt": False,
                           "return_tokens": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            res = json.load(r)
        tokens = [int(t) for t in res["tokens"]]
        if res.get("stop_type") == "eos" and (not tokens or tokens[-1] not in eos):
            tokens.append(int(eos[0]))
        return tokens


def server_systems(servers: dict[tuple[str, str], LlamaServer], eos: Sequence[int],
                   reference: str | None) -> list[System]:
    """One batch-1 System per started one-slot server, keyed by (GGUF type, --spec-type)."""
    out = []
    for (t, spec), srv in servers.items():
        plain = f"lcpp_server:{t}"
        out.append(System(plain if spec == "none" else f"lcpp_server_{spec}:{t}",
                          f"llama.cpp llama-server, {SERVER_SPEC[spec]}", f"gguf-{t}",
                          lambda ids, n, srv=srv: srv.complete(ids, n, eos), reference=reference,
                          own_plain=plain if spec != "none" and (t, "none") in servers else None))
    return out


def concurrent_streams(generate_one: Callable[[list[int], int], list[int]], prompts: Sequence[list[int]],
                       n: int) -> tuple[float, list[list[int]]]:
    """All prompts at once, one thread each (what `-np 8` slots serve): wall seconds and outputs."""
    outs: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(i):
        try:
            outs[i] = generate_one(list(prompts[i]), n)
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, outs


def best_of(run: Callable[[], tuple[float, list[list[int]]]], rounds: int) -> dict[str, Any]:
    """A many-stream workload timed `rounds` times after one untimed warm-up: aggregate tok/s."""
    run()
    times, outs = [], None
    for _ in range(rounds):
        sec, outs = run()
        times.append(sec)
    n_tok = sum(len(o) for o in outs)
    return {"streams": len(outs), "generated_tokens": n_tok, "seconds": times,
            "tokens_per_s_best": n_tok / min(times), "output_token_ids": outs}


# ---------------------------------------------------------------------------------------------
# the table beside ours

def llama_cpp_rows(bench: dict[str, dict[str, Any]], ours_rows: Sequence[dict[str, Any]],
                   streams: Sequence[dict[str, Any]] = (), bandwidth_gb_s: float | None = None
                   ) -> list[dict[str, Any]]:
    """llama-bench's rows (per GGUF type), our and llama-server's rows at batch 1 (from summarize)
    and the many-stream rows in one list: tokens/s, effective GB/s for plain decoding (weight bytes
    x tokens/s) and its fraction of the measured read bandwidth, ratio to llama.cpp BF16 tg."""
    base = bench.get("bf16", {}).get("tg", {}).get("tokens_per_s")
    rows = []
    for t, b in bench.items():
        tg = b["tg"]["tokens_per_s"]
        rows.append({"system": f"llama.cpp:{t}", "label": "llama.cpp llama-bench, plain", "batch": 1,
                     "weights": f"{LLAMA_CPP_WEIGHTS.get(t, t)} GGUF", "tg_tokens_per_s": tg,
                     "tg_stddev": b["tg"]["stddev"], "tg_tokens": b["tg"]["tokens"],
                     "pp_tokens_per_s": b.get("pp", {}).get("tokens_per_s"), "pp_tokens": b.get("pp", {}).get("tokens"),
                     "weight_bytes": b["model_size_bytes"], "effective_gb_per_s": b["model_size_bytes"] * tg / 1e9,
                     "command": b.get("command"), "build_commit": b.get("build_commit")})
    sizes = {t: b["model_size_bytes"] for t, b in bench.items()}
    for r in ours_rows:
        if "unavailable" in r or not r["system"].startswith(("ours_plain", "ours_spec", "lcpp_server")):
            continue
        gguf = r["dtype"].removeprefix("gguf-") if r["dtype"].startswith("gguf-") else None
        row = {"system": r["system"], "label": r["label"], "batch": 1,
               "weights": f"{LLAMA_CPP_WEIGHTS.get(gguf, gguf)} GGUF" if gguf else DTYPE_SHORT.get(r["dtype"],
                                                                                                     r["dtype"]),
               "decode_tokens_per_s": r["tokens_per_s_best"], "prompts": r["prompts"],
               "max_new_tokens": r["max_new_tokens"]}
        size = r.get("weight_bytes") if r["system"].startswith("ours_plain") else \
            sizes.get(gguf) if r["system"].startswith("lcpp_server:") else None
        if size:
            row["weight_bytes"] = size
            row["effective_gb_per_s"] = size * r["tokens_per_s_best"] / 1e9
        if "tok_per_fwd" in r:
            row["tok_per_fwd"] = r["tok_per_fwd"]
        rows.append(row)
    for s in streams:
        rows.append({k: v for k, v in s.items() if k != "output_token_ids"} | {
            "decode_tokens_per_s": s["tokens_per_s_best"]})
    for row in rows:
        tps = row.get("tg_tokens_per_s", row.get("decode_tokens_per_s"))
        if base:
            row["ratio_vs_llama_cpp_bf16_tg"] = tps / base
        if bandwidth_gb_s and "effective_gb_per_s" in row:
            row["bandwidth_fraction"] = row["effective_gb_per_s"] / bandwidth_gb_s
    return rows


def llama_cpp_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| system | weights | batch | decoding tok/s | prompt tok/s | effective GB/s (of read bandwidth) | "
             "vs llama.cpp BF16 tg | tok/fwd |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "tg_tokens_per_s" in r:
            dec = f"{r['tg_tokens_per_s']:.1f} ± {r['tg_stddev']:.1f} (tg{r['tg_tokens']})"
            pp = f"{r['pp_tokens_per_s']:.0f} (pp{r['pp_tokens']})" if r.get("pp_tokens_per_s") else ""
        else:
            dec = f"{r['decode_tokens_per_s']:.1f} ({r['prompts']} prompts x {r['max_new_tokens']})"
            pp = ""
        gbs = f"{r['effective_gb_per_s']:.1f}" if "effective_gb_per_s" in r else ""
        if "bandwidth_fraction" in r:
            gbs += f" ({100 * r['bandwidth_fraction']:.0f}%)"
        ratio = f"{r['ratio_vs_llama_cpp_bf16_tg']:.2f}x" if "ratio_vs_llama_cpp_bf16_tg" in r else "n/a"
        tpf = f"{r['tok_per_fwd']:.2f}" if "tok_per_fwd" in r else ""
        lines.append(f"| {r['label']} | {r['weights']} | {r['batch']} | {dec} | {pp} | {gbs} | {ratio} | {tpf} |")
    return "\n".join(lines)
