"""DSpark draft checkpoints: the torch layout <-> an Orbax layout, bit-exact and streaming.

Torch layout (as published, docs/architecture.md §3.1/§3.2): `config.json` + one `model.safetensors` (all tensors in
the config's `torch_dtype`, metadata `{"torchspec_version": "0.1.0"}`; `embed_tokens.weight` is a
copy of the target's table, optional).

Orbax layout (this package's):
    config.json                 the source config.json, byte for byte
    safetensors_layout.json     {"format", "version", "file", "header"}: the safetensors header
                                verbatim (names, order, dtypes, shapes, offsets, metadata)
    params/                     an Orbax PyTree checkpoint of `{"layers": {"0": {"self_attn":
                                {"q_a_proj": {"weight": array}}}}, ...}`: the torch name split at
                                the dots (= the NNX param path), arrays in their stored dtype
`ocp.load(dst / "params")` therefore gives the draft's weights as a plain nested dict, and the
header makes torch -> Orbax -> torch byte-identical (same names, order, dtypes, bytes, metadata).
An Orbax dir without the layout file (a trained draft: `nnx.to_pure_dict(nnx.state(draft,
nnx.Param))` saved under params/, config.json beside) exports with a fresh header in the reference
writer's order and the TorchSpec metadata, i.e. the file TorchSpec itself would write.

Streaming: no tensor is ever whole in memory. Tensors move in row bands of about `CHUNK_BYTES`
(dim 0 cut; a tensor that fits one band moves whole), through a few reused buffers. Torch ->
Orbax: Orbax writes the tree (its metadata and a one-element placeholder per leaf), then
tensorstore replaces each placeholder by the real zarr array, chunked in exactly those bands, and
writes it band by band as they are read from model.safetensors. Orbax -> torch: bands of whole
stored chunks are read by tensorstore (from mapped files) and appended to the file. `ocp.load`
and `load_draft` read the result like any Orbax checkpoint. Reads overlap writes, memory stays at
a few bands whatever the tensor sizes, nothing is fsynced per write (every output file once at
the end). Output goes to a temp dir next to the destination and is renamed into place at the end;
any failure removes it.

This module holds the two layouts' readers, loading a model and exporting one; the converter
between the layouts is draft_convert.py, the inventory and its checks draft_layout.py, the Orbax
helpers orbax_io.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh

from dspark_jax import params as params_lib
from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint.draft_layout import (
    EMBED_NAME,
    MAX_LISTED,
    TORCHSPEC_METADATA,
    TensorEntry,
    abstract_draft,
    check_tensors,
    check_vocab_map,
    draft_inventory,
    dtype_name,
    vocab_map_vars,
)
from dspark_jax.checkpoint.orbax_io import PARAMS_DIR, orbax_leaves, staging
from dspark_jax.checkpoint.safetensors_io import (
    DTYPES,
    CheckpointError,
    SafetensorsFile,
    header_for,
    save_arrays,
)
from dspark_jax.config.keys import ConfigError
from dspark_jax.config.draft import DraftConfig
from dspark_jax.models.dspark import K3DSparkModel, vocab_map_arrays

SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
LAYOUT_FILE = "safetensors_layout.json"
LAYOUT_FORMAT = "dspark_jax.draft_orbax"
LAYOUT_VERSION = 1

CHUNK_BYTES = 64 * 2**20     # a row band: the unit of every read, write and --check compare, and
                              # the stored Orbax chunk (big enough for full-speed sequential I/O)
IN_FLIGHT = 2                # torch -> Orbax: band writes outstanding while the next band is read
_ORBAX_TREE_DIR = "state"     # the checkpointable Orbax v1 saves a PyTree under

Progress = Callable[[str], None]


def _read_config(path: Path) -> tuple[DraftConfig, bytes]:
    """The config and its exact bytes (copied verbatim by the converters)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return DraftConfig.from_dict(doc, where=str(path)), raw


# ---------------------------------------------------------------------------------------------
# the two layouts


