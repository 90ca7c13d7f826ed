"""Blobs whose batch is the count a Filter layer selects at each forward (its "live" batch), and the layers that
compute on them.

Memory is planned from the shapes the net is built with: a Filter's tops at the full N items its bottoms hold.
Caffe instead reshapes the tops to the selected count S, and every layer after them to S items (Reshape at each
forward). The Net does the same without moving memory: it hands such a layer the first S rows of each live blob
(a view: the items sit at the front) and runs a copy of the layer set up for S items (`batch_variant`), which
reads the original's parameters and the front of its buffers. So a loss normalizes by S, an InnerProduct
multiplies S rows, and an Accuracy counts S items, exactly as in Caffe.

That holds for a layer whose setup, given S items instead of N along axis 0 of its live bottoms, keeps its
parameter shapes, asks for no larger buffers, and gives each top either its shape at N (a loss, a fixed blob)
or that shape with S along axis 0 (a live top). `find_live_batches` checks this for every layer after a Filter
when the graph is built, by setting a copy up for other counts, and refuses, naming the layer, one that fails.
graph/fuse.py leaves these layers unfused: a fused step's layer is set up for the full batch.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from superneurons.errors import UserError
from superneurons.layers.base import BufferDecl, Layer, Shape, count

if TYPE_CHECKING:
    from superneurons.graph.node import Node


@dataclass
class LiveBatches:
    """What graph.build found: for each live blob, the Filter whose count is its batch, and the layers that
    run on live blobs (the Filters reading another Filter's tops among them)."""

    blob_filter: dict[str, str] = field(default_factory=dict)
    node_filter: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)  # Filter -> N, its tops' planned batch


def find_live_batches(nodes: list["Node"], shapes: dict[str, Shape], where: str) -> LiveBatches | None:
    """The live blobs and the layers on them, for `nodes` in route order (set up); None without a Filter.
    A layer that cannot run on a live batch is a UserError naming it."""
    if not any(getattr(n.layer, "selects_items", False) for n in nodes):
        return None
    live = LiveBatches()
    for node in nodes:
        layer = node.layer
        filters = sorted({live.blob_filter[b] for b in node.bottoms if b in live.blob_filter})
        if len(filters) > 1:
            raise _refuse(where, layer, f"reads the items kept by Filter layers {filters[0]!r} and {filters[1]!r}, "
                                        f"whose counts differ from batch to batch")
        if getattr(layer, "selects_items", False):
            if filters and len({live.blob_filter.get(b) for b in node.bottoms}) > 1:
                raise _refuse(where, layer, f"reads both items kept by Filter {filters[0]!r} and blobs of the full "
                                            f"batch; its bottoms must hold the same items")
            if filters:
                live.node_filter[node.name] = filters[0]
            # A layer that selects items says how many its tops hold at most (layers/filter.py).
            live.capacity[node.name] = getattr(layer, "capacity")
            for t in node.tops:
                live.blob_filter[t] = node.name
            continue
        if not filters:
            continue
        source = filters[0]
        live.node_filter[node.name] = source
        for t in _live_tops(node, shapes, live, source, where):
            live.blob_filter[t] = source
    return live


def _live_tops(node: "Node", shapes: dict[str, Shape], live: LiveBatches, source: str, where: str) -> list[str]:
    """The tops of `node` whose batch follows its live bottoms, after checking it may run on them."""
    layer = node.layer
    what = f"reads blob(s) {', '.join(repr(b) for b in node.bottoms if b in live.blob_filter)} whose batch is the " \
           f"count Filter {source!r} keeps"
    if not getattr(layer, "setup_repeatable", True):  # its setup does more than declare shapes (Python)
        raise _refuse(where, layer, f"{what}; a {layer.type_name} layer cannot be set up again for each count")
    full = live.capacity[source]
    probes = sorted({1, full - 1, full + 1} - {0, full})
    kinds: list[set[str]] = [set() for _ in node.tops]
    for n in probes:
        bottoms = [(n,) + tuple(shapes[b][1:]) if b in live.blob_filter else tuple(shapes[b]) for b in node.bottoms]
        try:
            tops = batch_variant(layer, bottoms, check_buffers=False).top_shapes
        except UserError as e:
            raise _refuse(where, layer, f"{what}, and it cannot be set up for {n} item(s): {_reason(e, layer)}") \
                from None
        for k, (planned, got) in enumerate(zip(node.top_shapes, tops)):
            if tuple(got) == tuple(planned):
                kinds[k].add("fixed")
            elif planned and int(planned[0]) == full and tuple(got) == (n,) + tuple(planned[1:]):
                kinds[k].add("live")
            else:
                kinds[k].add("other")
    out = []
    for t, planned, kind in zip(node.tops, node.top_shapes, kinds):
        if kind != {"fixed"} and kind != {"live"}:
            raise _refuse(where, layer, f"{what}, and its top {t!r} ({' '.join(str(d) for d in planned)}) changes "
                                        f"shape with that count other than along axis 0")
        if kind == {"live"}:
            out.append(t)
    return out


