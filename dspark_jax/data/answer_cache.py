"""Append-only JSONL caches of generated answers (the target's answers of `train.regen`, the
Magpie queries of `data.magpie`): their settings pinned in `<cache>.meta.json`, complete lines read
back, a line torn by a kill repaired, and a run stopped without losing what finished."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, fields
from pathlib import Path


def meta_path(cache: str | os.PathLike) -> Path:
    return Path(str(cache) + ".meta.json")


def repair_tail(path: Path) -> None:
    """Drop a last line without its newline (the process died mid-write)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def read_cache(path: str | os.PathLike) -> list[dict]:
    """Complete lines of a regen cache (a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, "rb") as f:
        data = f.read()
    data = data[:data.rfind(b"\n") + 1]
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def check_meta(path: Path, settings) -> None:
    """Pin a cache's settings (a dataclass) in its `.meta.json`, or refuse ones that differ."""
    mp = meta_path(path)
    want = asdict(settings)
    if mp.exists():
        # a setting added after the cache was written holds its default there
        have = {f.name: f.default for f in fields(settings) if f.default is not MISSING}
        have.update(json.loads(mp.read_text()))
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if diff:
            raise ValueError(f"{path}: cached with other settings {diff} (have, want); use another --out")
        return
    tmp = mp.with_name(mp.name + ".tmp")
    tmp.write_text(json.dumps(want, indent=1) + "\n")
    os.replace(tmp, mp)


def stop_admitting(scheduler) -> int:
    """Drop the scheduler's waiting requests (the running ones go on); returns how many."""
    waiting = list(scheduler.waiting)
    for r in waiting:
        scheduler.abort(r)
    return len(waiting)
