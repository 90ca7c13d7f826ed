"""Data: Caffe's database input layer, reading serialized Datum records from an LMDB folder.

`PrefetchingDataLayer` is the machinery shared with ImageData: shapes from the first record in
`setup` (so `superneurons summary` works without running anything), a DataTransformer, and a
prefetch thread started at the first forward, when the run's seed is known.

Reproducibility and resuming: batch k is a pure function of k (see `superneurons.data.batches`).
The layer's whole position is the number of batches it has served, which `state()` returns and
`restore()` sets; a solver stores it in its snapshot and a resumed run sees the same batches as an
uninterrupted one.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from superneurons.data.batches import SKIP, Batch, RecordSource, Seeds, batches
from superneurons.data.datum import datum_to_array, parse_datum
from superneurons.data.record_db import LEVELDB, LMDB, RecordReader, open_reader
from superneurons.data.prefetch import Prefetcher
from superneurons.data.transformer import DataTransformer, effective_transform_param
from superneurons.layers.base import Layer, register
from superneurons.proto import superneurons_pb2 as pb

DEFAULT_PREFETCH = 4


class _Pipeline:
    """The layer's source and prefetch thread; closed by the layer or when the layer is collected."""

    def __init__(self, source: RecordSource):
        self.source = source
        self.prefetcher: Prefetcher[Batch] | None = None
        self.seeds: Seeds | None = None  # what the running prefetcher was started with

    def stop(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def close(self) -> None:
        self.stop()
        self.source.close()


class PrefetchingDataLayer(Layer):
    """Base of layers whose batches come from a RecordSource through a DataTransformer."""

    is_data = True
    has_backward = False
    n_bottoms = (0, 0)
    n_tops = (1, 2)

    # ---- what a subclass provides ----------------------------------------------------------
    def open_source(self) -> tuple[RecordSource, Any]:
        """Validate the layer's parameters; return the source and the message holding legacy transform fields."""
        raise NotImplementedError

    batch_size: int
    rand_skip: int = 0
    prefetch_depth: int = DEFAULT_PREFETCH

    # ---- the machinery ---------------------------------------------------------------------
    @property
    def where(self) -> str:
        return f"layer {self.name!r} ({self.type_name})"

    def setup(self, bottom_shapes):
        self.close()
        source, legacy = self.open_source()
        self._pipe = _Pipeline(source)
        self._finalizer = weakref.finalize(self, self._pipe.close)
        if self.batch_size < 1:
            raise self.fail(f"batch_size must be at least 1, got {self.batch_size}")
        param = effective_transform_param(self.param, legacy)
        self.transformer = DataTransformer(param, self.phase == pb.TRAIN, self.where)
        first = source.records_from(0, Seeds((0, 0, 0)))
        try:
            _, pixels, _ = next(first)
        finally:
            first.close()
        self.item_shape = self.transformer.out_shape(pixels.shape)
        self._next = 0  # index of the next batch forward serves
        self._last: Batch | None = None
        tops = [(self.batch_size,) + self.item_shape]
        if len(self.param.top) > 1:
            tops.append((self.batch_size,))
        return tops

    def forward(self, bottom, top):
        # A recomputed forward (memory manager replaying this step) must see the same batch again.
        if not (self.ctx.recomputing and self._last is not None):
            self._last = self._take()
        self.ops.upload(top[0], self._last.data)
        if len(top) > 1:
            self.ops.upload(top[1], self._last.label)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass

    def _take(self) -> Batch:
        pipe = self._pipe
        seeds = Seeds.for_layer(self.ctx.seed, self.phase, self.layer_index)
        if pipe.seeds != seeds:  # the run's seed was set (or changed on resume) after the thread started
            pipe.stop()
        if pipe.prefetcher is None:
            pipe.seeds = seeds
            # Caffe skips a random number of records in [0, rand_skip) so parallel solvers see different data.
            skip = int(seeds.rng(SKIP).integers(self.rand_skip)) if self.rand_skip else 0
            items = batches(pipe.source, self.transformer, self.batch_size, self.item_shape, seeds, skip, self._next)
            pipe.prefetcher = Prefetcher(items, self.prefetch_depth, name=f"prefetch:{self.name}")
        batch = pipe.prefetcher.next()
        assert batch.index == self._next, (batch.index, self._next)
        self._next += 1
        return batch

    # ---- position, for snapshots -----------------------------------------------------------
    def state(self) -> dict[str, int]:
        """The layer's position: how many batches it has served."""
        return {"batch": self._next}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position `state()` returned; the next forward serves batch state['batch']."""
        k = state.get("batch") if isinstance(state, dict) else None
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise self.fail(f"cannot restore the data position from {state!r}; expected {{'batch': n}} with n >= 0")
        self._pipe.stop()
        self._next = int(k)
        self._last = None

    def close(self) -> None:
        """Stop the prefetch thread and close the source (also done when the layer is collected)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()


class LmdbRecords:
    """The records of a database (LMDB or LevelDB) of serialized Datums, decoded to arrays."""

    def __init__(self, reader: RecordReader, where: str, force_color: bool, force_gray: bool):
        self.reader = reader
        self.count = self.reader.count
        self.where = where
        self.force_color = force_color
        self.force_gray = force_gray

    def records_from(self, start: int, seeds: Seeds):
        for n, value in enumerate(self.reader.values_from(start), start):
            number = n % self.count
            datum = parse_datum(value, f"{self.where}: record {number}")
            pixels = datum_to_array(datum, f"{self.where}: record {number}", self.force_color, self.force_gray)
            yield number, pixels, datum.label

    def close(self) -> None:
        self.reader.close()


@register("Data")
class Data(PrefetchingDataLayer):
    def open_source(self):
        p = self.param.data_param
        if not p.source:
            raise self.fail("data_param.source is required (an LMDB or LevelDB folder)")
        self.batch_size = int(p.batch_size)
        self.rand_skip = int(p.rand_skip)
        self.prefetch_depth = max(1, int(p.prefetch))
        tp = self.param.transform_param
        force_color = tp.force_color or p.force_encoded_color
        # Caffe's default backend is LEVELDB, yet most prototxts that leave it out meant LMDB: unset reads
        # whichever store the folder holds.
        backend = ({pb.DataParameter.LMDB: LMDB, pb.DataParameter.LEVELDB: LEVELDB}[p.backend]
                   if p.HasField("backend") else None)
        reader = open_reader(p.source, backend, self.where)
        return LmdbRecords(reader, self.where, force_color, tp.force_gray), p