_MISSING = object()


class Variant:
    """A layer set up for another batch: its `top_shapes`, and `state`, the attributes its setup gave it that
    differ from the original's (dimensions, its buffer declarations), which `swapped_in` puts on the original
    for one call. The original object runs, so whatever wraps its methods (the profiler's timers) still does."""

    def __init__(self, top_shapes: list[Shape], state: dict, buffers: dict[str, BufferDecl]):
        self.top_shapes = top_shapes
        self.state = state
        self.buffers = buffers  # name -> the original's BufferDecl, whose front this batch's buffer is
        self._fronts: dict[str, Any] = {}  # name -> the original's array this batch's view was cut from

    def refresh(self, ops) -> None:
        """Point this batch's buffers at the front of the original's current arrays (they move with the memory
        manager's decisions, as the original's do)."""
        mine = self.state.get("buffers", {})
        for name, original in self.buffers.items():
            decl = mine[name]
            if original.array is None:
                decl.array = None
            elif self._fronts.get(name) is not original.array or decl.array is None:
                flat = ops.reshape(original.array, (count(original.shape),))
                decl.array = ops.reshape(flat[:count(decl.shape)], decl.shape)
            self._fronts[name] = original.array

    @contextmanager
    def swapped_in(self, layer: Layer):
        """`layer` with this batch's attributes for the duration; what the call changes in them stays with
        this batch, and the original's come back."""
        d = layer.__dict__
        saved = {k: d.get(k, _MISSING) for k in self.state}
        d.update(self.state)
        try:
            yield layer
        finally:
            for k, old in saved.items():
                self.state[k] = d.get(k)
                if old is _MISSING:
                    d.pop(k, None)
                else:
                    d[k] = old


def batch_variant(layer: Layer, bottom_shapes: list[Shape], check_buffers: bool = True) -> Variant:
    """`layer` set up again, on a shallow copy, for `bottom_shapes`: sharing the original's parameters (the same
    ParamDecl objects, so the solver, the memory manager and weight sharing see one set) and taking the front
    of its buffers. A parameter shape that changes, or (with `check_buffers`) a buffer larger than the
    original's, is a UserError."""
    v = copy.copy(layer)
    v.params = []
    v.buffers = {}
    originals = layer.params

    def add_param(shape, filler, learnable=True):
        k = len(v.params)
        if k >= len(originals) or tuple(int(d) for d in shape) != originals[k].shape:
            have = originals[k].shape if k < len(originals) else "none"
            raise layer.fail(f"its parameter {k} would change shape with the batch ({tuple(shape)} against "
                             f"{have})")
        v.params.append(originals[k])
        return originals[k]

    def add_buffer(name, shape, dtype=np.float32, for_backward=True, in_forward=True):
        original = layer.buffers.get(name)
        decl = BufferDecl(tuple(int(d) for d in shape), dtype, for_backward=for_backward, in_forward=in_forward)
        if original is None or (check_buffers and count(decl.shape) > count(original.shape)):
            raise layer.fail(f"its buffer {name!r} would need {count(decl.shape)} values for this batch, more "
                             f"than the {count(original.shape) if original is not None else 0} planned")
        v.buffers[name] = decl
        return decl

    # The copy's own setup declares through these; instance attributes, deleted after it, shadow the methods.
    v.add_param = add_param  # type: ignore[method-assign]
    v.add_buffer = add_buffer  # type: ignore[method-assign]
    try:
        tops = v.setup([tuple(int(d) for d in s) for s in bottom_shapes])
    finally:
        del v.add_param, v.add_buffer
    if v.params == originals:
        v.params = originals
    skip = {"forward", "backward"}  # wrappers set on the original (the profiler's) stay the original's
    state = {k: val for k, val in v.__dict__.items()
             if k not in skip and layer.__dict__.get(k, _MISSING) is not val}
    return Variant([tuple(int(d) for d in s) for s in tops], state,
                   {name: layer.buffers[name] for name in v.buffers})


def _reason(e: UserError, layer: Layer) -> str:
    msg = str(e)
    prefix = f"layer {layer.name!r} ({layer.type_name}): "
    return msg[msg.index(prefix) + len(prefix):] if prefix in msg else msg


def _refuse(where: str, layer: Layer, msg: str) -> UserError:
    return UserError(f"{where}: layer {layer.name!r} ({layer.type_name}) {msg}")
