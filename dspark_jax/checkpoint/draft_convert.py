"""The streaming, bit-exact converter between the draft's torch and Orbax layouts (the layouts and
their readers: draft_io.py): torch -> Orbax writes each tensor band by band as it is read, Orbax
-> torch appends bands of stored chunks to model.safetensors, `check=True` re-reads the output and
compares every band byte for byte. Output goes to a temp dir renamed into place at the end."""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from dspark_jax.checkpoint.draft_io import (
    CHUNK_BYTES,
    CONFIG_FILE,
    IN_FLIGHT,
    LAYOUT_FILE,
    LAYOUT_FORMAT,
    LAYOUT_VERSION,
    SAFETENSORS_FILE,
    OrbaxArrays,
    OrbaxDraft,
    Progress,
    Ring,
    Rows,
    TensorEntry,
    TorchDraft,
    chunk_rows,
    is_orbax_draft_dir,
    is_torch_draft_dir,
    open_orbax_draft,
    open_torch_draft,
    row_bands,
)
from dspark_jax.checkpoint.orbax_io import PARAMS_DIR, nest, orbax, orbax_context, staging
from dspark_jax.checkpoint.safetensors_io import DTYPES, CheckpointError, write_streaming


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    # in slices: a tensor stored as one chunk arrives whole, its comparison needs no full-size temporary
    return all(np.array_equal(ua[i:i + CHUNK_BYTES], ub[i:i + CHUNK_BYTES])
               for i in range(0, ua.size, CHUNK_BYTES))


def _prefetched(keys: Sequence, load: Callable) -> Iterator[tuple[object, object]]:
    """(key, load(key)) in order, loading the next key in a worker thread while the caller
    handles the current one: reads overlap writes (file I/O and tensorstore release the GIL) at
    the cost of one extra item in memory."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(load, keys[0]) if keys else None
        for i, key in enumerate(keys):
            value = pending.result()
            pending = pool.submit(load, keys[i + 1]) if i + 1 < len(keys) else None
            yield key, value
            del value


def _read_piece(src: TorchDraft | OrbaxDraft, name: str, rows: Rows | None) -> np.ndarray:
    # a tensor that fits one band is read by its name alone
    return src.read(name) if rows is None else src.read(name, rows)


def _compare_all(what: str, tensors: Sequence[TensorEntry], a, b, orbax: OrbaxDraft) -> None:
    """Every tensor of `a` and `b` byte for byte, band by band (the Orbax side's bands)."""
    for t in tensors:
        if not all(_same_bytes(_read_piece(a, t.name, rows), _read_piece(b, t.name, rows))
                   for rows in orbax.bands(t) or [None]):
            raise CheckpointError(f"--check: tensor {t.name!r} differs after conversion ({what})")


def _write_orbax_arrays(src: TorchDraft, arrays: OrbaxArrays, progress: Progress | None) -> None:
    """Every tensor of `src` into its (placeholder) Orbax array, band by band: the next band is
    read while up to `IN_FLIGHT` earlier ones are being written."""
    plan = []                                 # (tensor, stored chunk rows, its bands)
    for t in src.tensors:
        rows_per_chunk = chunk_rows(t.shape, DTYPES[t.dtype].itemsize)
        plan.append((t, rows_per_chunk, row_bands(t.shape, DTYPES[t.dtype].itemsize, rows_per_chunk) or [None]))
    # a buffer is refilled only once the write reading it is done (`settle` keeps `IN_FLIGHT`),
    # so tensorstore may write straight from it instead of copying it first
    ring = Ring([(t, rows) for t, _, bands in plan for rows in bands], IN_FLIGHT + 1)
    pending: deque = deque()                  # (tensor name, write future), oldest first

    def settle(keep: int) -> None:
        while len(pending) > keep:
            name, write = pending.popleft()
            try:
                write.result()
            except Exception as e:
                raise CheckpointError(f"{arrays.root}: cannot write tensor {name!r} "
                                      f"({type(e).__name__}: {e})") from e

    try:
        for t, rows_per_chunk, bands in plan:
            try:
                store = arrays.create(t.name, t.shape, rows_per_chunk)
            except Exception as e:
                raise CheckpointError(f"{arrays.root}: cannot create tensor {t.name!r} "
                                      f"({type(e).__name__}: {e})") from e
            for rows in bands:
                data = src.read(t.name, rows, out=ring.take(t, rows))
                dst = store if rows is None else store[rows[0]:rows[1]]
                pending.append((t.name, dst.write(data, can_reference_source_data_indefinitely=True)))
                del data
                settle(IN_FLIGHT)
            if progress is not None:
                progress(f"saved {t.name}")
        settle(0)
    finally:
        # on failure, writes still running would otherwise land in the staging dir being removed
        for _, write in pending:
            write.exception()


def torch_to_orbax(src: str | Path, dst: str | Path, *, check: bool = False,
                   progress: Progress | None = None) -> OrbaxDraft:
    """Convert a torch-layout draft dir to the Orbax layout (see the module docstring)."""
    ocp = orbax()
    src_draft = open_torch_draft(src)
    dst = Path(dst)
    header = src_draft.file.header_bytes
    with staging(dst) as tmp:
        (tmp / CONFIG_FILE).write_bytes(src_draft.config_bytes)
        layout = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "file": SAFETENSORS_FILE,
                  "header": header.decode("utf-8")}
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n")
        # Orbax writes the tree: its metadata and a one-element placeholder of each leaf's dtype
        # and rank, which `_write_orbax_arrays` then replaces by the real array
        placeholders = {t.name: np.zeros((1,) * len(t.shape), DTYPES[t.dtype]) for t in src_draft.tensors}
        with orbax_context():
            ocp.save(tmp / PARAMS_DIR, nest(placeholders))
        arrays = OrbaxArrays(tmp / PARAMS_DIR)
        _write_orbax_arrays(src_draft, arrays, progress)
        arrays.sync()
        out = open_orbax_draft(tmp)
        if out.header_bytes != header or out.config_bytes != src_draft.config_bytes:
            raise CheckpointError(f"{tmp}: header or config.json changed on the way (bug)")
        if check:
            _compare_all(f"{src_draft.file.path} vs {tmp / PARAMS_DIR}", src_draft.tensors, src_draft, out, out)
    return open_orbax_draft(dst)


