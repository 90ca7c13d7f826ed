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

Half reduction (`SUPERNEURONS_DP_REDUCE=backward`, `train --reduce-type backward`): where the net stores its
gradients in a half type (float16 or bfloat16) over float32 masters, each bucket is reduced in that type, half
the bytes on the wire. Its float32 run is scaled by 1/N and rounded into the bucket's run of the net's
`#reduce` buffer (declared by memory/tensors.py, held by the plan for the whole run: half the learnable
gradients' pool bytes), summed across the ranks in the half type, and widened back into the float32
gradients before the update. 1/N comes first: the half sum of N values g_i / N is at most the largest |g_i|,
so float16 overflows only where some rank's own gradient is beyond its range (65504), which float16 storage
could not have held either; summing first and scaling after would overflow wherever N gradients add up past
65504, e.g. 8 ranks' gradients of 10000 each. The price is N's factor
taken from the bottom of the range, where float16's subnormals lose bits (with N a power of 2 the scale itself
is exact). Loss scaling is untouched: the gradients reduced are the scaled ones (`scale` x g), and the
solver's overflow check and 1/scale come after `finish`, so an Inf the half reduction makes skips the
iteration on every rank alike and lowers the adaptive scale, as an overflow in backward does.

Waiting on communication. `finish` records compute events before and after the waits: the time between is
what compute stood still for the reductions (device time on the GPU, host time on the CPU), per iteration
in `wait_ms`, read one iteration late so the host never blocks for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from superneurons import settings
from superneurons.dtypes import FLOAT32, dtype_name, is_half
from superneurons.errors import UserError
from superneurons.memory.interface import StepHooks
from superneurons.memory.pool import round_up
from superneurons.memory.tensors import TensorLayout, declare_tensors

BUCKET_ENV = "SUPERNEURONS_DP_BUCKET_MB"
REDUCE_ENV = "SUPERNEURONS_DP_REDUCE"
REDUCE_CHOICES = ("fp32", "backward")


def bucket_bytes_setting() -> int:
    """Bytes of gradients per bucket (SUPERNEURONS_DP_BUCKET_MB; 0: one bucket per gradient)."""
    return int(settings.get(BUCKET_ENV)) << 20


def backward_half_type(precision: Any) -> np.dtype | None:
    """The half type most of the net's gradients are stored in (`graph/precision.py`), None when none is half
    (ties: the name first in order, so every rank picks the same)."""
    kinds = [np.dtype(d) for d in precision.diff.values() if is_half(d)]
    if not kinds:
        return None
    return max(sorted(set(kinds), key=dtype_name), key=kinds.count)


def reduce_type(choice: str | None, precision: Any) -> np.dtype | None:
    """The type a data-parallel net reduces its gradients in, when not their own: `choice` "backward" (None:
    SUPERNEURONS_DP_REDUCE) and float32 masters over gradients stored in a half type give that type; else None
    (the float32 reduction, in place)."""
    choice = settings.get(REDUCE_ENV) if choice is None else str(choice).strip().lower()
    if choice not in REDUCE_CHOICES:
        raise UserError(f"--reduce-type {choice!r}: expected one of {', '.join(REDUCE_CHOICES)}")
    if choice != "backward" or np.dtype(precision.master) != FLOAT32:
        return None
    return backward_half_type(precision)


class Collective(Protocol):
    """What the reducer needs from NCCL or MPI."""

    size: int

    def start(self, arrays: list[Any], average: bool = True) -> Any:
        """Begin replacing each array by its mean over the ranks (sum / size), in place, or by the sum
        (`average` False: half arrays); a handle."""

    def wait(self, handle: Any) -> None:
        """Work that follows (the update) sees the finished means."""


