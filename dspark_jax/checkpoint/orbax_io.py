"""What the draft and target converters share: the Orbax v1 API imported on first use, its saving
context, the dotted-name <-> nested-tree mapping of NNX paths, and the staging directory that
makes every conversion all-or-nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Mapping

from dspark_jax.checkpoint.safetensors_io import CheckpointError

PARAMS_DIR = "params"        # the Orbax tree inside a converted directory


def orbax():
    """orbax.checkpoint v1, imported on first use (it is slow to import and only converters need it)."""
    import orbax.checkpoint.experimental.v1 as ocp
    return ocp


def orbax_context():
    ocp = orbax()
    ctx = ocp.Context()
    # bf16 weights barely compress; zstd would dominate the conversion time
    ctx.array.saving.use_compression = False
    # the arrays are ours and never mutated during the save: Orbax's defensive copy would double
    # the peak memory
    ctx.memory.deepcopy_host_arrays = False
    return ctx


def orbax_leaves(path: Path) -> dict[str, object]:
    """The flat {name: array metadata} of the Orbax checkpoint in `path`/params."""
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{path}: no Orbax checkpoint directory {PARAMS_DIR}/")
    try:
        with orbax_context():
            return flatten(orbax().metadata(params_dir).metadata)
    except Exception as e:  # Orbax/tensorstore raise many types; name what failed
        raise CheckpointError(f"{params_dir}: not a readable Orbax checkpoint ({type(e).__name__}: {e})") from e


def nest(flat: Mapping[str, object]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}: the NNX path as the Orbax tree."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: Mapping, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


@contextlib.contextmanager
def staging(dst: Path) -> Iterator[Path]:
    """A fresh temp dir next to `dst`, renamed to `dst` on success and removed on any failure."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: destination exists and is not an empty directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, dst)      # atomic; replaces an empty dst directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
