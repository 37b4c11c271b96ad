"""Streaming safetensors: read one tensor at a time, write tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the raw
bytes. We parse it ourselves so that (a) a checkpoint is never loaded whole (peak memory is
one tensor), (b) every inconsistency is reported with the file and tensor name, and (c) the
writer can reproduce a torch-written file byte for byte (same key order, same metadata).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or inconsistent; the message names it."""


DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int            # absolute file offsets of the data
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """Header of one .safetensors file plus lazy per-tensor reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(f"{self.path}: header length {n} exceeds the file size {size} (truncated?)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.header_bytes = raw
        self.metadata: dict[str, str] | None = header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            dt = h.get("dtype")
            if dt not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dt!r}")
            b, e = h["data_offsets"]
            shape = tuple(int(s) for s in h["shape"])
            expect = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
            if e - b != expect:
                raise CheckpointError(f"{self.path}: tensor {name!r} holds {e - b} bytes, "
                                      f"shape {list(shape)} {dt} needs {expect}")
            if self.data_start + e > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at byte "
                                      f"{self.data_start + e}, the file has {size}")
            self.tensors[name] = TensorInfo(name, dt, shape, self.data_start + b, self.data_start + e)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> np.ndarray:
        """One tensor as a fresh numpy array (only its bytes are read)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            buf = f.read(info.nbytes)
        if len(buf) != info.nbytes:
            raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r}")
        return np.frombuffer(buf, dtype=info.np_dtype).reshape(info.shape).copy()

    def read_bytes(self, name: str) -> bytes:
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            return f.read(info.nbytes)


class ShardedCheckpoint:
    """A HF checkpoint directory: `model.safetensors.index.json` + shards, or one `model.safetensors`."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            for shard in sorted(set(weight_map.values())):
                self.files[shard] = SafetensorsFile(self.dir / shard)
            for name, shard in weight_map.items():
                if name not in self.files[shard]:
                    raise CheckpointError(f"{self.dir / shard}: index lists tensor {name!r} but the shard lacks it")
                self.where[name] = shard
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
            for p in shards:
                f = SafetensorsFile(p)
                self.files[p.name] = f
                for name in f.keys():
                    if name in self.where:
                        raise CheckpointError(f"{p}: tensor {name!r} also in {self.where[name]}")
                    self.where[name] = p.name

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def read(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: no tensor {name!r}")
        return self.files[self.where[name]].read(name)


def header_for(items: Iterable[tuple[str, str, tuple[int, ...]]],
               metadata: Mapping[str, str] | None) -> tuple[bytes, list[tuple[int, int]]]:
    """Serialise a header the way the reference writer does: metadata first, keys in given order,
    8-byte alignment padding with spaces."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape in items:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append((pos, pos + n))
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return raw, offsets


def write_streaming(path: str | Path, items: list[tuple[str, str, tuple[int, ...]]],
                    chunks: Iterator[tuple[str, bytes | memoryview | np.ndarray]],
                    metadata: Mapping[str, str] | None = None,
                    header_bytes: bytes | None = None) -> None:
    """Write a safetensors file piece by piece. `items` fixes the header (names, dtypes, shapes,
    order); `chunks` yields `(name, data)` in the same order, each tensor's bytes whole or in
    consecutive pieces (e.g. row bands), so no tensor needs to be in memory at once; the file is
    fsynced once at the end. `header_bytes` reproduces a source header verbatim when converting
    back (byte-identical round trips)."""
    raw = header_bytes if header_bytes is not None else header_for(items, metadata)[0]
    sizes = [(name, int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize) for name, dtype, shape in items]
    todo = iter(sizes)
    name, left, total = None, 0, 0          # the tensor being written and its bytes still due
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for got, data in chunks:
            if left == 0 or got != name:    # the next tensor starts
                if left:
                    raise CheckpointError(f"{path}: tensor {name!r} has {total - left} bytes, expected {total}")
                name, total = next(todo, (None, 0))
                if name is None:
                    raise CheckpointError(f"{path}: data for tensor {got!r} after the last tensor of the header")
                if got != name:
                    raise CheckpointError(f"{path}: expected tensor {name!r} next, got {got!r}")
                left = total
            # the array's own memory, not a copy (ndarray.tobytes would copy it)
            buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)) \
                if isinstance(data, np.ndarray) else memoryview(data).cast("B")
            if len(buf) > left:
                raise CheckpointError(f"{path}: tensor {name!r} has {total - left + len(buf)} bytes, "
                                      f"expected {total}")
            f.write(buf)
            left -= len(buf)
        if left:
            raise CheckpointError(f"{path}: tensor {name!r} has {total - left} bytes, expected {total}")
        rest = [n for n, _ in todo]
        if rest:
            raise CheckpointError(f"{path}: no data for tensor(s) {rest[:5]}")
        f.flush()
        os.fsync(f.fileno())


def save_arrays(path: str | Path, arrays: Mapping[str, np.ndarray],
                metadata: Mapping[str, str] | None = None) -> None:
    """Write a dict of numpy arrays in the reference writer's order (wider dtypes first, then name),
    so the file equals what `safetensors.numpy.save_file` writes."""
    names = sorted(arrays, key=lambda n: (-np.dtype(arrays[n].dtype).itemsize, n))
    items = [(n, DTYPE_NAMES[np.dtype(arrays[n].dtype)], tuple(arrays[n].shape)) for n in names]
    write_streaming(path, items, ((n, np.ascontiguousarray(arrays[n])) for n in names), metadata)
