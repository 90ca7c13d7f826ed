"""Summing the gradients of every rank, scaled by 1/N, before the update (Caffe's NCCL/P2PSync semantics).

The learnable parameters are grouped into buckets in the order backward finishes their gradients: a
parameter's gradient is final after the last backward step that writes it (its own layer's, or the layer
graph/fuse.py folded it into; a shared weight after its last user). With `layer_wise_reduce: true`
(Caffe's default) the reducer is one of the Net's step hooks (`Net.add_hooks`), and a bucket whose
last gradient step i finished starts its reduction then, on the collective's own stream (NCCL) or as a
non-blocking MPI call, while backward goes on; `finish`, called before the update, waits for them. With
`layer_wise_reduce: false`, or when the parameters are streamed from the host (a gradient is on the device
only during its own layer's step), everything is reduced in `finish`, after backward.

With `iter_size` k, gradients accumulate over k passes: only the last pass's backward starts reductions
(`ctx.iteration % k == k - 1`, the solver's pass numbering).

The reduction is in place: each gradient is summed in its own pool block, so the buckets hold no memory
beyond the gradients the plan already counts (`bucket_plan` says what `superneurons memory --ranks N`
prints).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from superneurons.memory.interface import StepHooks
from superneurons.memory.params import layers_computed_by, param_root

# Gradients per bucket: big enough that a bucket is a few large transfers, small enough that the first
# buckets start while most of backward is still to run (PyTorch DDP uses 25 MiB).
BUCKET_BYTES = 16 << 20


class Collective(Protocol):
    """What the reducer needs from NCCL or MPI."""

    size: int

    def start(self, arrays: list[Any]) -> Any:
        """Begin replacing each array by its mean over the ranks (sum / size), in place; a handle."""

    def wait(self, handle: Any) -> None:
        """Work that follows (the update) sees the finished means."""


@dataclass
class Bucket:
    decls: list[Any]  # the learnable ParamDecls whose gradients it reduces
    ready_after: int | None  # backward step index after which all are final (None: only at finish)
    nbytes: int = 0
    handle: Any = field(default=None, repr=False)


def gradient_steps(net: Any) -> dict[int, int]:
    """id(learnable decl) -> index of the last backward step that writes its gradient."""
    learnable = {id(d) for d in net.learnable}
    computed_by = layers_computed_by(net.graph.nodes)
    node_index = {id(n): i for i, n in enumerate(net.graph.nodes)}
    last: dict[int, int] = {}
    for i, step in enumerate(net.backward_steps):
        for layer in computed_by[node_index[id(step.node)]]:
            for decl in layer.params:
                root = param_root(decl)
                if id(root) in learnable:
                    last[id(root)] = i
    return last


def make_buckets(net: Any, bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """The learnable parameters in the order their gradients become final, cut into buckets of about
    `bucket_bytes`; parameters no backward step writes come last, reduced at finish."""
    steps = gradient_steps(net)
    never = len(net.backward_steps)
    items = [(d, d.diff_tensor.nbytes, steps.get(id(d), never)) for d in net.learnable]
    return [Bucket(decls, None if last == never else last, nbytes)
            for decls, nbytes, last in cut(items, bucket_bytes)]


def cut(items: list[tuple[Any, int, int]], bucket_bytes: int) -> list[tuple[list[Any], int, int]]:
    """(thing, bytes, step it is final after) in the order they become final (stable), cut into buckets of
    about `bucket_bytes`: (things, bytes, the step after which all are final)."""
    out: list[tuple[list[Any], int, int]] = []
    current: list[tuple[Any, int, int]] = []
    size = 0
    for item in sorted(items, key=lambda it: it[2]):
        current.append(item)
        size += item[1]
        if size >= bucket_bytes:
            out.append(([it[0] for it in current], size, max(it[2] for it in current)))
            current, size = [], 0
    if current:
        out.append(([it[0] for it in current], size, max(it[2] for it in current)))
    return out


class GradientReducer(StepHooks):
    """Attach to a training net: `attach()` installs the backward hook (layer-wise mode); the solver calls
    `finish()` before each update."""

    def __init__(self, net: Any, collective: Collective, iter_size: int = 1, layer_wise: bool = True,
                 bucket_bytes: int = BUCKET_BYTES):
        self.net = net
        self.collective = collective
        self.iter_size = max(1, int(iter_size))
        self.streamed = bool(net.params.offloaded)
        self.layer_wise = layer_wise and not self.streamed
        self.buckets = make_buckets(net, bucket_bytes)
        self._by_step: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            if b.ready_after is not None:
                self._by_step.setdefault(b.ready_after, []).append(b)
        self.started_during_backward = 0  # buckets whose reduction began before backward ended (tests)

    def attach(self) -> None:
        if self.layer_wise:
            self.net.add_hooks(self)

    def detach(self) -> None:
        if self.layer_wise:
            self.net.remove_hooks(self)

    def after_backward(self, i: int, step: Any) -> None:
        if self.net.ctx.iteration % self.iter_size != self.iter_size - 1:
            return  # gradients still accumulate over this iteration's passes
        for bucket in self._by_step.get(i, ()):
            bucket.handle = self.collective.start([d.diff for d in bucket.decls])
            self.started_during_backward += 1

    def finish(self) -> None:
        """Every gradient is the mean over the ranks; called after the iteration's last backward."""
        if self.streamed:
            self._finish_streamed()
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                bucket.handle = self.collective.start([d.diff for d in bucket.decls])
        for bucket in self.buckets:
            self.collective.wait(bucket.handle)
            bucket.handle = None

    def _finish_streamed(self) -> None:
        """Streamed parameters: each gradient comes to the device, is reduced, and goes home, one at a time
        (the update then streams them again, as without data parallelism)."""
        store = self.net.params
        for decl in self.net.learnable:
            store.acquire([decl.diff_tensor])
            self.collective.wait(self.collective.start([decl.diff]))
            store.release([decl.diff_tensor], changed=[decl.diff_tensor])
        store.settle()


def bucket_plan(graph: Any, ranks: int, bucket_bytes: int = BUCKET_BYTES) -> dict[str, Any]:
    """What the reduction holds on each GPU, from the graph alone (no memory allocated), for
    `superneurons memory --ranks N`: the buckets a training Net of this graph would reduce."""
    nodes = graph.nodes
    computed_by = layers_computed_by(nodes)
    index = {id(n): i for i, n in enumerate(nodes)}
    backward = [n for n in reversed(nodes) if n.need_backward]
    final: dict[Any, tuple[int, int]] = {}  # a parameter (a shared one by its name) -> (bytes, last step)
    for step, node in enumerate(backward):
        for layer in computed_by[index[id(node)]]:
            specs = layer.param.param
            for k, decl in enumerate(layer.params):
                if not decl.learnable:
                    continue
                name = specs[k].name if k < len(specs) and specs[k].name else None
                key = ("shared", name) if name else (id(layer), k)
                n = 4
                for d in decl.shape:
                    n *= d
                final[key] = (n, step)
    buckets = cut([(key, n, step) for key, (n, step) in final.items()], bucket_bytes)
    return {
        "ranks": ranks,
        "buckets": len(buckets),
        "bucket_bytes": [n for _keys, n, _step in buckets],
        "gradient_bytes": sum(n for _keys, n, _step in buckets),
        "extra_pool_bytes": 0,  # in place: each gradient is reduced in its own pool block
    }
