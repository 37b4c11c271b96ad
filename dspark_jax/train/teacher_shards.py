"""Offline teacher shards: the teacher's hidden states written once, streamed, resumable.

Offline shard directory (written once, streamed, resumable, and usable as a LIVE stream: several
writer processes append shards while one trainer consumes them, through the file system only):

    meta.json                          {"format": "dspark_jax.teacher", "version": 1 or 2,
                                        "num_writers": W, "shard_size": n, "aux_layer_ids": [...],
                                        "hidden_size": H, "aux_width": n_aux*H, "dtype": "float32",
                                        "target": str, "max_len": S[, "aux_dtype": "float8_e4m3fn"]}
    shard-w{k:03d}-{j:06d}.safetensors writer k's j-th shard: up to n sequences, ragged-packed
        input_ids     I32 [N]           tokens of all its sequences, back to back
        loss_mask     U8  [N]
        offsets       I64 [n+1]         sequence i is rows offsets[i]:offsets[i+1]
        aux_hidden    <aux_dtype> [N, n_aux*H]
        final_hidden  <aux_dtype> [N, H]
        aux_scale     F32 [N, n_aux]    float8 storage only: one scale per token and captured layer
        final_scale   F32 [N, 1]        float8 storage only: one scale per token
        __metadata__  {"format": "dspark_jax.teacher_shard", "sample_ids": JSON list of ids}
    writer-{k:03d}.done                {"num_shards": m, "num_samples": c}: writer k finished

`dtype` is what the trainer receives (the teacher's compute dtype); `aux_dtype` is how the hidden
states are stored, `dtype` itself when absent (version 1, the layout older readers know). Stored as
`float8_e4m3fn` (version 2: older readers refuse it instead of misreading it), each row of H values
(one token, one captured layer or the final state) is kept as float8 with one float32 scale
(`fp8_rows`: within 2^-4 of each value) and the reader returns it dequantized to `dtype`: half a
bf16 shard (K3 widths: 43,037 instead of 86,021 bytes per token, `bytes_per_token`).

Writers: sample i of the (deterministically ordered) data goes to writer i % W; each shard is
written to a hidden temp name, fsync'ed and renamed into place (readers never see partial files);
a restarted writer counts its existing shards and continues after them. Readers visit shards in
the canonical order j = 0, 1, ...; k = 0..W-1 within each j, waiting for a shard that is not there
yet unless its writer's `.done` says it never will be, so the sample order (and a training run
consuming it) does not depend on which writer was faster. A reader position is
(epoch, ordinal = j*W + k, offset within the shard).

The format's writer, reader and checks are one contract (a field the writer adds is one the reader
checks), kept side by side here.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.checkpoint.safetensors_io import DTYPE_NAMES, CheckpointError, SafetensorsFile, save_arrays
from dspark_jax.train.fp8_rows import FP8, dequantize_rows, quantize_rows
from dspark_jax.train.regen import Sample
from dspark_jax.train.teacher import StoredRows, pad_batch, stored_outputs, stored_rows

FORMAT = "dspark_jax.teacher"
SHARD_FORMAT = "dspark_jax.teacher_shard"
VERSION = 1              # hidden states stored in the dtype the trainer receives
VERSION_SCALED = 2       # hidden states stored as float8 with per-row scales
META_FILE = "meta.json"
# storage dtypes the writer accepts besides the trainer's own dtype
AUX_DTYPES = ("float32", "bfloat16", FP8)




@dataclass(frozen=True)
class ShardMeta:
    num_writers: int
    shard_size: int
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    aux_width: int
    dtype: str                   # what the reader returns (the teacher's compute dtype)
    target: str
    max_len: int
    aux_dtype: str | None = None     # how the hidden states are stored; None: `dtype`

    def __post_init__(self):
        if self.aux_dtype is None:
            object.__setattr__(self, "aux_dtype", self.dtype)
        if self.aux_dtype not in AUX_DTYPES + (self.dtype,):
            raise ValueError(f"aux_dtype {self.aux_dtype!r}: expected one of {AUX_DTYPES} or {self.dtype!r}")
        if self.scaled and self.aux_width != len(self.aux_layer_ids) * self.hidden_size:
            raise ValueError(f"aux_width {self.aux_width} != {len(self.aux_layer_ids)} layers x hidden_size "
                             f"{self.hidden_size}: float8 storage scales each layer's row")

    @property
    def scaled(self) -> bool:
        """Stored as float8 with per-row scales."""
        return self.aux_dtype == FP8

    def to_json(self) -> dict:
        d = {"format": FORMAT, "version": VERSION_SCALED if self.scaled else VERSION,
             "num_writers": self.num_writers, "shard_size": self.shard_size, "aux_layer_ids": list(self.aux_layer_ids),
             "hidden_size": self.hidden_size, "aux_width": self.aux_width, "dtype": self.dtype,
             "target": self.target, "max_len": self.max_len}
        if self.aux_dtype != self.dtype:
            d["aux_dtype"] = self.aux_dtype
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> "ShardMeta":
        if d.get("format") != FORMAT or d.get("version") not in (VERSION, VERSION_SCALED):
            raise ValueError(f"{where}: format {d.get('format')!r} v{d.get('version')}, expected {FORMAT!r} "
                             f"v{VERSION} or v{VERSION_SCALED}")
        try:
            meta = cls(int(d["num_writers"]), int(d["shard_size"]), tuple(int(i) for i in d["aux_layer_ids"]),
                       int(d["hidden_size"]), int(d["aux_width"]), str(d["dtype"]), str(d["target"]),
                       int(d["max_len"]), d.get("aux_dtype"))
        except KeyError as e:
            raise ValueError(f"{where}: no field {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if (d["version"] == VERSION_SCALED) != meta.scaled:
            raise ValueError(f"{where}: version {d['version']} with aux_dtype {meta.aux_dtype!r}")
        return meta

    def differences(self, other: "ShardMeta") -> str:
        """'field: a vs b' for every field that differs (for error messages)."""
        return ", ".join(f"{f}: {getattr(self, f)!r} vs {getattr(other, f)!r}" for f in self.__dataclass_fields__
                         if getattr(self, f) != getattr(other, f))


def bytes_per_token(hidden_size: int, num_aux: int, aux_dtype: str) -> int:
    """Shard bytes per token, headers aside: the num_aux captured layers and the final hidden
    state (H values each) in `aux_dtype`, their float32 scales when float8, the int32 token id
    and the uint8 loss mask."""
    rows = num_aux + 1
    scales = rows * 4 if aux_dtype == FP8 else 0
    return rows * hidden_size * np.dtype(jnp.dtype(aux_dtype)).itemsize + scales + 4 + 1


def shard_name(writer: int, index: int) -> str:
    return f"shard-w{writer:03d}-{index:06d}.safetensors"


def done_name(writer: int) -> str:
    return f"writer-{writer:03d}.done"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_or_create_meta(directory: str | os.PathLike, meta: ShardMeta) -> None:
    """Write meta.json if absent (first writer wins, atomically); otherwise require equality."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / META_FILE
    if not path.exists():
        tmp = directory / f".{META_FILE}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(meta.to_json(), indent=1) + "\n")
        try:
            os.link(tmp, path)          # fails if another writer created it first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    have = read_meta(directory)
    if have != meta:
        raise ValueError(f"{path}: written with other settings (the directory's vs this writer's: "
                         f"{have.differences(meta)})")


