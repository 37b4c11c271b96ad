"""The mean of several drafts from one run: weight averaging over its exports (SWA-style).

At a constant learning rate the weights keep moving around a minimum from step to step; the mean
of the last few checkpoints lies nearer its centre than any one of them (for the demo draft it
accepts more: README, "The demo draft"). Each floating tensor is averaged in float64 and rounded
once to its stored dtype; the vocabulary map (`d2t`, `t2d`) is not a weight and must be the same
in every draft, as must the config and the tensor inventory. Drafts with different maps (a full
one and a reduced one, or two reduced ones) average once moved to one map (`draft_vocab`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from dspark_jax.checkpoint.draft_io import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    TorchDraft,
    load_draft,
    open_torch_draft,
    save_torch_draft,
)
from dspark_jax.checkpoint.draft_layout import TORCHSPEC_METADATA
from dspark_jax.checkpoint.orbax_io import staging
from dspark_jax.checkpoint.safetensors_io import CheckpointError, save_arrays
from dspark_jax.models.draft_surgery import remap_vocabulary


def _check_same_layout(first: TorchDraft, other: TorchDraft) -> None:
    a, b = json.loads(first.config_bytes), json.loads(other.config_bytes)
    if a != b:
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise CheckpointError(f"{other.path / CONFIG_FILE}: differs from {first.path / CONFIG_FILE} in {keys}: "
                              f"only drafts of one configuration can be averaged")
    mine = {t.name: (t.dtype, tuple(t.shape)) for t in first.tensors}
    theirs = {t.name: (t.dtype, tuple(t.shape)) for t in other.tensors}
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise CheckpointError(f"{other.path / SAFETENSORS_FILE}: tensor {name!r} is {theirs.get(name)} "
                                  f"(dtype, shape), {first.path / SAFETENSORS_FILE} has {mine.get(name)}")


def move_to_vocabulary(src: str | Path, target_ids: Sequence[int], dst: str | Path) -> TorchDraft:
    """Write the torch-layout draft `src` moved to the draft vocabulary `target_ids` (ascending target
    ids; `draft_surgery.remap_vocabulary`: the Markov output rows of the ids it held, zero rows for
    the others, every other tensor as it was) to `dst`, in its own dtype. Atomic."""
    ids = np.asarray(target_ids, np.int64)
    raw = json.loads(open_torch_draft(src).config_bytes)
    vocab = int(raw["vocab_size"])
    if ids.ndim != 1 or not 0 < ids.size < vocab or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab:
        raise CheckpointError(f"{src}: the draft vocabulary to move it to must be 1 to {vocab - 1} ascending, "
                              f"distinct ids below its vocab_size {vocab}; got {ids.size} ids")
    moved = remap_vocabulary(load_draft(src), ids)
    return save_torch_draft(moved, {**raw, "draft_vocab_size": int(ids.size)}, dst)


def average_torch_drafts(srcs: Sequence[str | Path], dst: str | Path, *, draft_vocab: Sequence[int] | None = None,
                         log: Callable[[str], None] | None = None) -> TorchDraft:
    """Write the mean of the torch-layout drafts `srcs` to `dst` (config.json copied from the first;
    atomic: nothing is left at `dst` on an error). Returns the written draft. With `draft_vocab`
    (ascending target ids) every draft is first moved to that vocabulary (`move_to_vocabulary`)."""
    if not srcs:
        raise ValueError("average_torch_drafts: no drafts given")
    if draft_vocab is not None:
        with tempfile.TemporaryDirectory(prefix="dspark-moved-") as tmp:
            moved = [move_to_vocabulary(p, draft_vocab, Path(tmp) / str(i)) for i, p in enumerate(srcs)]
            out = average_torch_drafts([m.path for m in moved], dst)
        if log is not None:
            log(f"averaged {len(srcs)} drafts ({', '.join(map(str, srcs))}), each moved to a vocabulary of "
                f"{len(draft_vocab)} ids, into {dst}")
        return out
    drafts = [open_torch_draft(p) for p in srcs]
    first = drafts[0]
    for other in drafts[1:]:
        _check_same_layout(first, other)
    arrays = {}
    for t in first.tensors:
        values = [d.read(t.name) for d in drafts]
        if jnp.issubdtype(values[0].dtype, jnp.floating):
            total = np.zeros(values[0].shape, np.float64)
            for v in values:
                total += v.astype(np.float64)
            arrays[t.name] = (total / len(values)).astype(values[0].dtype)
        else:
            for d, v in zip(drafts[1:], values[1:]):
                if not np.array_equal(v, values[0]):
                    raise CheckpointError(f"{d.path / SAFETENSORS_FILE}: tensor {t.name!r} differs from "
                                          f"{first.path / SAFETENSORS_FILE}'s: a vocabulary map is not a "
                                          f"weight and must be the same in every averaged draft")
            arrays[t.name] = values[0]
    with staging(Path(dst)) as tmp:
        save_arrays(tmp / SAFETENSORS_FILE, arrays, first.file.metadata or TORCHSPEC_METADATA)
        (tmp / CONFIG_FILE).write_bytes(first.config_bytes)
    if log is not None:
        log(f"averaged {len(drafts)} drafts ({', '.join(str(d.path) for d in drafts)}) into {dst}")
    return open_torch_draft(dst)
