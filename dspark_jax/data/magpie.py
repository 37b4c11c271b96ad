"""Chat prompts written by the target itself (the Magpie method, Xu et al. 2024).

An instruction-tuned target that is given its chat template only up to the opening of a user turn
continues with a user request drawn from what it was tuned on. Sampled at temperature ~1 and cut
at the end of the turn, those requests are chat-like prompts without any external prompt set: the
pool's other sources are maths, code and IFEval, none of them conversation, and no package
registry ships an open chat-prompt set. The requests then go through the pool's usual filters
(`python -m train.prompts --sources magpie`: decontamination against the benchmarks, duplicates)
and `train.regen` answers them like any other prompt.

Steered requests (`openers`, as Magpie's task-specific variants steer with the template): the
turn opens with one of a few given words ("Write", "Pretend", ...) and the target continues from
there, so a pool can hold the kinds of request (creative writing, role-play) that the unsteered
target seldom writes. The requests take the openers in turn (a round's i-th request the (n + i)-th,
n the rows already cached); ids are then "magpie-open/<seed>-<n>", so a steered and an unsteered
cache never share an id.

Query cache (JSONL, appended as requests finish, fsync'ed; resumable):

    {"id": "magpie/<seed>-<n>", "text": str, "query": str | null, "finish_reason": "stop" | "length",
     "num_tokens": int}

`text` is the opener (if any) and what the target wrote after it.

`query` is the cleaned request, or null where it was rejected (cut at max_new_tokens, too short,
template markup). `<cache>.meta.json` pins the sampling settings; resuming with others is refused.
Each resumed round seeds its sampler with the number of rows already cached, so a resume never
replays the samples it has.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the same cache conventions as the answer cache: appended JSONL, settings pinned beside it
from dspark_jax.data.answer_cache import check_meta, meta_path, read_cache, repair_tail, stop_admitting
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.generate import engine_for
from dspark_jax.decode.requests import eos_ids, output_text
from dspark_jax.decode.scheduler import Request, Scheduler
from dspark_jax.sampling import SamplingParams

FORMAT = "dspark_jax.magpie"
VERSION = 1
MIN_CHARS = 16
MAX_CHARS = 2000
_SENTINEL = "\x00MAGPIE-USER-TURN\x00"


@dataclass(frozen=True)
class MagpieSettings:
    target: str
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    prefix_sha256: str
    openers: str = ""           # comma-separated words a request starts with, in turn; "" = none
    format: str = FORMAT
    version: int = VERSION


def query_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user's words begin (system prompt included where
    the template adds a default one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user's message verbatim; "
                         "cannot find where a user turn starts")
    prefix = text[:text.index(_SENTINEL)]
    if not prefix:
        raise ValueError("the chat template puts nothing before the user's message: no turn opener to "
                         "continue from")
    return prefix


def prefix_sha256(tokenizer) -> str:
    return hashlib.sha256(query_prefix(tokenizer).encode("utf-8")).hexdigest()


def clean_query(text: str, finish_reason: str, *, min_chars: int = MIN_CHARS,
                max_chars: int = MAX_CHARS) -> str | None:
    """The request if it is one: the turn ended on its own (not cut at the token limit), holds
    no chat-template markup, has letters and a sensible length; else None."""
    q = text.strip()
    if finish_reason != "stop" or not min_chars <= len(q) <= max_chars:
        return None
    if "<|" in q or "|>" in q or not any(c.isalpha() for c in q):
        return None
    return q


def openers(settings: MagpieSettings) -> list[str]:
    """The settings' openers as a list (empty: unsteered). Refuses blank entries."""
    if not settings.openers:
        return []
    words = [w.strip() for w in settings.openers.split(",")]
    if not all(words):
        raise ValueError(f"openers {settings.openers!r}: an empty opener (stray comma?)")
    return words


def queries(cache: str | os.PathLike) -> list[tuple[str, str]]:
    """(id, request) of the cache's accepted rows, in cache order."""
    return [(r["id"], r["query"]) for r in read_cache(cache) if r.get("query")]


