"""Summing the gradients of every rank, scaled by 1/N, before the update (Caffe's NCCL/P2PSync semantics).

Buckets. memory/tensors.py declares the learnable parameters' gradients side by side, in the order backward
finishes them, and the memory managers place them in that order, so a run of them is one run of pool memory.
The reducer cuts that run into buckets of about `bucket_bytes` (SUPERNEURONS_DP_BUCKET_MB; `bucket_cuts`,
also what `superneurons memory --ranks N` prints) and reduces each bucket as ONE array: a view over its pool
blocks, padding included (pool blocks are 1 KiB multiples; the padding belongs to the bucket's own blocks
and nothing reads it). So a bucket is one NCCL call, not one per tensor, and needs no copy and no memory
beyond the gradients the plan already counts. Every rank builds the same layout and the same pool, so the
views, and the calls, are the same on every rank; `RankSolver` checks that, and where a rank's gradients
are not adjacent (the malloc allocator) every rank reduces per tensor instead, still one bucket at a time.
When the pool moves a gradient (compaction), the views are rebuilt; blocks slide in address order, so a
bucket stays one run.

When. The reducer is one of the Net's step hooks (`Net.add_hooks`): `gradients_ready` tells it, after each
backward step, which learnable parameters' gradients are final; a bucket whose last gradient is final
starts its reduction then, on the collective's own stream (NCCL) or as a non-blocking MPI call, while
backward goes on (`layer_wise_reduce: true`, Caffe's default). `finish`, called before the update, starts
what has not started and makes compute wait for every bucket. With `layer_wise_reduce: false`, or when the
parameters are streamed from the host (a gradient is on the device only during its own layer's step),
everything is reduced in `finish`, after backward. With `iter_size` k only the last pass of the k
(`ctx.iteration % k == k - 1`, the solver's pass numbering) starts reductions.

Waiting on communication. `finish` records compute events before and after the waits: the time between is
what compute stood still for the reductions (device time on the GPU, host time on the CPU), per iteration
in `wait_ms`, read one iteration late so the host never blocks for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from superneurons import settings
from superneurons.memory.interface import StepHooks
from superneurons.memory.pool import round_up
from superneurons.memory.tensors import TensorLayout, declare_tensors

BUCKET_ENV = "SUPERNEURONS_DP_BUCKET_MB"


def bucket_bytes_setting() -> int:
    """Bytes of gradients per bucket (SUPERNEURONS_DP_BUCKET_MB; 0: one bucket per gradient)."""
    return int(settings.get(BUCKET_ENV)) << 20


class Collective(Protocol):
    """What the reducer needs from NCCL or MPI."""

    size: int

    def start(self, arrays: list[Any]) -> Any:
        """Begin replacing each array by its mean over the ranks (sum / size), in place; a handle."""

    def wait(self, handle: Any) -> None:
        """Work that follows (the update) sees the finished means."""


@dataclass
class Bucket:
    decls: list[Any]  # the learnable ParamDecls whose gradients it reduces, in pool order
    nbytes: int  # their gradients' bytes (padding not counted)
    pending: int = 0  # gradients not yet final in this backward pass
    flat: Any = field(default=None, repr=False)  # one array over the bucket's pool run (None: per tensor)
    handle: Any = field(default=None, repr=False)

    def arrays(self) -> list[Any]:
        return [self.flat] if self.flat is not None else [d.diff for d in self.decls]


def bucket_cuts(layout: TensorLayout, bucket_bytes: int) -> list[list[int]]:
    """Indexes into `layout.learnable()` (the solver's list), bucket by bucket: the learnable gradients in
    the order they are declared (side by side, as backward finishes them), cut after the gradient that
    brings a bucket to `bucket_bytes` or more, and where the dtype changes (a bucket is one array)."""
    slots = layout.learnable()
    position = {s.key: i for i, s in enumerate(layout.specs)}
    order = sorted(range(len(slots)), key=lambda i: position[slots[i].diff])
    out: list[list[int]] = []
    current: list[int] = []
    size, dtype = 0, None
    for i in order:
        spec = layout.by_key[slots[i].diff]
        if current and spec.dtype != dtype:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += spec.nbytes
        dtype = spec.dtype
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def make_buckets(net: Any, bucket_bytes: int) -> list[Bucket]:
    """The buckets of training net `net` (see `bucket_cuts`)."""
    decls = net.learnable  # in layout.learnable() order
    return [Bucket([decls[i] for i in cut], sum(decls[i].diff_tensor.nbytes for i in cut))
            for cut in bucket_cuts(net.layout, bucket_bytes)]


def flat_views(net: Any, buckets: Sequence[Bucket]) -> list[Any] | None:
    """Per bucket, one array over its gradients' pool blocks, or None when some bucket's blocks are not one
    run (the malloc allocator; a gradient without a pool block)."""
    pool = net.pool
    if getattr(pool, "arena", None) is None or not hasattr(pool, "offset"):
        return None
    views = []
    for b in buckets:
        tensors = [d.diff_tensor for d in b.decls]
        if not all(pool.owns(t.key) for t in tensors):
            return None
        runs = sorted((pool.offset(t.key), round_up(t.nbytes)) for t in tensors)
        start = end = runs[0][0]
        for offset, size in runs:
            if offset != end:
                return None
            end += size
        dtype = tensors[0].dtype
        views.append(net.backend.view(pool.arena, start, ((end - start) // dtype.itemsize,), dtype))
    return views


class GradientReducer(StepHooks):
    """Attach to a training net: `attach()` installs the step hooks (layer-wise mode); the solver calls
    `finish()` before each update."""

    def __init__(self, net: Any, collective: Collective, iter_size: int = 1, layer_wise: bool = True,
                 bucket_bytes: int | None = None):
        self.net = net
        self.collective = collective
        self.iter_size = max(1, int(iter_size))
        self.streamed = bool(net.params.offloaded)
        self.layer_wise = layer_wise and not self.streamed
        self.bucket_bytes = bucket_bytes_setting() if bucket_bytes is None else int(bucket_bytes)
        self.buckets = make_buckets(net, self.bucket_bytes)
        self._bucket_of = {id(d): b for b in self.buckets for d in b.decls}
        for b in self.buckets:
            b.pending = len(b.decls)
        # Flat buckets: views built now (the pool holds the gradients once the Net exists) and again
        # whenever the pool moves a gradient (`_views_current`).
        self.flat = not self.streamed and hasattr(net.pool, "watch")
        self._views_at: int | None = None
        if self.flat:
            self.flat = self._build_views()
        self.started_during_backward = 0  # buckets whose reduction began before backward ended (tests)
        self.wait_ms: list[float] = []  # per iteration: how long compute waited for the reductions
        self.calls_per_iteration = 0  # reductions (collective calls) the last iteration made
        self._calls = 0
        self._timing: list[tuple[Any, Any]] = []  # (before, after) compute events not yet read

    # -- flat views ----------------------------------------------------------------------------
    def _build_views(self) -> bool:
        pool = self.net.pool
        views = flat_views(self.net, self.buckets)
        if views is None:
            return False
        for b, v in zip(self.buckets, views):
            b.flat = v
        self._views_at = pool.watch(d.diff_tensor.key for b in self.buckets for d in b.decls)
        return True

    def per_tensor(self) -> None:
        """Reduce every bucket tensor by tensor (every rank must, when one rank cannot reduce flat)."""
        self.flat = False
        for b in self.buckets:
            b.flat = None

    def _views_current(self) -> None:
        if self.flat and self.net.pool.watched_moves != self._views_at and not self._build_views():
            raise RuntimeError("the pool moved a gradient out of its bucket's run of memory; the ranks can no "
                               "longer reduce the same arrays (rerun with SUPERNEURONS_DP_BUCKET_MB=0)")

    # -- hooks ---------------------------------------------------------------------------------
    def attach(self) -> None:
        if self.layer_wise:
            self.net.add_hooks(self)

    def detach(self) -> None:
        if self.layer_wise:
            self.net.remove_hooks(self)

    def gradients_ready(self, step: Any, params: Sequence[Any]) -> None:
        if self.net.ctx.iteration % self.iter_size != self.iter_size - 1:
            return  # gradients still accumulate over this iteration's passes
        for decl in params:
            bucket = self._bucket_of.get(id(decl))
            if bucket is None:
                continue
            bucket.pending -= 1
            if bucket.pending == 0:
                self._start(bucket)
                self.started_during_backward += 1

    def _start(self, bucket: Bucket) -> None:
        self._views_current()
        arrays = bucket.arrays()
        bucket.handle = self.collective.start(arrays)
        self._calls += len(arrays)

    def finish(self) -> None:
        """Every gradient is the mean over the ranks; called after the iteration's last backward."""
        backend = self.net.backend
        self._read_timing()
        before = backend.compute_event()
        if self.streamed:
            self._finish_streamed()
        else:
            for bucket in self.buckets:
                if bucket.handle is None:
                    self._start(bucket)
            for bucket in self.buckets:
                self.collective.wait(bucket.handle)
                bucket.handle = None
                bucket.pending = len(bucket.decls)
        self.calls_per_iteration, self._calls = self._calls, 0
        self._timing.append((before, backend.compute_event()))

    def _read_timing(self) -> None:
        """The finished iterations' waits into `wait_ms` (never blocks)."""
        while self._timing and self._timing[0][1].query():
            before, after = self._timing.pop(0)
            self.wait_ms.append(after.elapsed_ms(before))

    def settle_timing(self) -> list[float]:
        """`wait_ms` with every iteration's figure in (blocks until the last one is known)."""
        for _before, after in self._timing:
            after.synchronize()
        self._read_timing()
        return self.wait_ms

    def _finish_streamed(self) -> None:
        """Streamed parameters: each gradient comes to the device, is reduced, and goes home, one at a time
        (the update then streams them again, as without data parallelism)."""
        store = self.net.params
        for decl in self.net.learnable:
            store.acquire([decl.diff_tensor])
            self.collective.wait(self.collective.start([decl.diff]))
            self._calls += 1
            store.release([decl.diff_tensor], changed=[decl.diff_tensor])
        store.settle()


def bucket_plan(graph: Any, ranks: int, bucket_bytes: int | None = None) -> dict[str, Any]:
    """What the reduction holds on each GPU, from the graph alone (no memory allocated), for
    `superneurons memory --ranks N`: the buckets a training Net of this graph would reduce."""
    size = bucket_bytes_setting() if bucket_bytes is None else bucket_bytes
    layout = declare_tensors(graph, train=True)
    slots = layout.learnable()
    cuts = bucket_cuts(layout, size)
    nbytes = [sum(layout.by_key[slots[i].diff].nbytes for i in cut) for cut in cuts]
    return {
        "ranks": ranks,
        "buckets": len(cuts),
        "bucket_bytes": nbytes,
        "gradient_bytes": sum(nbytes),
        "extra_pool_bytes": 0,  # in place: a bucket is its gradients' own pool blocks
    }
