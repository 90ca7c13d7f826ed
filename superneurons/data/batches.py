"""Batches as a pure function of their index: the basis of reproducible, resumable, parallel data input.

Batch k of a layer holds the records at stream positions `skip + (k*B + i)*N + r` for i in 0..B-1,
where B is the batch size and r of N is the data-parallel rank (N = 1, r = 0 for one process: positions
`skip + k*B ... skip + k*B + B-1`, as Caffe reads). A position maps to a record number modulo the
record count (Data), or through the pass's permutation (ImageData with shuffle). The batch is
transformed with a random generator seeded from (run seed, phase, layer index, k).

Nothing depends on what ran before, or on which thread or process made the batch, so a run resumed
at batch k sees the same data as an uninterrupted one, and 1, 2 or 16 decode workers give the same
bytes. The union over the N ranks of their batch k is the records of the one-rank batch k of size N*B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

from superneurons.data.transformer import DataTransformer
from superneurons.dtypes import FLOAT32
from superneurons.errors import UserError

# What a random generator is for; part of its seed so the streams never overlap.
BATCH, SKIP, SHUFFLE, WINDOW = 0, 1, 2, 3  # WINDOW: WindowData's window choice per position


@dataclass(frozen=True)
class Seeds:
    """The entropy of one data layer in one run: (run seed, phase, layer index)."""

    entropy: tuple[int, ...]

    @classmethod
    def for_layer(cls, seed: int, phase: int, layer_index: int) -> "Seeds":
        # SeedSequence wants non-negative integers; Caffe's random_seed may be -1.
        return cls((seed & 0xFFFFFFFFFFFFFFFF, int(phase), int(layer_index)))

    def rng(self, purpose: int, index: int = 0) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(list(self.entropy) + [purpose], spawn_key=(index,)))


class RecordReader(Protocol):
    """Reads records by stream position; opened in the thread or process that uses it."""

    def read(self, position: int) -> tuple[int, np.ndarray, int]:
        """(record number, (C, H, W) pixels, label) at `position`; cheapest when positions increase."""
        ...

    def close(self) -> None:
        ...


class RecordSource(Protocol):
    """Where a prefetching data layer reads from. Picklable: decode worker processes receive it and
    call `open` themselves (a database handle must not cross a process boundary)."""

    count: int
    where: str
    # Whether several processes may open it at once (LevelDB's lock admits one): else no decode workers.
    multiprocess: bool

    def open(self, seeds: "Seeds") -> RecordReader:
        ...

    def close(self) -> None:
        """Release what the layer's own process holds open."""
        ...


@dataclass(frozen=True)
class BatchPlan:
    """Everything that decides batch k besides the records themselves. Picklable."""

    batch_size: int
    item_shape: tuple[int, ...]
    seeds: Seeds
    skip: int = 0
    rank: int = 0
    ranks: int = 1
    # The element type the batch is delivered in: the data top's storage type (a half net's batch is rounded
    # once, where it is made, and copied to the device as it will be stored, with no float32 staging there).
    data_dtype: np.dtype = FLOAT32

    def positions(self, k: int) -> range:
        n, b = self.ranks, self.batch_size
        first = self.skip + k * b * n + self.rank
        return range(first, first + b * n, n)


@dataclass
class Batch:
    index: int
    data: np.ndarray  # (N, C, H, W) transformed, in the plan's data_dtype
    label: np.ndarray  # (N,) float32


def fill_batch(reader: RecordReader, transformer: DataTransformer, plan: BatchPlan, k: int,
               data: np.ndarray, label: np.ndarray, where: str) -> None:
    """Write batch k into `data` (B, *item_shape) of plan.data_dtype and `label` (B,) float32. The transforms
    compute in float32; a half batch takes each item rounded from a float32 one."""
    rng = plan.seeds.rng(BATCH, k) if transformer.uses_rng else None
    item = np.empty(tuple(plan.item_shape), np.float32) if data.dtype != np.float32 else None
    for i, position in enumerate(plan.positions(k)):
        number, pixels, label[i] = reader.read(position)
        shape = transformer.out_shape(pixels.shape)
        if shape != tuple(plan.item_shape):
            raise UserError(f"{where}: record {number} gives a {_fmt(shape)} input, the first record "
                            f"a {_fmt(plan.item_shape)} one; every record of a batch needs the same shape "
                            f"(resize when converting, or set crop_size)")
        if item is None:
            transformer(pixels, rng, data[i])
        else:
            transformer(pixels, rng, item)
            data[i] = item


def new_batch(plan: BatchPlan, k: int) -> Batch:
    return Batch(k, np.empty((plan.batch_size,) + tuple(plan.item_shape), dtype=plan.data_dtype),
                 np.empty((plan.batch_size,), dtype=np.float32))


def batches(source: RecordSource, transformer: DataTransformer, plan: BatchPlan, start: int) -> Iterator[Batch]:
    """Batches `start, start+1, ...` of a layer, made in the calling thread (see the module docstring)."""
    reader = source.open(plan.seeds)
    try:
        k = start
        while True:
            batch = new_batch(plan, k)
            fill_batch(reader, transformer, plan, k, batch.data, batch.label, source.where)
            yield batch
            k += 1
    finally:
        reader.close()


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)