def sample_queries(target, tokenizer, cache: str | os.PathLike, *, num_queries: int,
                   settings: MagpieSettings, batch_size: int = 8, max_samples: int | None = None,
                   log: Callable[[str], None] | None = None, on_write: Callable[[], Any] | None = None,
                   deadline: float | None = None) -> dict:
    """Sample requests into `cache` until it holds `num_queries` accepted ones. Returns counts.
    `on_write()` runs after each progress line (every ~30 s) and at the end (e.g. `write_archive`).
    At `deadline` (a `time.time()`) no further sample starts; the running ones finish and are kept.
    Gives up (RuntimeError) after `max_samples` samples in this call (default 10 per missing
    request): a model that is not instruction-tuned rarely closes a user turn."""

    cache = Path(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    if settings.prefix_sha256 != prefix_sha256(tokenizer):
        raise ValueError("settings.prefix_sha256 is not this tokenizer's query prefix")
    check_meta(cache, settings)
    repair_tail(cache)
    rows = read_cache(cache)
    accepted = sum(bool(r.get("query")) for r in rows)
    counts = {"cached_before": len(rows), "accepted_before": accepted, "sampled": 0, "accepted": 0}
    if accepted >= num_queries:
        return counts
    budget = max_samples if max_samples is not None else 10 * (num_queries - accepted)
    prefix = query_prefix(tokenizer)
    words = openers(settings)
    prompts = [tokenizer.encode(prefix + w) for w in words] or [tokenizer.encode(prefix)]
    id_prefix = "magpie-open" if words else "magpie"
    eos = frozenset(eos_ids(target, tokenizer))
    engine = engine_for(target, None, EngineConfig(num_speculative_tokens=0))
    max_len = max(map(len, prompts)) + settings.max_new_tokens + 1
    t0 = last_log = time.time()
    with open(cache, "a", encoding="utf-8") as f:
        while accepted < num_queries and not (deadline is not None and time.time() >= deadline):
            if counts["sampled"] >= budget:
                raise RuntimeError(
                    f"{cache}: {counts['accepted']} of {counts['sampled']} samples were usable requests "
                    f"(the turn must end within {settings.max_new_tokens} tokens); is {settings.target} "
                    "an instruction-tuned model with a chat template?")
            # a round asks for what is missing (a little more: some samples are rejected); its
            # sampler is seeded by the rows already cached, so no round repeats another
            n = len(rows)
            want = num_queries - accepted
            scheduler = Scheduler(engine, SchedulerConfig(batch_size, max_len), seed=settings.seed * 1_000_003 + n)
            for i in range(min(want + want // 4 + 1, budget - counts["sampled"])):
                # the round's request i opens with opener n + i (in turn)
                scheduler.add(Request(list(prompts[(n + i) % len(prompts)]), settings.max_new_tokens,
                                    SamplingParams(settings.temperature, settings.top_p), eos, index=i))
            while scheduler.has_work() and accepted < num_queries:
                if deadline is not None and scheduler.num_waiting and time.time() >= deadline:
                    stop_admitting(scheduler)
                    if log:
                        log(f"time budget reached: finishing the {scheduler.num_running} running samples")
                done = [r for r in scheduler.step() if r.finish_reason is not None]
                lines = []
                for req in done:
                    opener = words[(n + req.index) % len(words)] if words else ""
                    text = opener + output_text(req.tokens, tokenizer, eos, [])
                    query = clean_query(text, req.finish_reason)
                    row = {"id": f"{id_prefix}/{settings.seed}-{len(rows):06d}", "text": text, "query": query,
                           "finish_reason": req.finish_reason, "num_tokens": len(req.tokens)}
                    rows.append(row)
                    lines.append(json.dumps(row, ensure_ascii=False))
                    accepted += query is not None
                    counts["sampled"] += 1
                    counts["accepted"] += query is not None
                if lines:
                    f.write("\n".join(lines) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                if log and lines and (time.time() - last_log > 30 or accepted >= num_queries):
                    last_log = time.time()
                    dt = last_log - t0
                    rate = counts["accepted"] / dt
                    log(f"{accepted}/{num_queries} requests ({counts['accepted']}/{counts['sampled']} "
                        f"accepted this run, {rate:.2f}/s), ETA "
                        f"{(num_queries - accepted) / max(rate, 1e-9) / 60:.1f} min")
                    if on_write is not None:
                        on_write()
    if on_write is not None:
        on_write()
    return counts


def write_archive(cache: str | os.PathLike, archive: str | os.PathLike) -> int:
    """The cache and its settings as one reproducible gzip (small enough to commit: sampled
    requests differ from CPU to CPU, so a fresh machine restores them instead of resampling)."""
    rows = read_cache(cache)
    meta = json.loads(meta_path(cache).read_text()) if meta_path(cache).exists() else None
    archive = Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    data = json.dumps({"meta": meta}) + "\n" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as g:
        g.write(data.encode("utf-8"))
    os.replace(tmp, archive)
    return len(rows)


def restore_archive(archive: str | os.PathLike, cache: str | os.PathLike) -> int:
    """Write the archive's rows as `cache` where the cache has fewer; returns the rows restored."""
    with gzip.open(archive, "rt", encoding="utf-8") as g:
        lines = [line for line in g if line.strip()]
    if not lines or "meta" not in json.loads(lines[0]):
        raise ValueError(f"{archive}: not a query archive (no settings line first)")
    meta = json.loads(lines[0])["meta"]
    rows = [json.loads(line) for line in lines[1:]]
    cache = Path(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)         # a fresh machine has no runs/ yet
    have = read_cache(cache)
    if len(have) >= len(rows):
        return 0
    if [r["id"] for r in have] != [r["id"] for r in rows[:len(have)]]:
        raise ValueError(f"{cache}: its rows are not a prefix of {archive}'s; move it away to restore")
    if meta is not None:
        if meta_path(cache).exists() and json.loads(meta_path(cache).read_text()) != meta:
            raise ValueError(f"{cache}: sampled with other settings than {archive}")
        meta_path(cache).write_text(json.dumps(meta, indent=1) + "\n")
    tmp = cache.with_name(cache.name + ".restore.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, cache)
    return len(rows) - len(have)
