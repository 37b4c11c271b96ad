"""Path flags of the training programs: comma-separated paths and globs."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Callable

from absl import app


def expand(spec: str, *, flag: str, what: str, exists: Callable[[Path], bool]) -> list[str]:
    """The paths of `spec` in the given order, a glob's matches sorted (so `step_NNNNNNN` exports
    come by step); a part that names nothing is a usage error naming the flag."""
    out = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        found = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part] if exists(Path(part)) else []
        if not found:
            raise app.UsageError(f"--{flag}: no {what} at {part!r}")
        out += found
    return out
