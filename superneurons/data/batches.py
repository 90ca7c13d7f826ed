"""Batches as a pure function of their index: the basis of reproducible, resumable data input.

Batch k of a layer holds records `skip + k*N ... skip + k*N + N-1` (mod the record count) and is
transformed with a random generator seeded from (run seed, phase, layer index, k). Nothing depends
on what ran before, so a run resumed at batch k sees the same data as an uninterrupted one, and the
prefetch thread's timing cannot change anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

from superneurons.data.transformer import DataTransformer
from superneurons.errors import UserError

# What a random generator is for; part of its seed so the streams never overlap.
BATCH, SKIP, SHUFFLE = 0, 1, 2


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


class RecordSource(Protocol):
    """Where a prefetching data layer reads from: numbered records of (C, H, W) pixels and a label."""

    count: int
    where: str

    def records_from(self, start: int, seeds: Seeds) -> Iterator[tuple[int, np.ndarray, int]]:
        """(record number, pixels, label) from absolute position `start` on, wrapping forever."""
        ...

    def close(self) -> None:
        ...


@dataclass
class Batch:
    index: int
    data: np.ndarray  # (N, C, H, W) float32, transformed
    label: np.ndarray  # (N,) float32


def batches(source: RecordSource, transformer: DataTransformer, batch_size: int, item_shape: tuple[int, ...],
            seeds: Seeds, skip: int, start: int) -> Iterator[Batch]:
    """Batches `start, start+1, ...` of a layer (see the module docstring)."""
    records = source.records_from(skip + start * batch_size, seeds)
    try:
        k = start
        while True:
            rng = seeds.rng(BATCH, k) if transformer.uses_rng else None
            data = np.empty((batch_size,) + tuple(item_shape), dtype=np.float32)
            label = np.empty((batch_size,), dtype=np.float32)
            for i in range(batch_size):
                number, pixels, label[i] = next(records)
                shape = transformer.out_shape(pixels.shape)
                if shape != tuple(item_shape):
                    raise UserError(f"{source.where}: record {number} gives a {_fmt(shape)} input, the first record "
                                    f"a {_fmt(item_shape)} one; every record of a batch needs the same shape "
                                    f"(resize when converting, or set crop_size)")
                transformer(pixels, rng, data[i])
            yield Batch(k, data, label)
            k += 1
    finally:
        records.close()


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)