@dataclass
class Bucket:
    decls: list[Any]  # the learnable ParamDecls whose gradients it reduces, in pool order
    nbytes: int  # their gradients' bytes (padding not counted)
    pending: int = 0  # gradients not yet final in this backward pass
    flat: Any = field(default=None, repr=False)  # one array over the bucket's pool run (None: per tensor)
    handle: Any = field(default=None, repr=False)
    half: list[Any] | None = field(default=None, repr=False)  # per array of `arrays()`, its run of `#reduce`

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
        # Half reduction: the net's `#reduce` buffer (its Tensor; None: reduce in the gradients' own type).
        self.half_tensor = getattr(net, "reduce_tensor", None)
        self.half_type = np.dtype(self.half_tensor.dtype) if self.half_tensor is not None else None
        self._half_base: Any = None  # the buffer array the half views were cut from
        self._streamed_half: list[Any] = []  # streamed parameters: per learnable gradient, its run of #reduce
        # Flat buckets: views built now (the pool holds the gradients once the Net exists) and again
        # whenever the pool moves a gradient (`_views_current`).
        self.flat = not self.streamed and hasattr(net.pool, "watch")
        self._views_at: int | None = None
        if self.flat:
            self.flat = self._build_views()
        if self.flat and self.half_type is not None:
            # The padding of the gradients' pool blocks is in the flat views and gets rounded into half: zeros,
            # not whatever the arena held (an Inf or NaN there would be harmless, but warns on the CPU). Before
            # the first backward, so no gradient is lost; the padding moves with its block.
            for b in self.buckets:
                self.net.ops.fill(b.flat, 0.0)
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
        self._half_base = None  # the half views follow the arrays reduced

    def sum_in_half(self, on: bool) -> None:
        """Whether the buckets are summed in the half type of the net's `#reduce` buffer (the default when it
        has one) or in float32, in place; the benchmarks alternate the two in one process (same net, same
        convolution engines, same pool). Every rank must choose alike."""
        if on and self.half_tensor is None:
            raise ValueError("this net has no half reduction buffer (built without reduce_type)")
        self.half_type = np.dtype(self.half_tensor.dtype) if on else None

    @property
    def reduce_type_name(self) -> str:
        """What the start line and the benchmarks call the type the ranks sum in."""
        if self.half_type is not None:
            return dtype_name(self.half_type)
        types = {np.dtype(d.diff_tensor.dtype) for d in self.net.learnable}
        return dtype_name(types.pop()) if len(types) == 1 else "the gradients' own types"

    def wire_bytes(self) -> int:
        """Bytes each rank hands the collective per iteration: the buckets' arrays (padding included), in the
        type they are summed in (half of float32's under the half reduction)."""
        if self.streamed:
            arrays: list[Any] = [d.diff_tensor for d in self.net.learnable]
        else:
            arrays = [a for b in self.buckets for a in b.arrays()]
        size = np.dtype(self.half_type).itemsize if self.half_type is not None else None
        return sum(int(np.prod(a.shape, dtype=np.int64)) * (size or np.dtype(a.dtype).itemsize) for a in arrays)

    def _half_views(self, arrays: list[Any]) -> list[Any]:
        """Consecutive runs of the `#reduce` buffer shaped as `arrays` (arrays or Tensors), each starting where
        the previous one's pool-block-rounded size ends (tensors.reduce_entries sized the buffer so)."""
        base, reshape = self.half_tensor.array, self.net.ops.reshape
        views, at = [], 0
        for a in arrays:
            shape, itemsize = tuple(int(d) for d in a.shape), np.dtype(a.dtype).itemsize
            n = int(np.prod(shape, dtype=np.int64))
            views.append(reshape(base[at:at + n], shape))
            at += round_up(n * itemsize) // itemsize
        if at > base.size:
            raise RuntimeError(f"the half reduction buffer holds {base.size} elements, the gradients need {at}")
        return views

    def _halves_current(self) -> None:
        """Every bucket's half views, cut again when the pool moved the buffer (or the arrays reduced changed)."""
        if self.half_tensor.array is self._half_base:
            return
        if self.streamed:
            self._streamed_half = self._half_views([d.diff_tensor for d in self.net.learnable])
        else:
            views = iter(self._half_views([a for b in self.buckets for a in b.arrays()]))
            for b in self.buckets:
                b.half = [next(views) for _ in b.arrays()]
        self._half_base = self.half_tensor.array

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
        if self.half_type is None:
            bucket.handle = self.collective.start(arrays)
        else:
            self._halves_current()
            assert bucket.half is not None
            bucket.handle = self._start_half(arrays, bucket.half)
        self._calls += len(arrays)

    def _start_half(self, arrays: list[Any], halves: list[Any]) -> Any:
        """Round g / N of every float32 array into its half view (on compute, after the kernels that wrote the
        gradients), and start the sum of the half views."""
        scale = 1.0 / self.collective.size
        for src, dst in zip(arrays, halves):
            self.net.ops.scaled_copy(scale, src, dst)
        return self.collective.start(halves, average=False)

    def _wait(self, bucket: Bucket) -> None:
        self.collective.wait(bucket.handle)
        if self.half_type is not None:
            assert bucket.half is not None
            for dst, src in zip(bucket.arrays(), bucket.half):
                self.net.ops.copy(src, dst)  # widened back: the float32 gradient is the half sum's value

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
                self._wait(bucket)
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
        if self.half_type is not None:
            self._halves_current()
        for i, decl in enumerate(self.net.learnable):
            store.acquire([decl.diff_tensor])
            if self.half_type is None:
                self.collective.wait(self.collective.start([decl.diff]))
            else:
                half = self._streamed_half[i]
                self.collective.wait(self._start_half([decl.diff], [half]))
                self.net.ops.copy(half, decl.diff)
            self._calls += 1
            store.release([decl.diff_tensor], changed=[decl.diff_tensor])
        store.settle()


def bucket_plan(graph: Any, ranks: int, bucket_bytes: int | None = None, half: Any = None) -> dict[str, Any]:
    """What the reduction holds on each GPU, from the graph alone (no memory allocated), for
    `superneurons memory --ranks N`: the buckets a training Net of this graph would reduce. `half`: the type
    they are reduced in when not their own (`reduce_type`), whose buffer the pool then holds."""
    size = bucket_bytes_setting() if bucket_bytes is None else bucket_bytes
    layout = declare_tensors(graph, train=True, reduce_type=half)
    slots = layout.learnable()
    cuts = bucket_cuts(layout, size)
    nbytes = [sum(layout.by_key[slots[i].diff].nbytes for i in cut) for cut in cuts]
    return {
        "ranks": ranks,
        "buckets": len(cuts),
        "bucket_bytes": nbytes,
        "gradient_bytes": sum(nbytes),
        # in place: a bucket is its gradients' own pool blocks; in a half type: the `#reduce` buffer besides
        "extra_pool_bytes": round_up(layout.by_key[layout.reduce].nbytes) if layout.reduce is not None else 0,
        "reduce_type": dtype_name(half) if layout.reduce is not None else dtype_name(graph.precision.master),
    }