def read_meta(directory: str | os.PathLike) -> ShardMeta:
    path = Path(directory) / META_FILE
    return ShardMeta.from_json(json.loads(path.read_text()), str(path))


class ShardWriter:
    """Writer k of W: takes this writer's samples with their teacher outputs, packs them into
    shards of `shard_size` sequences, publishes each atomically, and marks completion."""

    def __init__(self, directory: str | os.PathLike, writer: int, meta: ShardMeta):
        if not 0 <= writer < meta.num_writers:
            raise ValueError(f"writer index {writer} outside 0..{meta.num_writers - 1}")
        self.dir, self.writer, self.meta = Path(directory), writer, meta
        open_or_create_meta(self.dir, meta)
        self.num_shards = self._existing_shards()
        self._pending: list[tuple[Sample, StoredRows]] = []
        self.num_samples = self._existing_samples()

    def _existing_shards(self) -> int:
        n = 0
        while (self.dir / shard_name(self.writer, n)).exists():
            n += 1
        return n

    def _existing_samples(self) -> int:
        if not self.num_shards:
            return 0
        last = SafetensorsFile(self.dir / shard_name(self.writer, self.num_shards - 1))
        return (self.num_shards - 1) * self.meta.shard_size + last.tensors["offsets"].shape[0] - 1

    @property
    def samples_done(self) -> int:
        """Samples already published (a restarted writer skips this many of its own)."""
        return self.num_shards * self.meta.shard_size

    def add(self, sample: Sample, aux_SA: np.ndarray, final_SH: np.ndarray) -> None:
        """One sample with its hidden states in any float dtype (stored as meta.aux_dtype)."""
        n = len(sample.input_ids)
        self.add_stored(sample, stored_rows(np.asarray(aux_SA)[:n], np.asarray(final_SH)[:n], self.meta, quantize_rows))

    def add_stored(self, sample: Sample, rows: StoredRows) -> None:
        """One sample with its hidden states already in storage form (`stored_outputs`)."""
        n = len(sample.input_ids)
        want = np.dtype(jnp.dtype(self.meta.aux_dtype))
        if rows.aux.dtype != want or rows.final.dtype != want or (rows.aux_scale is None) == self.meta.scaled:
            raise ValueError(f"{self.dir}: sample {sample.id!r}: hidden states {rows.aux.dtype} "
                             f"{'with' if rows.aux_scale is not None else 'without'} scales, the directory stores "
                             f"{self.meta.aux_dtype}{' with scales' if self.meta.scaled else ''}")
        self._pending.append((sample, StoredRows(*(None if a is None else np.asarray(a)[:n] for a in rows))))
        if len(self._pending) == self.meta.shard_size:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        samples = [p[0] for p in self._pending]
        lens = [len(s.input_ids) for s in samples]
        arrays = {
            "input_ids": np.concatenate([s.input_ids for s in samples]).astype(np.int32),
            "loss_mask": np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
            "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        }
        for name, parts in zip(("aux_hidden", "final_hidden", "aux_scale", "final_scale"),
                               zip(*(p[1] for p in self._pending))):
            if parts[0] is not None:
                arrays[name] = np.concatenate(parts)
        final = self.dir / shard_name(self.writer, self.num_shards)
        tmp = self.dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        save_arrays(tmp, arrays, {"format": SHARD_FORMAT, "sample_ids": json.dumps([s.id for s in samples])})
        os.replace(tmp, final)
        self.num_shards += 1
        self.num_samples += len(samples)
        self._pending = []

    def finish(self) -> None:
        self._flush()
        _atomic_write_text(self.dir / done_name(self.writer),
                           json.dumps({"num_shards": self.num_shards, "num_samples": self.num_samples}) + "\n")


def _check_shard(sf: SafetensorsFile, meta: ShardMeta) -> None:
    """Every field's dtype and shape against meta.json and the offsets, before any is used: a
    shard of another run or a damaged one fails naming the file and the field."""
    stored = DTYPE_NAMES[np.dtype(jnp.dtype(meta.aux_dtype))]
    n = sf.tensors["input_ids"].shape[0] if "input_ids" in sf else None
    want = {"input_ids": ("I32", (n,)), "loss_mask": ("U8", (n,)), "offsets": ("I64", None),
            "aux_hidden": (stored, (n, meta.aux_width)), "final_hidden": (stored, (n, meta.hidden_size))}
    if meta.scaled:
        want.update(aux_scale=("F32", (n, len(meta.aux_layer_ids))), final_scale=("F32", (n, 1)))
    for field, (dt, shape) in want.items():
        info = sf.tensors.get(field)
        if info is None:
            raise CheckpointError(f"{sf.path}: no field {field!r} (meta.json: aux_dtype {meta.aux_dtype!r})")
        if info.dtype != dt:
            raise CheckpointError(f"{sf.path}: field {field!r} is {info.dtype}, meta.json's aux_dtype "
                                  f"{meta.aux_dtype!r} needs {dt} (a shard of another run?)")
        if shape is not None and info.shape != shape:
            raise CheckpointError(f"{sf.path}: field {field!r} has shape {list(info.shape)}, expected {list(shape)}")
    extra = {"aux_scale", "final_scale"} & set(sf.keys()) - set(want)
    if extra:
        raise CheckpointError(f"{sf.path}: field {sorted(extra)[0]!r} in a shard whose meta.json stores "
                              f"{meta.aux_dtype!r} without scales (a shard of another run?)")


def read_shard(path: Path, meta: ShardMeta | None = None
               ) -> tuple[list[str], list[Sample], np.ndarray, np.ndarray, np.ndarray]:
    """(sample ids, samples, offsets, aux [N, A], final [N, H]) of one shard, the hidden states in
    `meta.dtype` whatever their storage; `meta`: the directory's meta.json by default."""
    path = Path(path)
    meta = meta or read_meta(path.parent)
    sf = SafetensorsFile(path)
    _check_shard(sf, meta)
    ids = json.loads((sf.metadata or {}).get("sample_ids", "[]"))
    tok, mask, off = sf.read("input_ids"), sf.read("loss_mask").astype(bool), sf.read("offsets")
    n = len(tok)
    if len(off) != len(ids) + 1 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
        raise CheckpointError(f"{path}: field 'offsets' ({len(off)} entries, {off[0] if len(off) else None}.."
                              f"{off[-1] if len(off) else None}) does not split {n} tokens into the "
                              f"{len(ids)} sequences of 'sample_ids'")
    samples = [Sample(ids[i], tok[off[i]:off[i + 1]], mask[off[i]:off[i + 1]]) for i in range(len(off) - 1)]
    aux, final = sf.read("aux_hidden"), sf.read("final_hidden")
    if meta.scaled:
        g, h = len(meta.aux_layer_ids), meta.hidden_size
        aux = dequantize_rows(aux.reshape(n, g, h), sf.read("aux_scale"), meta.dtype).reshape(n, g * h)
        final = dequantize_rows(final.reshape(n, 1, h), sf.read("final_scale"), meta.dtype).reshape(n, h)
    elif meta.aux_dtype != meta.dtype:
        dt = np.dtype(jnp.dtype(meta.dtype))
        aux, final = aux.astype(dt), final.astype(dt)
    return ids, samples, off, aux, final


@dataclass
class StreamPosition:
    epoch: int = 0
    ordinal: int = 0     # j * W + k of the next shard
    offset: int = 0      # sequences of that shard already consumed

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "ordinal": self.ordinal, "offset": self.offset}

    @classmethod
    def from_json(cls, d: dict) -> "StreamPosition":
        return cls(int(d["epoch"]), int(d["ordinal"]), int(d["offset"]))