def orbax_to_torch(src: str | Path, dst: str | Path, *, check: bool = False,
                   progress: Progress | None = None) -> TorchDraft:
    """Convert an Orbax-layout draft dir back to config.json + model.safetensors."""
    src_draft = open_orbax_draft(src)
    dst = Path(dst)
    pieces = [(t, rows) for t in src_draft.tensors for rows in src_draft.bands(t) or [None]]
    # bands go through three buffers (one being written out, one being read, one spare); a
    # tensor that fits one band is read whole into a fresh array
    ring = Ring([(t, rows) for t, rows in pieces if rows is not None], 3)

    def load(i: int) -> np.ndarray:
        t, rows = pieces[i]
        return src_draft.read(t.name) if rows is None else src_draft.read(t.name, rows, out=ring.take(t, rows))

    def chunks():
        for i, arr in _prefetched(range(len(pieces)), load):
            t, rows = pieces[i]
            yield t.name, arr
            del arr
            if progress is not None and (rows is None or rows[1] == t.shape[0]):
                progress(f"wrote {t.name}")

    with staging(dst) as tmp:
        write_streaming(tmp / SAFETENSORS_FILE, [(t.name, t.dtype, t.shape) for t in src_draft.tensors],
                        chunks(), header_bytes=src_draft.header_bytes)
        (tmp / CONFIG_FILE).write_bytes(src_draft.config_bytes)
        out = open_torch_draft(tmp)
        if out.file.header_bytes != src_draft.header_bytes:
            raise CheckpointError(f"{tmp / SAFETENSORS_FILE}: header changed on the way (bug)")
        if check:
            _compare_all(f"{src_draft.params_dir} vs {tmp / SAFETENSORS_FILE}", src_draft.tensors,
                         src_draft, out, src_draft)
    return open_torch_draft(dst)


def convert_draft(src: str | Path, dst: str | Path, *, check: bool = False,
                  progress: Progress | None = None) -> str:
    """Convert in the direction the source implies; returns "torch->orbax" or "orbax->torch"."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: source is not a directory")
    if is_torch_draft_dir(src):
        torch_to_orbax(src, dst, check=check, progress=progress)
        return "torch->orbax"
    if is_orbax_draft_dir(src):
        orbax_to_torch(src, dst, check=check, progress=progress)
        return "orbax->torch"
    raise CheckpointError(f"{src}: neither a torch draft ({SAFETENSORS_FILE} + {CONFIG_FILE}) nor an Orbax "
                          f"draft ({PARAMS_DIR}/ + {CONFIG_FILE})")


