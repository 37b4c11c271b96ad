"""Text normalisation, exact and near-duplicate removal, and n-gram decontamination.

All three work on the same normalised word tokens (NFKC, lower case, `\\w+` runs), so
punctuation, case and whitespace differences never hide a duplicate or a benchmark overlap.

Near duplicates: MinHash signatures over word k-shingles, banded LSH to find candidate pairs, then
the exact Jaccard similarity of the shingle sets decides (so LSH only affects speed, not which pair
counts as a duplicate, except for the tiny chance a true pair shares no band).
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from typing import Iterable, Mapping, Sequence

import numpy as np

_WORD = re.compile(r"\w+")
_PRIME = (1 << 31) - 1  # universal hashing (a*h + b) mod p; a, h < 2^31 so products fit uint64


def word_tokens(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def normalize_text(text: str) -> str:
    """The key two texts must share to be exact duplicates."""
    return " ".join(word_tokens(text))


def exact_duplicate_mask(texts: Sequence[str]) -> list[bool]:
    """keep[i] is False when an earlier text has the same normalised form."""
    seen: set[str] = set()
    keep = []
    for text in texts:
        key = normalize_text(text)
        keep.append(key not in seen)
        seen.add(key)
    return keep


class NGramIndex:
    """Word n-grams of named reference sets (the benchmarks); `match` names the set a text overlaps.

    A text overlaps when it shares any n-gram with a reference text. Texts shorter than n tokens
    cannot hold an n-gram; for them (on either side) equality of the whole token sequence counts.
    """

    def __init__(self, reference: Mapping[str, Iterable[str]], n: int = 13):
        self.n = n
        self._grams: dict[tuple[str, ...], str] = {}
        self._short: dict[tuple[str, ...], str] = {}
        for name, texts in reference.items():
            for text in texts:
                toks = tuple(word_tokens(text))
                if 0 < len(toks) < n:
                    self._short.setdefault(toks, name)
                for i in range(len(toks) - n + 1):
                    self._grams.setdefault(toks[i:i + n], name)

    def match(self, text: str) -> str | None:
        toks = tuple(word_tokens(text))
        if len(toks) < self.n:
            return self._short.get(toks)
        for i in range(len(toks) - self.n + 1):
            hit = self._grams.get(toks[i:i + self.n])
            if hit is not None:
                return hit
        return self._short.get(toks)


def shingle_hashes(text: str, k: int = 3) -> np.ndarray:
    """Sorted unique 31-bit hashes of the word k-shingles (the whole text when shorter than k)."""
    toks = word_tokens(text)
    grams = {" ".join(toks[i:i + k]) for i in range(max(1, len(toks) - k + 1))}
    # crc32 is stable across processes (unlike hash()), so signatures are reproducible.
    return np.unique(np.fromiter((zlib.crc32(g.encode()) & _PRIME for g in grams), np.uint64))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


class MinHasher:
    """num_perm universal hash functions; signature[j] = min over shingles of h_j(shingle)."""

    def __init__(self, num_perm: int = 128, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, num_perm, dtype=np.uint64)

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        return ((shingles[:, None] * self.a[None, :] + self.b[None, :]) % _PRIME).min(axis=0)


def near_duplicate_mask(texts: Sequence[str], threshold: float = 0.8, *, k: int = 3,
                        num_perm: int = 128, bands: int = 32, seed: int = 0) -> list[bool]:
    """keep[i] is False when an earlier kept text has shingle Jaccard >= threshold with text i.

    With 32 bands of 4 rows a pair at Jaccard 0.8 shares a band with probability 1 - (1-0.8^4)^32
    (> 0.99999), so near-misses of the LSH stage are negligible; candidates are then checked
    exactly.
    """
    if num_perm % bands:
        raise ValueError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
    rows = num_perm // bands
    hasher = MinHasher(num_perm, seed)
    buckets: dict[tuple[int, bytes], list[int]] = {}
    kept_shingles: dict[int, np.ndarray] = {}
    keep = []
    for i, text in enumerate(texts):
        sh = shingle_hashes(text, k)
        sig = hasher.signature(sh)
        keys = [(j, sig[j * rows:(j + 1) * rows].tobytes()) for j in range(bands)]
        candidates = sorted({c for key in keys for c in buckets.get(key, ())})
        dup = any(jaccard(sh, kept_shingles[c]) >= threshold for c in candidates)
        keep.append(not dup)
        if not dup:
            kept_shingles[i] = sh
            for key in keys:
                buckets.setdefault(key, []).append(i)
    return keep
