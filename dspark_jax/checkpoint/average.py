"""The mean of several drafts from one run: weight averaging over its exports (SWA-style).

At a constant learning rate the weights keep moving around a minimum from step to step; the mean
of the last few checkpoints lies nearer its centre than any one of them (for the demo draft it
accepts more: README, "The demo draft"). Each floating tensor is averaged in float64 and rounded
once to its stored dtype; the vocabulary map (`d2t`, `t2d`) is not a weight and must be the same
in every draft, as must the config and the tensor inventory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from dspark_jax.checkpoint.draft_io import CONFIG_FILE, SAFETENSORS_FILE, TorchDraft, open_torch_draft
from dspark_jax.checkpoint.draft_layout import TORCHSPEC_METADATA
from dspark_jax.checkpoint.orbax_io import staging
from dspark_jax.checkpoint.safetensors_io import CheckpointError, save_arrays


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


def average_torch_drafts(srcs: Sequence[str | Path], dst: str | Path, *,
                         log: Callable[[str], None] | None = None) -> TorchDraft:
    """Write the mean of the torch-layout drafts `srcs` to `dst` (config.json copied from the first;
    atomic: nothing is left at `dst` on an error). Returns the written draft."""
    if not srcs:
        raise ValueError("average_torch_drafts: no drafts given")
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