@dataclass
class TeacherExample:
    sample: Sample
    aux_SA: np.ndarray
    final_SH: np.ndarray


class ShardStream:
    """Reads a shard directory in the canonical order from a position, waiting for shards that
    live writers have not published yet. Epochs > 0 re-read the completed stream."""

    def __init__(self, directory: str | os.PathLike, position: StreamPosition | None = None, *,
                 poll_seconds: float = 2.0, timeout_seconds: float | None = None,
                 log: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        self.position = position or StreamPosition()
        self.poll, self.timeout, self.log = poll_seconds, timeout_seconds, log
        self._wait_for(self.dir / META_FILE, lambda: False)
        self.meta = read_meta(self.dir)
        self._cache: tuple[int, tuple] | None = None

    def _done_shards(self, writer: int) -> int | None:
        path = self.dir / done_name(writer)
        if not path.exists():
            return None
        return int(json.loads(path.read_text())["num_shards"])

    def _wait_for(self, path: Path, gone: Callable[[], bool]) -> bool:
        """True once `path` exists; False if `gone()` says it never will."""
        start = last_note = time.time()
        while not path.exists():
            if gone():
                return False
            now = time.time()
            if self.timeout is not None and now - start > self.timeout:
                raise TimeoutError(f"{path}: not published within {self.timeout} s")
            if self.log and now - last_note > 60:
                self.log(f"waiting for teacher shard {path.name} ...")
                last_note = now
            time.sleep(self.poll)
        return True

    def _all_done(self) -> bool:
        return all(self._done_shards(k) is not None for k in range(self.meta.num_writers))

    def _exhausted(self, ordinal: int) -> bool:
        """True when every writer is done and none has a shard at or after `ordinal`."""
        w = self.meta.num_writers
        counts = [self._done_shards(k) for k in range(w)]
        if any(c is None for c in counts):
            return False
        return all((c - 1) * w + k < ordinal for k, c in enumerate(counts))

    def __iter__(self) -> Iterator[TeacherExample]:
        return self

    def __next__(self) -> TeacherExample:
        w = self.meta.num_writers
        while True:
            pos = self.position
            j, k = divmod(pos.ordinal, w)
            if self._exhausted(pos.ordinal):
                if pos.ordinal == 0:
                    raise ValueError(f"{self.dir}: the teacher stream is empty")
                self.position = StreamPosition(pos.epoch + 1, 0, 0)
                continue
            path = self.dir / shard_name(k, j)
            done = lambda: (c := self._done_shards(k)) is not None and c <= j
            if not self._wait_for(path, done):
                self.position = StreamPosition(pos.epoch, pos.ordinal + 1, 0)
                continue
            if self._cache is None or self._cache[0] != pos.ordinal:
                self._cache = (pos.ordinal, read_shard(path, self.meta))
            _, samples, off, aux, final = self._cache[1]
            if pos.offset >= len(samples):
                self.position = StreamPosition(pos.epoch, pos.ordinal + 1, 0)
                continue
            i = pos.offset
            self.position = StreamPosition(pos.epoch, pos.ordinal, i + 1)
            return TeacherExample(samples[i], aux[off[i]:off[i + 1]], final[off[i]:off[i + 1]])


def _place_batch(x: np.ndarray, mesh) -> jax.Array:
    """Rows over the mesh's data x fsdp devices where they divide the batch, else replicated."""
    if mesh is None:
        return jnp.asarray(x)
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    spec = P(("data", "fsdp")) if split > 1 and x.shape[0] % split == 0 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))