def _entries_in_file_order(sf: SafetensorsFile) -> list[TensorEntry]:
    """Tensors by data offset; the data must be contiguous from offset 0 to the end of the file,
    which is what lets the writer reproduce the file byte for byte."""
    infos = sorted(sf.tensors.values(), key=lambda i: (i.begin, i.end))
    pos = sf.data_start
    for info in infos:
        if info.begin != pos:
            raise CheckpointError(f"{sf.path}: tensor {info.name!r} starts at byte {info.begin}, expected "
                                  f"{pos} (gaps or overlaps between tensors are not supported)")
        pos = info.end
    size = sf.path.stat().st_size
    if pos != size:
        raise CheckpointError(f"{sf.path}: {size - pos} trailing bytes after the last tensor")
    return [TensorEntry(i.name, i.dtype, i.shape) for i in infos]


Rows = tuple[int, int]        # a row band: rows [start, stop) of dim 0


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) * itemsize


def row_bands(shape: tuple[int, ...], itemsize: int, unit: int = 1) -> list[Rows] | None:
    """Dim 0 of `shape` cut into bands of about `CHUNK_BYTES`, each a whole number of `unit` rows
    (the stored chunk height: no chunk is read or written in part); None when one band is the whole
    tensor, which then moves whole."""
    if not shape:
        return None
    step = max(1, CHUNK_BYTES // max(1, _row_bytes(shape, itemsize)) // unit) * unit
    if step >= shape[0]:
        return None
    return [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows per stored Orbax chunk: the fewest chunks of about `CHUNK_BYTES` (one row if a row is
    bigger), evened out so that the last one is barely padded."""
    if not shape:
        return 1
    n = max(1, -(-shape[0] * _row_bytes(shape, itemsize) // CHUNK_BYTES))
    return max(1, -(-shape[0] // n))


def _piece_shape(t: TensorEntry, rows: Rows | None) -> tuple[int, ...]:
    return t.shape if rows is None else (rows[1] - rows[0], *t.shape[1:])


class Ring:
    """`n` buffers reused in turn for the bands in flight: a fresh array per band would cost a
    page fault per page, as much as the copy itself. The caller keeps a buffer's band alive
    only until `n - 1` later bands have been handed out."""

    def __init__(self, pieces: Sequence[tuple[TensorEntry, Rows | None]], n: int):
        size = max((int(np.prod(_piece_shape(t, rows), dtype=np.int64)) * DTYPES[t.dtype].itemsize
                    for t, rows in pieces), default=0)
        self._bufs = [np.empty(size, np.uint8) for _ in range(n)]
        self._next = 0

    def take(self, t: TensorEntry, rows: Rows | None) -> np.ndarray:
        """The next buffer, as an (uninitialised) array of the band's shape and dtype."""
        dtype, shape = DTYPES[t.dtype], _piece_shape(t, rows)
        buf = self._bufs[self._next % len(self._bufs)]
        self._next += 1
        return buf[:int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)


@dataclass
class TorchDraft:
    """A validated torch-layout draft directory (headers only; no tensor data read)."""
    path: Path
    cfg: DraftConfig
    config_bytes: bytes
    file: SafetensorsFile
    tensors: list[TensorEntry]    # file order

    def _span(self, name: str, rows: Rows | None) -> tuple[np.dtype, tuple[int, ...], int]:
        """dtype, shape and file offset of tensor `name` or of its band `rows`."""
        info = self.file.tensors[name]
        if rows is None:
            return info.np_dtype, info.shape, info.begin
        return (info.np_dtype, (rows[1] - rows[0], *info.shape[1:]),
                info.begin + rows[0] * _row_bytes(info.shape, info.np_dtype.itemsize))

    def read(self, name: str, rows: Rows | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """One tensor, or its band `rows`, read straight into a fresh array or into `out` (of the
        band's shape and dtype; reused buffers spare the allocation)."""
        dtype, shape, begin = self._span(name, rows)
        arr = np.empty(shape, dtype) if out is None else out
        with open(self.file.path, "rb") as f:
            f.seek(begin)
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
        if got != arr.nbytes:
            raise CheckpointError(f"{self.file.path}: truncated while reading tensor {name!r}")
        return arr


def open_torch_draft(path: str | Path) -> TorchDraft:
    path = Path(path)
    st = path / SAFETENSORS_FILE
    if (path / "model.safetensors.index.json").exists():
        raise CheckpointError(f"{path}: sharded drafts are not supported (expected one {SAFETENSORS_FILE})")
    if not st.is_file():
        raise CheckpointError(f"{path}: no {SAFETENSORS_FILE}")
    cfg, raw = _read_config(path / CONFIG_FILE)
    sf = SafetensorsFile(st)
    entries = _entries_in_file_order(sf)
    check_tensors(cfg, entries, str(st))
    return TorchDraft(path, cfg, raw, sf, entries)


class OrbaxArrays:
    """The zarr arrays of an Orbax PyTree checkpoint, opened with tensorstore the way Orbax opens
    them (one array per leaf, keyed by its dotted path, in an OCDBT database unless the tree
    metadata says otherwise), so that tensors move in row bands: `ocp.load` restores leaves whole."""

    def __init__(self, params_dir: Path):

        root = params_dir / _ORBAX_TREE_DIR
        if not (root / "_METADATA").is_file():
            root = params_dir                 # an Orbax v0 checkpoint: the tree at the top
        try:
            meta = json.loads((root / "_METADATA").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{root / '_METADATA'}: unreadable Orbax tree metadata ({e})") from None
        self.params_dir, self.root = params_dir, root
        self._ts = ts
        self._ocdbt = bool(meta.get("use_ocdbt"))
        self._driver = "zarr3" if meta.get("use_zarr3") else "zarr"
        # No fsync per write (each band is an OCDBT commit: a storm of them), `sync` once at the
        # end; no lock files either, as Orbax for its data files: the output dir is ours alone
        # until renamed. Reads map the files (a copy less than pread).
        files = {"file_io_sync": False, "file_io_locking": {"mode": "non_atomic"}}
        self._write_context = ts.Context(files)
        self._read_context = ts.Context(dict(files, file_io_mode={"mode": "memmap"}))
        self._opened: dict[str, object] = {}

    def _spec(self, name: str) -> dict:
        kvstore = ({"driver": "ocdbt", "base": {"driver": "file", "path": str(self.root)}, "path": name}
                   if self._ocdbt else {"driver": "file", "path": str(self.root / name)})
        return {"driver": self._driver, "kvstore": kvstore}

    def array(self, name: str):
        """The stored array of tensor `name`; a missing chunk reads as an error, never as zeros."""
        if name not in self._opened:
            spec = dict(self._spec(name), fill_missing_data_reads=False)
            self._opened[name] = self._ts.open(spec, open=True, context=self._read_context).result()
        return self._opened[name]

    def create(self, name: str, shape: tuple[int, ...], chunk_rows: int):
        """Replace the placeholder Orbax saved for `name` by an empty array of `shape` in chunks of
        `chunk_rows` full rows, keeping Orbax's codecs; chunks equal to the fill value are stored
        too (Orbax's own setting, which its loader relies on)."""
        placeholder = self._ts.open(self._spec(name), open=True, context=self._write_context).result()
        meta = placeholder.spec().to_json()["metadata"]
        chunk = [max(1, d) for d in (chunk_rows, *shape[1:])][:len(shape)]
        meta["shape"] = list(shape)
        meta["chunk_grid"]["configuration"]["chunk_shape"] = chunk
        for codec in meta["codecs"]:
            if codec["name"] == "sharding_indexed":    # Orbax's one shard per chunk
                codec["configuration"]["chunk_shape"] = chunk
        spec = dict(self._spec(name), metadata=meta, store_data_equal_to_fill_value=True)
        return self._ts.open(spec, create=True, delete_existing=True, context=self._write_context).result()

    def wrap(self, buf: np.ndarray):
        """`buf` as an in-memory TensorStore (no copy) to read into."""
        return self._ts.array(buf, copy=False)

    def sync(self) -> None:
        """fsync every file and directory of the checkpoint once."""
        for dirpath, _, files in os.walk(self.params_dir):
            for f in [*files, "."]:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


@dataclass
class OrbaxDraft:
    """A validated Orbax-layout draft directory (metadata only; no tensor data read)."""
    path: Path
    cfg: DraftConfig
    config_bytes: bytes
    header_bytes: bytes
    tensors: list[TensorEntry]    # safetensors file order
    arrays: OrbaxArrays

    @property
    def params_dir(self) -> Path:
        return self.path / PARAMS_DIR

    def read(self, name: str, rows: Rows | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """One tensor, or its band `rows`, read from its stored array into a fresh array or into
        `out` (of the band's shape and dtype; reused buffers spare the allocation)."""
        try:
            arr = self.arrays.array(name)
            src = arr if rows is None else arr[rows[0]:rows[1]]
            if out is None:
                return src.read().result()
            self.arrays.wrap(out).write(src).result()
            return out
        except Exception as e:  # tensorstore raises several types; name what failed
            raise CheckpointError(f"{self.params_dir}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from e

    def bands(self, t: TensorEntry) -> list[Rows] | None:
        """`t`'s row bands, whole stored chunks each (None: read it whole)."""
        try:
            unit = self.arrays.array(t.name).chunk_layout.read_chunk.shape[0] if t.shape else 1
        except Exception as e:
            raise CheckpointError(f"{self.params_dir}: cannot open tensor {t.name!r} "
                                  f"({type(e).__name__}: {e})") from e
        return row_bands(t.shape, DTYPES[t.dtype].itemsize, unit)


def _parse_header(header_bytes: bytes, where: str) -> list[TensorEntry]:
    try:
        doc = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from None
    doc.pop("__metadata__", None)
    items, pos = [], 0
    for name, h in sorted(doc.items(), key=lambda kv: tuple(kv[1].get("data_offsets", (0, 0)))):
        dt, shape, (b, e) = h.get("dtype"), tuple(int(s) for s in h.get("shape", ())), h.get("data_offsets")
        if dt not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {dt!r}")
        entry = TensorEntry(name, dt, shape)
        if b != pos or e - b != entry.nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} has data_offsets {[b, e]}, expected "
                                  f"{[pos, pos + entry.nbytes]}")
        items.append(entry)
        pos = e
    return items


def open_orbax_draft(path: str | Path) -> OrbaxDraft:
    path = Path(path)
    cfg, raw = _read_config(path / CONFIG_FILE)
    layout_path = path / LAYOUT_FILE
    params_dir = path / PARAMS_DIR
    leaves = orbax_leaves(path)
    if layout_path.exists():
        try:
            layout = json.loads(layout_path.read_text())
            header_bytes = layout["header"].encode("utf-8")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{layout_path}: not a valid layout file ({type(e).__name__}: {e})") from None
        if layout.get("format") != LAYOUT_FORMAT or layout.get("version") != LAYOUT_VERSION:
            raise CheckpointError(f"{layout_path}: format {layout.get('format')!r} version "
                                  f"{layout.get('version')!r}, expected {LAYOUT_FORMAT!r} {LAYOUT_VERSION}")
        tensors = _parse_header(header_bytes, str(layout_path))
        check_tensors(cfg, tensors, str(layout_path))
    else:
        # an Orbax draft from elsewhere (training): export with a fresh header, embeddings if saved
        inv = draft_inventory(cfg, include_embed=EMBED_NAME in leaves)
        tensors = list(inv.tensors)
        header_bytes = header_for([(t.name, t.dtype, t.shape) for t in tensors], TORCHSPEC_METADATA)[0]
    problems = []
    for t in tensors:
        leaf = leaves.get(t.name)
        if leaf is None:
            problems.append(f"{params_dir}: missing tensor {t.name!r}")
            continue
        shape, dtype = tuple(getattr(leaf, "shape", ()) or ()), getattr(leaf, "dtype", None)
        if shape != t.shape or dtype is None or np.dtype(dtype) != DTYPES[t.dtype]:
            problems.append(f"{params_dir}: tensor {t.name!r} is {list(shape)} {dtype}, the header says "
                            f"{list(t.shape)} {DTYPES[t.dtype].name}")
    known = {t.name for t in tensors}
    problems += [f"{params_dir}: unexpected tensor {n!r}" for n in leaves if n not in known]
    if problems:
        raise CheckpointError(f"{path}: the Orbax params do not match the draft layout "
                              f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:MAX_LISTED]))
    return OrbaxDraft(path, cfg, raw, header_bytes, tensors, OrbaxArrays(params_dir))


def is_torch_draft_dir(path: Path) -> bool:
    return (path / SAFETENSORS_FILE).is_file()


def is_orbax_draft_dir(path: Path) -> bool:
    return (path / PARAMS_DIR).is_dir()


# ---------------------------------------------------------------------------------------------
# loading a model


def load_draft(path: str | Path, *, dtype=None, mesh: Mesh | None = None) -> K3DSparkModel:
    """The draft from a torch-layout dir or an Orbax-layout dir (`dspark_jax.load_draft` also takes
    a preset name), tensor by tensor, each placed straight into its sharding on `mesh` (default:
    one device). `dtype` overrides the config's (floats are cast, e.g. float32 for tests).
    `embed_tokens` is not loaded (the target's table is used)."""
    path = Path(path)
    if is_torch_draft_dir(path):
        src = open_torch_draft(path)
    elif is_orbax_draft_dir(path):
        src = open_orbax_draft(path)
    else:
        raise CheckpointError(f"{path}: neither a torch nor an Orbax draft directory")
    mesh = mesh if mesh is not None else sharding_lib.make_mesh(devices=jax.local_devices()[:1])
    model = abstract_draft(src.cfg, dtype)
    if src.cfg.reduced_vocab:
        # the map (d2t/t2d, not parameters): checked against each other, int32/bool in the model
        d2t, t2d = src.read("d2t"), src.read("t2d")
        check_vocab_map(src.cfg, d2t, t2d, str(path))
        maps = vocab_map_vars(model)
        maps["d2t"].set_value(jax.device_put(jnp.asarray(d2t.astype(np.int32))))
        maps["t2d"].set_value(jax.device_put(jnp.asarray(t2d.astype(bool))))
    return sharding_lib.place_params(
        model, mesh,
        lambda targets: {name: jax.device_put(src.read(name).astype(t.dtype, copy=False), t.sharding)
                         for name, t in targets.items()})


# ---------------------------------------------------------------------------------------------
# exporting a model (training)


def save_torch_draft(model: K3DSparkModel, cfg_dict: Mapping, dst: str | Path) -> TorchDraft:
    """Write a draft model in the torch layout: `config.json` (cfg_dict as given; its
    `torch_dtype` decides the tensor dtype) + `model.safetensors` in the reference writer's order
    with the TorchSpec metadata, without `embed_tokens` (the target's). Atomic (temp dir + rename)."""
    cfg = DraftConfig.from_dict(dict(cfg_dict), where="save_torch_draft config")
    dt = np.dtype(jnp.dtype(cfg.dtype))
    arrays = {name: np.asarray(jax.device_get(p.get_value())).astype(dt)
              for name, p in params_lib.flat_params(model).items()}
    maps = vocab_map_vars(model)
    if maps:   # the EAGLE-3 form: d2t int64 offsets, t2d bool mask
        d2t = np.asarray(jax.device_get(maps["d2t"].get_value())).astype(np.int64)
        arrays["d2t"], arrays["t2d"] = vocab_map_arrays(np.arange(d2t.shape[0]) + d2t, cfg.vocab_size)
    check_tensors(cfg, [TensorEntry(n, dtype_name(a.dtype), tuple(a.shape)) for n, a in arrays.items()],
                  "save_torch_draft")
    with staging(Path(dst)) as tmp:
        save_arrays(tmp / SAFETENSORS_FILE, arrays, TORCHSPEC_METADATA)
        (tmp / CONFIG_FILE).write_text(json.dumps(dict(cfg_dict), indent=2) + "\n")
    return open_torch_draft(dst)
