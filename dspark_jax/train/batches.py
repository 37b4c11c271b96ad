"""Training batches: examples from a list of samples (online teacher) or a shard stream (offline
teacher), collated into one global batch of `accum_steps` micro-batches, padded to a multiple of
128 tokens."""


from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from dspark_jax.train.regen import Sample
from dspark_jax.train.teacher import pad_batch
from dspark_jax.train.teacher_shards import ShardStream, StreamPosition
from dspark_jax.train.trainer import TrainConfig


class Example(NamedTuple):
    sample: Sample
    aux_SA: np.ndarray | None = None       # offline teacher outputs
    final_SH: np.ndarray | None = None


class SampleSource:
    """Regenerated samples for the online teacher: a seeded permutation per epoch; the position
    (epoch, index) is all a resume needs. With `group` (the global batch), each window of 16
    batches is sorted by length before it is cut into batches, and the batches are shuffled:
    a batch then holds similar lengths, so padding to its longest sample wastes little."""

    WINDOW = 16

    def __init__(self, samples: Sequence[Sample], seed: int, group: int | None = None):
        if not samples:
            raise ValueError("no training samples")
        self.samples, self.seed, self.group = list(samples), seed, group
        self.lengths = np.array([len(s.input_ids) for s in self.samples])
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.samples))
        if not self.group:
            return order
        out = []
        for start in range(0, len(order), self.group * self.WINDOW):
            win = order[start:start + self.group * self.WINDOW]
            win = win[np.argsort(self.lengths[win], kind="stable")]
            batches = [win[i:i + self.group] for i in range(0, len(win), self.group)]
            out.extend(batches[j] for j in rng.permutation(len(batches)))
        return np.concatenate(out)

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, position: Mapping) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self._order = self._perm(self.epoch)

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.index == len(self.samples):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._perm(self.epoch)
            out.append(Example(self.samples[self._order[self.index]]))
            self.index += 1
        return out


class ShardSource:
    """Offline teacher data from a shard directory (live or complete)."""

    def __init__(self, stream: ShardStream):
        self.stream = stream

    @property
    def position(self) -> dict:
        return self.stream.position.to_json()

    def restore(self, position: Mapping) -> None:
        self.stream.position = StreamPosition.from_json(dict(position))

    def take(self, n: int) -> list[Example]:
        return [Example(ex.sample, ex.aux_SA, ex.final_SH) for ex in (next(self.stream) for _ in range(n))]


def collate(examples: Sequence[Example], cfg: TrainConfig, offline: bool) -> dict[str, np.ndarray]:
    """[accum, micro, S, ...] arrays of one global batch, right-padded to S: the longest sample
    rounded up to a multiple of 128 (a handful of compiled shapes), at most `max_len`."""
    longest = max(len(e.sample.input_ids) for e in examples)
    m, b, s = cfg.accum_steps, cfg.micro_batch, min(cfg.max_len, -(-longest // 128) * 128)
    ids, mask, valid = pad_batch([e.sample for e in examples], s)
    batch = {"input_ids": ids.reshape(m, b, s), "loss_mask": mask.reshape(m, b, s), "valid": valid.reshape(m, b, s)}
    if offline:
        a, h = examples[0].aux_SA.shape[-1], examples[0].final_SH.shape[-1]
        aux = np.zeros((m * b, s, a), examples[0].aux_SA.dtype)
        final = np.zeros((m * b, s, h), examples[0].final_SH.dtype)
        for i, e in enumerate(examples):
            n = min(len(e.aux_SA), s)
            aux[i, :n], final[i, :n] = e.aux_SA[:n], e.final_SH[:n]
        batch["aux"], batch["final"] = aux.reshape(m, b, s, a), final.reshape(m, b, s, h)
    return batch


