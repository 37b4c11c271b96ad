"""Teacher hidden states for distillation: online (inside the training step) or offline (shards).

Both paths hand the loss the same two arrays per sequence: the concatenated aux hidden states of
the draft's `target_layer_ids` [S, n_aux*H] and the target's post-final-norm hidden state [S, H]
(docs/architecture.md §2, §4), computed by the same jitted `teacher_outputs` on right-padded [B, S] batches.

Offline shard directory (written once, streamed, resumable, and usable as a LIVE stream: several
writer processes append shards while one trainer consumes them, through the file system only):

    meta.json                          {"format": "dspark_jax.teacher", "version": 1,
                                        "num_writers": W, "shard_size": n, "aux_layer_ids": [...],
                                        "hidden_size": H, "aux_width": n_aux*H, "dtype": "float32",
                                        "target": str, "max_len": S}
    shard-w{k:03d}-{j:06d}.safetensors writer k's j-th shard: up to n sequences, ragged-packed
        input_ids     I32 [N]           tokens of all its sequences, back to back
        loss_mask     U8  [N]
        offsets       I64 [n+1]         sequence i is rows offsets[i]:offsets[i+1]
        aux_hidden    <dtype> [N, n_aux*H]
        final_hidden  <dtype> [N, H]
        __metadata__  {"format": "dspark_jax.teacher_shard", "sample_ids": JSON list of ids}
    writer-{k:03d}.done                {"num_shards": m, "num_samples": c}: writer k finished

Writers: sample i of the (deterministically ordered) data goes to writer i % W; each shard is
written to a hidden temp name, fsync'ed and renamed into place (readers never see partial files);
a restarted writer counts its existing shards and continues after them. Readers visit shards in
the canonical order j = 0, 1, ...; k = 0..W-1 within each j, waiting for a shard that is not there
yet unless its writer's `.done` says it never will be, so the sample order (and a training run
consuming it) does not depend on which writer was faster. A reader position is
(epoch, ordinal = j*W + k, offset within the shard).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoint.safetensors_io import SafetensorsFile, save_arrays
from dspark_jax.train.regen import Sample

FORMAT = "dspark_jax.teacher"
SHARD_FORMAT = "dspark_jax.teacher_shard"
VERSION = 1
META_FILE = "meta.json"


class TeacherOutputs(NamedTuple):
    aux_BSA: jax.Array            # concatenated aux hidden states of the draft's target layers
    final_hidden_BSH: jax.Array   # post-final-norm hidden state (the lm_head input)


def teacher_outputs(target, input_ids_BS: jax.Array, valid_BS: jax.Array,
                    aux_layer_ids: Sequence[int]) -> TeacherOutputs:
    """The teacher's prefill (cacheless target forward over right-padded rows), no gradient."""
    out = target.forward(input_ids_BS, tuple(aux_layer_ids), valid_BS=valid_BS)
    return TeacherOutputs(jax.lax.stop_gradient(out.aux_hidden), jax.lax.stop_gradient(out.final_hidden))


def frozen_tables(target) -> tuple[jax.Array, jax.Array]:
    """The target's embedding table and lm_head [V, D] (the same array when tied)."""
    embed = target.model.embed_tokens.weight.get_value()
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight.get_value()
    return embed, head


def pad_batch(samples: Sequence[Sample], max_len: int,
              batch: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded (input_ids int32, loss_mask bool, valid bool), each [batch, max_len]; rows
    past len(samples) are empty (all padding)."""
    b = batch or len(samples)
    ids = np.zeros((b, max_len), np.int32)
    mask = np.zeros((b, max_len), bool)
    valid = np.zeros((b, max_len), bool)
    for i, s in enumerate(samples):
        n = min(len(s.input_ids), max_len)
        ids[i, :n] = s.input_ids[:n]
        mask[i, :n] = s.loss_mask[:n]
        valid[i, :n] = True
    return ids, mask, valid


# ---------------------------------------------------------------------------------------------
# offline shards


@dataclass(frozen=True)
class ShardMeta:
    num_writers: int
    shard_size: int
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    aux_width: int
    dtype: str
    target: str
    max_len: int

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "num_writers": self.num_writers,
                "shard_size": self.shard_size, "aux_layer_ids": list(self.aux_layer_ids),
                "hidden_size": self.hidden_size, "aux_width": self.aux_width, "dtype": self.dtype,
                "target": self.target, "max_len": self.max_len}

    @classmethod
    def from_json(cls, d: dict, where: str) -> "ShardMeta":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"{where}: format {d.get('format')!r} v{d.get('version')}, expected {FORMAT!r} v{VERSION}")
        return cls(int(d["num_writers"]), int(d["shard_size"]), tuple(int(i) for i in d["aux_layer_ids"]),
                   int(d["hidden_size"]), int(d["aux_width"]), str(d["dtype"]), str(d["target"]), int(d["max_len"]))


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
        raise ValueError(f"{path}: written with other settings ({have} vs {meta})")


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
        self._pending: list[tuple[Sample, np.ndarray, np.ndarray]] = []
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
        n = len(sample.input_ids)
        self._pending.append((sample, np.asarray(aux_SA)[:n], np.asarray(final_SH)[:n]))
        if len(self._pending) == self.meta.shard_size:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        samples = [p[0] for p in self._pending]
        lens = [len(s.input_ids) for s in samples]
        dt = np.dtype(jnp.dtype(self.meta.dtype))
        arrays = {
            "input_ids": np.concatenate([s.input_ids for s in samples]).astype(np.int32),
            "loss_mask": np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
            "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            "aux_hidden": np.concatenate([p[1] for p in self._pending]).astype(dt),
            "final_hidden": np.concatenate([p[2] for p in self._pending]).astype(dt),
        }
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


def read_shard(path: Path) -> tuple[list[str], list[Sample], np.ndarray, np.ndarray, np.ndarray]:
    """(sample ids, samples, offsets, aux [N, A], final [N, H]) of one shard."""
    sf = SafetensorsFile(path)
    ids = json.loads((sf.metadata or {}).get("sample_ids", "[]"))
    tok, mask, off = sf.read("input_ids"), sf.read("loss_mask").astype(bool), sf.read("offsets")
    samples = [Sample(ids[i], tok[off[i]:off[i + 1]], mask[off[i]:off[i + 1]]) for i in range(len(off) - 1)]
    return ids, samples, off, sf.read("aux_hidden"), sf.read("final_hidden")


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
                self._cache = (pos.ordinal, read_shard(path))
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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
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
    fn = nnx.jit(teacher_outputs, static_argnums=3)
    t0 = time.time()
    for start in range(skip, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        ids, _, valid = pad_batch(chunk, meta.max_len, batch_size)
        aux, final = fn(target, _place_batch(ids, mesh), _place_batch(valid, mesh), tuple(meta.aux_layer_ids))
        aux, final = np.asarray(aux), np.asarray(final)
        for i, s in enumerate(chunk):
            out.add(s, aux[i], final[i])
        if log:
            done = start + len(chunk)
            log(f"writer {writer}: {done}/{len(mine)} sequences, {out.num_shards} shards published, "
                f"{(done - skip) / (time.time() - t0):.2f} seq/s")
    out.finish()
    return out
