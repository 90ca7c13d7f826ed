"""Data: Caffe's database input layer, reading serialized Datum records from an LMDB or LevelDB folder.

`PrefetchingDataLayer` is the machinery shared with ImageData: shapes from the first record in
`setup` (so `superneurons summary` works without running anything), a DataTransformer, and the
batch makers started at the first forward, when the run's seed is known: decode worker processes
(`data.workers`, `decode_workers` of them, by default one per CPU core) or, with 0 or 1, one
prefetch thread in the process. Both make the same bytes. Batches from workers go to the device straight
from their page-locked shared-memory slot (`ops.upload_pinned`), which the pool reuses only after the copy.

Reproducibility and resuming: batch k is a pure function of k (see `superneurons.data.batches`).
The layer's whole position is the number of batches it has served, which `state()` returns and
`restore()` sets; a solver stores it in its snapshot and a resumed run sees the same batches as an
uninterrupted one.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np

from superneurons.data.batches import SKIP, Batch, BatchPlan, RecordSource, Seeds, batches
from superneurons.data.prefetch import Prefetcher
from superneurons.data.record_db import LEVELDB, LMDB
from superneurons.data.records import DatumRecords
from superneurons.data.transformer import DataTransformer, effective_transform_param
from superneurons.data.workers import WorkerPool, WorkersUnavailable, choose_workers
from superneurons.layers.base import register
from superneurons.layers.batch_position import BatchPosition
from superneurons.layers.source import SourceLayer
from superneurons.proto import superneurons_pb2 as pb

DEFAULT_PREFETCH = 4


class _Pipeline:
    """The layer's source and batch makers; closed by the layer or when the layer is collected."""

    def __init__(self, source: RecordSource):
        self.source = source
        self.prefetcher: Prefetcher[Batch] | WorkerPool | None = None
        self.plan: BatchPlan | None = None  # what the running prefetcher was started with

    def stop(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def close(self) -> None:
        self.stop()
        self.source.close()


class PrefetchingDataLayer(BatchPosition, SourceLayer):
    """Base of layers whose batches come from a RecordSource through a DataTransformer."""

    n_tops = (1, 2)

    # ---- what a subclass provides ----------------------------------------------------------
    def open_source(self) -> tuple[RecordSource, Any]:
        """Validate the layer's parameters; return the source and the message holding legacy transform fields."""
        raise NotImplementedError

    batch_size: int
    rand_skip: int = 0
    prefetch_depth: int = DEFAULT_PREFETCH
    workers_param: Any = None  # the data_param/image_data_param whose decode_workers applies
    shared_memory_short = False  # the workers' slots did not fit /dev/shm, or the workers could not start: the thread

    # ---- the machinery ---------------------------------------------------------------------
    @property
    def workers(self) -> int:
        """Decode worker processes the layer uses (see `data.workers.choose_workers`); 0 or 1: a thread."""
        if self.workers_param is None or self.shared_memory_short or not self._pipe.source.multiprocess:
            return 0
        ctx = self.ctx
        return choose_workers(self.workers_param, ctx.ranks if ctx is not None else 1,
                              ctx.data_workers if ctx is not None else None)

    @property
    def where(self) -> str:
        return f"layer {self.name!r} ({self.type_name})"

    def setup(self, bottom_shapes):
        self.close()
        source, legacy = self.open_source()
        self._pipe = _Pipeline(source)
        self._finalizer = weakref.finalize(self, self._pipe.close)
        try:
            self.item_shape = self._first_item_shape(legacy)
        except BaseException:
            # Close the database now, not when the layer is collected: an error's traceback keeps the layer
            # alive, and LMDB refuses to open an environment whose file another open one had (a new folder
            # can reuse a deleted one's inode), so a process that builds nets again would fail on it.
            self.close()
            raise
        self.next_batch = 0  # index of the next batch forward serves
        self._last: Batch | None = None
        tops = [(self.batch_size,) + self.item_shape]
        if len(self.param.top) > 1:
            tops.append((self.batch_size,))
        return tops

    def _first_item_shape(self, legacy: Any) -> tuple[int, ...]:
        """Check the parameters, make the transformer, and the transformed shape of the first record."""
        if self.batch_size < 1:
            raise self.fail(f"batch_size must be at least 1, got {self.batch_size}")
        param = effective_transform_param(self.param, legacy)
        self.transformer = DataTransformer(param, self.phase == pb.TRAIN, self.where)
        first = self._pipe.source.open(Seeds((0, 0, 0)))
        try:
            _, pixels, _ = first.read(0)
        finally:
            first.close()
        return self.transformer.out_shape(pixels.shape)

    def forward(self, bottom, top):
        # A recomputed forward (memory manager replaying this step) must see the same batch again.
        if not (self.ctx.recomputing and self._last is not None):
            self._last = self._take(top[0].dtype)
        hosts = (self._last.data, self._last.label)[:len(top)]
        maker = self._pipe.prefetcher
        if isinstance(maker, WorkerPool) and maker.pinned:
            # Straight from the workers' page-locked slot; the pool reuses the slot once the copy is done.
            for dst, host in zip(top, hosts):
                maker.reading(self.ops.upload_pinned(dst, host))
        else:
            for dst, host in zip(top, hosts):
                self.ops.upload_async(dst, host)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass

    def _take(self, data_dtype) -> Batch:
        pipe = self._pipe
        seeds = Seeds.for_layer(self.ctx.seed, self.phase, self.layer_index)
        # Caffe skips a random number of records in [0, rand_skip) so parallel solvers see different data.
        skip = int(seeds.rng(SKIP).integers(self.rand_skip)) if self.rand_skip else 0
        plan = BatchPlan(self.batch_size, self.item_shape, seeds, skip, self.ctx.rank, self.ctx.ranks,
                         np.dtype(data_dtype))
        if pipe.plan != plan:  # the run's seed was set (or changed on resume) after the makers started
            self._last = None  # it views the makers' memory
            pipe.stop()
        if pipe.prefetcher is None:
            pipe.plan = plan
            workers = self.workers
            if workers > 1:
                try:
                    pool = WorkerPool(pipe.source, self.transformer, plan, self.next_batch, workers,
                                      self.prefetch_depth, self.where, pin=self.ops.pin_host)
                except WorkersUnavailable as e:
                    print(f"warning: {e}", file=sys.stderr, flush=True)
                    self.shared_memory_short = True
                else:
                    pipe.prefetcher = pool
                    if pool.pin_failure:
                        print(f"warning: {self.where}: cannot page-lock the decode workers' slots "
                              f"({pool.pin_failure}); each batch is staged through a host copy instead",
                              file=sys.stderr, flush=True)
            if pipe.prefetcher is None:
                items = batches(pipe.source, self.transformer, plan, self.next_batch)
                pipe.prefetcher = Prefetcher(items, self.prefetch_depth, name=f"prefetch:{self.name}")
        batch = pipe.prefetcher.next()
        assert batch.index == self.next_batch, (batch.index, self.next_batch)
        self.next_batch += 1
        return batch

    @property
    def batch_maker(self) -> Prefetcher[Batch] | WorkerPool | None:
        """What makes the batches now (started by the first forward), for monitoring and tests."""
        return self._pipe.prefetcher

    # ---- position, for snapshots (BatchPosition) --------------------------------------------
    def position_changed(self) -> None:
        self._last = None  # before the makers stop: it views their memory
        self._pipe.stop()

    def close(self) -> None:
        """Stop the batch makers and close the source (also done when the layer is collected)."""
        self._last = None  # it views the makers' memory, which closing unmaps
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()


@register("Data")
class Data(PrefetchingDataLayer):
    def open_source(self):
        p = self.param.data_param
        if not p.source:
            raise self.fail("data_param.source is required (an LMDB or LevelDB folder)")
        self.batch_size = int(p.batch_size)
        self.rand_skip = int(p.rand_skip)
        self.prefetch_depth = max(1, int(p.prefetch))
        self.workers_param = p
        tp = self.param.transform_param
        force_color = tp.force_color or p.force_encoded_color
        # Caffe's default backend is LEVELDB, yet most prototxts that leave it out meant LMDB: unset reads
        # whichever store the folder holds.
        backend = ({pb.DataParameter.LMDB: LMDB, pb.DataParameter.LEVELDB: LEVELDB}[p.backend]
                   if p.HasField("backend") else None)
        return DatumRecords(p.source, backend, self.where, force_color, tp.force_gray), p