def write_teacher_shards(target, samples: Sequence[Sample], directory: str | os.PathLike, *, writer: int,
                         meta: ShardMeta, batch_size: int, log: Callable[[str], None] | None = None,
                         mesh=None) -> ShardWriter:
    """Writer `writer`'s part of the offline teacher data: samples i with i % W == writer, in
    order, run through the teacher in right-padded [batch_size, max_len] batches (the trainer's
    shapes), published shard by shard; resumes after the shards already present. `mesh`: the
    target's (`train_mesh.training_mesh`); its data x fsdp devices split each batch."""
    out = ShardWriter(directory, writer, meta)
    mine = list(samples)[writer::meta.num_writers]
    skip = out.samples_done
    fn = nnx.jit(stored_outputs, static_argnums=3)
    t0 = time.time()
    for start in range(skip, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        ids, _, valid = pad_batch(chunk, meta.max_len, batch_size)
        rows = fn(target, _place_batch(ids, mesh), _place_batch(valid, mesh), meta)
        rows = [None if a is None else np.asarray(a) for a in rows]      # only the stored bytes leave the device
        for i, s in enumerate(chunk):
            out.add_stored(s, StoredRows(*(None if a is None else a[i] for a in rows)))
        if log:
            done = start + len(chunk)
            log(f"writer {writer}: {done}/{len(mine)} sequences, {out.num_shards} shards published, "
                f"{(done - skip) / (time.time() - t0):.2f} seq/s")
    out.finish()
    return out
