"""Choosing a reduced draft vocabulary (EAGLE-3 / FR-Spec style) from the target's answers.

The K most frequent answer tokens over the training answers (a regen cache, format in
`dspark_jax.train.regen`: `answer_ids` of the kept rows), K the smallest count that covers
`coverage` of the answer tokens, plus the ids given as `always` (e.g. eos / end-of-turn: a draft
that cannot propose them cannot end an answer). Ties in frequency go to the smaller id, so the
choice is deterministic. The kept ids are returned ascending, the order of the `d2t`/`t2d` map
(`dspark_jax.models.dspark.vocab_map_arrays`). Coverage is reported on held-out answers
(rows split off by a hash of their id, so the split does not depend on file order).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class VocabChoice:
    token_ids: list[int]           # kept target ids, ascending
    vocab_size: int                # V of the target
    coverage_target: float
    train_coverage: float          # fraction of training answer tokens inside the kept set
    heldout_coverage: float | None  # same on the held-out answers (None: no held-out rows)
    train_tokens: int
    heldout_tokens: int

    @property
    def k(self) -> int:
        return len(self.token_ids)


def token_counts(answers: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Occurrences of every target id [V] over the answers."""
    counts = np.zeros(vocab_size, np.int64)
    for a in answers:
        ids = np.asarray(a, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"answer token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} "
                             f"is outside the vocabulary 0..{vocab_size - 1}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def select_vocab(counts: np.ndarray, coverage: float, *, always: Sequence[int] = (),
                 min_size: int = 1) -> np.ndarray:
    """The smallest most-frequent set covering `coverage` of the counted tokens (at least
    `min_size` ids), united with `always`; ascending int64 ids."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage {coverage} must be in (0, 1]")
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no answer tokens to count")
    order = np.lexsort((np.arange(counts.size), -counts))          # by count desc, then id asc
    cum = np.cumsum(counts[order])
    k = int(np.searchsorted(cum, coverage * total - 1e-9 * total)) + 1   # first prefix reaching it
    k = min(max(k, min_size), counts.size)
    kept = set(order[:k].tolist()) | {int(i) for i in always}
    return np.asarray(sorted(kept), np.int64)


def coverage_of(token_ids: Sequence[int], counts: np.ndarray) -> float:
    """Fraction of the counted tokens that fall in `token_ids`."""
    total = int(np.sum(counts))
    return float(np.sum(np.asarray(counts)[np.asarray(token_ids, np.int64)])) / total if total else float("nan")


def is_heldout(row_id: str, fraction: float) -> bool:
    """A stable split by id: sha256(id) as a number in [0, 1) below `fraction`."""
    h = int.from_bytes(hashlib.sha256(str(row_id).encode("utf-8")).digest()[:8], "big")
    return h / 2.0 ** 64 < fraction


def choose_from_rows(rows: Iterable[Mapping], vocab_size: int, coverage: float = 0.995, *,
                     heldout_fraction: float = 0.1, always: Sequence[int] = (), min_size: int = 1) -> VocabChoice:
    """`select_vocab` on the kept rows' `answer_ids` (regen cache rows), held-out rows excluded
    from the choice and used for the reported held-out coverage."""
    train, held = [], []
    for r in rows:
        if not r.get("kept", True):
            continue
        (held if is_heldout(r["id"], heldout_fraction) else train).append(r["answer_ids"])
    c_train, c_held = token_counts(train, vocab_size), token_counts(held, vocab_size)
    ids = select_vocab(c_train, coverage, always=always, min_size=min_size)
    return VocabChoice([int(i) for i in ids], vocab_size, coverage, coverage_of(ids, c_train),
                       coverage_of(ids, c_held) if c_held.sum() else None, int(c_train.sum()), int(c_held.sum()))


def write_choice(choice: VocabChoice, path: str | Path) -> None:
    """vocab.json: {"draft_vocab_size", "vocab_size", "token_ids", coverage fields}."""
    doc = {"draft_vocab_size": choice.k, **asdict(choice)}
    Path(path).write_text(json.dumps(doc) + "\n")


def read_choice(path: str | Path) -> list[int]:
    """The kept ids of a vocab.json written by `write_choice`."""
    doc = json.loads(Path(path).read_text())
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or doc.get("draft_vocab_size") != len(ids):
        raise ValueError(f"{path}: token_ids missing or not draft_vocab_size long")
    return [int(i) for i in ids]
