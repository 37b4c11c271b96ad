"""The acceptance benchmark's prompt sets, as conversations.

GSM8K test (1319), HumanEval (164) and MT-Bench (80, two turns each) come from the registry
(`registry.fetch`, sha256-checked); AIME has no registry source and is read from a user JSONL
(`{"id", "problem", "answer"}` per line, 30 rows for AIME 2026) whose path is always an argument.

Each item is a `BenchItem` holding its user turns. A single-turn benchmark has one turn; MT-Bench
has two, and the bench runs them in one conversation: generate for `item.conversation()`, then for
`item.conversation([answer_1])` (turn 1, the model's answer, turn 2).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dspark_jax.data import registry

Message = dict[str, str]

BENCHMARKS = ("gsm8k", "humaneval", "mt_bench", "aime")
OFFICIAL_COUNTS = {"gsm8k": 1319, "humaneval": 164, "mt_bench": 80, "aime": 30}

# The HumanEval prompt (signature + docstring) inside a chat turn; the model is asked to complete it.
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function in one Python code "
    "block.\n\n```python\n{prompt}\n```")


@dataclass(frozen=True)
class BenchItem:
    """One benchmark prompt: its user turns plus what the scorer might need (never sent)."""

    id: str
    turns: tuple[str, ...]
    reference: str | None = None  # GSM8K/AIME final answer; None where there is none
    meta: dict[str, Any] = field(default_factory=dict)

    def conversation(self, answers: Sequence[str] = ()) -> list[Message]:
        """Messages for the next turn: user turns interleaved with the model's earlier answers."""
        if len(answers) >= len(self.turns):
            raise ValueError(f"{self.id}: {len(answers)} answers given for {len(self.turns)} turns")
        messages: list[Message] = []
        for turn, answer in zip(self.turns, answers):
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.turns[len(answers)]})
        return messages


def _check_limit(items: list[BenchItem], limit: int | None) -> list[BenchItem]:
    """The first `limit` items in file order (all of them when None)."""
    if limit is None:
        return items
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return items[:limit]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from None
    return rows


def _expect_count(name: str, rows: list[Any]) -> None:
    # The digest already pins the file; this guards the parsing.
    if len(rows) != OFFICIAL_COUNTS[name]:
        raise ValueError(f"{name}: expected {OFFICIAL_COUNTS[name]} rows, parsed {len(rows)}")


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K solutions end with '#### <answer>'."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


def load_gsm8k(limit: int | None = None, **fetch_kw: Any) -> list[BenchItem]:
    """GSM8K test: the question alone as one user turn."""
    rows = _read_jsonl(registry.fetch("gsm8k_test", **fetch_kw))
    _expect_count("gsm8k", rows)
    items = [BenchItem(f"gsm8k/{r.get('idx', i)}", (r["question"],), gsm8k_final_answer(r["answer"]))
             for i, r in enumerate(rows)]
    return _check_limit(items, limit)


def load_humaneval(limit: int | None = None, **fetch_kw: Any) -> list[BenchItem]:
    """HumanEval: HUMANEVAL_TEMPLATE around the function prompt, as one user turn."""
    rows = _read_jsonl(registry.fetch("humaneval", **fetch_kw))
    _expect_count("humaneval", rows)
    items = [BenchItem(r["task_id"], (HUMANEVAL_TEMPLATE.format(prompt=r["prompt"].strip("\n")),),
                       meta={"entry_point": r["entry_point"], "prompt": r["prompt"]})
             for r in rows]
    return _check_limit(items, limit)


def load_mt_bench(limit: int | None = None, **fetch_kw: Any) -> list[BenchItem]:
    """MT-Bench: both turns of each question, to be run in one conversation."""
    rows = _read_jsonl(registry.fetch("mt_bench", **fetch_kw))
    _expect_count("mt_bench", rows)
    items = [BenchItem(f"mt_bench/{r['question_id']}", tuple(r["turns"]),
                       meta={"category": r["category"]}) for r in rows]
    return _check_limit(items, limit)


def load_aime(path: str | os.PathLike, limit: int | None = None) -> list[BenchItem]:
    """AIME problems from a user JSONL; every line is validated and errors name line and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"AIME file not found: {path}")
    items: list[BenchItem] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in ("id", "problem", "answer"):
                if key not in row:
                    raise ValueError(f"{where}: missing field {key!r}")
            rid, problem, answer = row["id"], row["problem"], row["answer"]
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid).strip() == "":
                raise ValueError(f"{where}: field 'id' must be a non-empty string or integer, got {rid!r}")
            if not isinstance(problem, str) or not problem.strip():
                raise ValueError(f"{where}: field 'problem' must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int)) or str(answer).strip() == "":
                raise ValueError(f"{where}: field 'answer' must be a non-empty string or integer, "
                                 f"got {answer!r}")
            rid = str(rid)
            if rid in seen:
                raise ValueError(f"{where}: field 'id' {rid!r} repeats line {seen[rid]}")
            seen[rid] = lineno
            items.append(BenchItem(f"aime/{rid}", (problem,), str(answer).strip()))
    if not items:
        raise ValueError(f"{path}: no AIME rows")
    return _check_limit(items, limit)


def load_benchmark(name: str, limit: int | None = None, *, aime_file: str | os.PathLike | None = None,
                   **fetch_kw: Any) -> list[BenchItem]:
    """Dispatch by name (one of BENCHMARKS); 'aime' needs aime_file."""
    if name == "gsm8k":
        return load_gsm8k(limit, **fetch_kw)
    if name == "humaneval":
        return load_humaneval(limit, **fetch_kw)
    if name == "mt_bench":
        return load_mt_bench(limit, **fetch_kw)
    if name == "aime":
        if aime_file is None:
            raise ValueError("the AIME benchmark needs a file path (no registry ships AIME)")
        return load_aime(aime_file, limit)
    raise ValueError(f"unknown benchmark {name!r}; known: {BENCHMARKS}")


def contamination_texts(aime_file: str | os.PathLike | None = None,
                        **fetch_kw: Any) -> dict[str, list[str]]:
    """Every benchmark text a training prompt must not overlap: questions, code prompts, all turns."""
    texts = {
        "gsm8k_test": [t for it in load_gsm8k(**fetch_kw) for t in it.turns],
        "humaneval": [it.meta["prompt"] for it in load_humaneval(**fetch_kw)],
        "mt_bench": [t for it in load_mt_bench(**fetch_kw) for t in it.turns],
    }
    if aime_file is not None:
        texts["aime"] = [t for it in load_aime(aime_file) for t in it.turns]
    return texts
