"""Concurrent streaming clients against the OpenAI-compatible server, on loopback.

    python -m benchmarks.serve_load                                   # starts the demo pair itself
    python -m benchmarks.serve_load --concurrency 1,2,4,8,16 --max_tokens 64 --requests_per_client 2
    python -m benchmarks.serve_load --url http://127.0.0.1:8000       # a server already running
    python -m benchmarks.serve_load --server_flags="--max_model_len 8192" --drafts default,none

For each draft setting (`--drafts`: the server's default draft and `none`, plain decoding) it
starts `python -m serve.server` with `--server_flags` on a free port (unless `--url` is given),
waits for /health, and for each concurrency c runs c clients, each streaming
`--requests_per_client` GSM8K chat requests one after another (greedy, `--max_tokens` tokens).
Prints per concurrency: total tokens/s (every client's tokens over the wall time), tokens/s per
stream (median), time to first token (median, p90) and the time between streamed chunks (p50,
p90, p99; with speculation a chunk carries the 1..T+1 tokens of one verify step). With
`--untimed_pass` (the default) each concurrency's requests are sent once untimed first, so the
timed pass meets programs the server has already compiled and run (the first run of a compiled
program costs far more than the next on XLA:CPU); `--nountimed_pass` times that first contact.
CPU numbers are only meaningful as ratios measured in one run.

`--generate_reference` (on by default when the benchmark starts the servers) then stops the
server and runs the same requests through `generate()` in this process, the same draft setting
and the library's defaults (the demo pair unless `--reference_model` / `--reference_draft` name
others): for each concurrency c, each round of c requests (every client's k-th) as one call, after
one untimed pass. It prints the server's total tokens/s over `generate()`'s, the library's own
speed on the same work. Meaningful when `--server_flags` changes only serving limits (slots,
context, budgets), not the model or its dtype.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

_URL = flags.DEFINE_string("url", None, "a running server (then --drafts and --server_flags are not used)")
_CONC = flags.DEFINE_string("concurrency", "1,2,4,8,16", "comma-separated numbers of concurrent clients")
_PER = flags.DEFINE_integer("requests_per_client", 2, "requests each client streams one after another",
                            lower_bound=1)
_NEW = flags.DEFINE_integer("max_tokens", 64, "max_tokens of every request", lower_bound=1)
_DRAFTS = flags.DEFINE_string("drafts", "default,none", "draft settings to serve: 'default' (the server's "
                              "default draft), 'none' (plain decoding) or a --draft_model value")
_SERVER_FLAGS = flags.DEFINE_string("server_flags", "", "extra serve.server flags, e.g. '--max_model_len 8192'")
_API_KEY = flags.DEFINE_string("api_key", None, "the server's --api_key, if any")
_JSON = flags.DEFINE_string("output_json", None, "write the results here")
_START_TIMEOUT = flags.DEFINE_float("start_timeout", 1800.0, "seconds to wait for a started server's /health")
_REFERENCE = flags.DEFINE_bool("generate_reference", True, "also time generate() on the same requests, in this "
                               "process, after each started server stops (not with --url)")
_UNTIMED = flags.DEFINE_bool("untimed_pass", True, "send each concurrency's requests once untimed before timing "
                             "them, as the generate() reference does: both are then timed with the programs "
                             "the work meets compiled and run once (--nountimed_pass times a server's first "
                             "contact with them)")
_REF_MODEL = flags.DEFINE_string("reference_model", "smollm2-135m", "the target generate() loads for the reference")
_REF_DRAFT = flags.DEFINE_string("reference_draft", "smollm2-135m-dspark", "the draft of the reference for the "
                                 "'default' draft setting")

def _questions() -> list[str]:
    """GSM8K test questions (the data registry fetches the file once)."""
    from dspark_jax.data.eval_sets import load_gsm8k
    return [item.turns[0] for item in load_gsm8k(limit=256)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _one(client, url: str, question: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, tokens = [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                chunks.append(time.perf_counter())
    end = time.perf_counter()
    return {"tokens": tokens, "seconds": end - start, "ttft": (chunks[0] - start) if chunks else end - start,
            "gaps": [b - a for a, b in zip(chunks, chunks[1:])]}


async def _round(url: str, concurrency: int, per_client: int, max_tokens: int, questions: list[str]) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {_API_KEY.value}"} if _API_KEY.value else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, headers=headers, limits=limits) as client:
        async def worker(c: int) -> list[dict]:
            return [await _one(client, url, questions[(c * per_client + k) % len(questions)], max_tokens)
                    for k in range(per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(c) for c in range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    return {"concurrency": concurrency, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "wall_s": wall, "total_tok_s": sum(r["tokens"] for r in results) / wall,
            "stream_tok_s_median": statistics.median(r["tokens"] / r["seconds"] for r in results),
            "ttft_ms_median": 1000 * statistics.median(ttft), "ttft_ms_p90": 1000 * _pct(ttft, 0.9),
            "gap_ms_p50": 1000 * _pct(gaps, 0.5), "gap_ms_p90": 1000 * _pct(gaps, 0.9),
            "gap_ms_p99": 1000 * _pct(gaps, 0.99)}


def _reference(draft: str, concurrency: list[int], per_client: int, max_tokens: int,
               questions: list[str]) -> dict[int, float]:
    """generate()'s total tokens/s on the requests `_round` sends, per concurrency: each client's
    k-th request of every client in one call (one untimed pass first, which compiles)."""
    from dspark_jax import generate, load_target
    from dspark_jax.serving.pair import load_draft_spec

    target = load_target(_REF_MODEL.value, dtype="auto")
    d = load_draft_spec(_REF_DRAFT.value if draft == "default" else draft, target)
    out = {}
    for c in concurrency:
        batches = [[[{"role": "user", "content": questions[(i * per_client + k) % len(questions)]}]
                    for i in range(c)] for k in range(per_client)]
        for timed in (False, True):
            tokens, start = 0, time.perf_counter()
            for batch in batches:
                res = generate(target, d, batch, max_new_tokens=max_tokens)
                tokens += sum(len(o.token_ids) for o in res.outputs)
            if timed:
                out[c] = tokens / (time.perf_counter() - start)
        print(f"  generate(): {c} requests a call, {out[c]:.1f} tok/s", flush=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(draft: str, extra: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "serve.server", "--port", str(port), *shlex.split(extra)]
    if draft != "default":
        cmd += ["--draft_model", draft]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _START_TIMEOUT.value
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start (log: {log_path}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def _table(rows: list[dict]) -> list[str]:
    out = ["| draft | clients | total tok/s | generate() tok/s | server / generate() | tok/s per stream (median) | "
           "TTFT ms (median / p90) | chunk gap ms (p50 / p90 / p99) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = r.get("generate_tok_s")
        vs = f"{ref:.1f} | {r['total_tok_s'] / ref:.2f}x" if ref else "- | -"
        out.append(f"| {r['draft']} | {r['concurrency']} | {r['total_tok_s']:.1f} | {vs} | "
                   f"{r['stream_tok_s_median']:.1f} | {r['ttft_ms_median']:.0f} / {r['ttft_ms_p90']:.0f} | "
                   f"{r['gap_ms_p50']:.0f} / {r['gap_ms_p90']:.0f} / {r['gap_ms_p99']:.0f} |")
    return out


def main(argv) -> None:
    del argv
    concurrency = [int(x) for x in _CONC.value.split(",")]
    questions = _questions()
    drafts = ["(running server)"] if _URL.value else _DRAFTS.value.split(",")
    rows = []
    for draft in drafts:
        proc = None
        if _URL.value:
            url = _URL.value.rstrip("/")
        else:
            log_path = Path(f"/tmp/serve_load_{os.getpid()}_{draft.replace('/', '_')}.log")
            print(f"starting serve.server (draft {draft}) {_SERVER_FLAGS.value}; log {log_path}", flush=True)
            t0 = time.perf_counter()
            proc, url = _start(draft, _SERVER_FLAGS.value, log_path)
            print(f"  up in {time.perf_counter() - t0:.0f} s", flush=True)
        got = []
        try:
            asyncio.run(_round(url, 1, 1, _NEW.value, questions))       # first contact, untimed
            for c in concurrency:
                if _UNTIMED.value:
                    asyncio.run(_round(url, c, _PER.value, _NEW.value, questions))
                r = asyncio.run(_round(url, c, _PER.value, _NEW.value, questions))
                r["draft"] = draft
                got.append(r)
                print("\n".join(_table([r])[-1:]), flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
        if proc is not None and _REFERENCE.value:
            ref = _reference(draft, concurrency, _PER.value, _NEW.value, questions)
            for r in got:
                r["generate_tok_s"] = ref[r["concurrency"]]
        rows += got
    print("\n" + "\n".join(_table(rows)))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
