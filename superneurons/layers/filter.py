"""Filter (Caffe's layer): bottoms are K blobs of N items and a last "selector" blob of N values (shape N, or N
followed by axes of 1); the K tops hold, in order, only the items whose selector value is nonzero. Backward puts
each top gradient row back at its item's position and zeros the items left out; the selector gets no gradient.

Caffe reshapes the tops to the selected count at every forward. Here memory is planned from shapes fixed when
the net is built, so each top is planned at the full N (the most a batch can select, as Caffe's first reshape
sizes it) and forward writes the selected items at its front. `self.selected` says how many this batch kept;
the Net hands the layers after the Filter those first rows only, each layer set up for that count
(graph/live_batch.py says which layers may follow a Filter and runtime/live_batch.py runs them).
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import Layer, count, register


@register("Filter")
class Filter(Layer):
    n_bottoms = (2, None)
    n_tops = (1, None)
    # Tells graph/live_batch.py that the tops' batch is the count `selected`, set at each forward.
    selects_items = True

    def __init__(self, param, phase):
        super().__init__(param, phase)
        self.label_bottoms = (len(param.bottom) - 1,)  # the selector, whatever K is
        self.selected: int | None = None  # items the last forward kept; None before the first

    def setup(self, bottom_shapes):
        *data, selector = bottom_shapes
        if len(self.param.top) != len(data):
            raise self.fail(f"needs one top per filtered bottom: {len(data)} bottom(s) before the selector "
                            f"{self.param.bottom[-1]!r}, got {len(self.param.top)} top(s)")
        if not selector or any(int(d) != 1 for d in selector[1:]):
            raise self.fail(f"the selector (last bottom {self.param.bottom[-1]!r}) must have shape N or N x 1 "
                            f"x ..., got ({' '.join(str(d) for d in selector) or 'a scalar'})")
        rows = int(selector[0])
        for j, (blob, shape) in enumerate(zip(self.param.bottom, data)):
            if not shape or int(shape[0]) != rows:
                raise self.fail(f"bottom {j} {blob!r} must have the selector's {rows} items along axis 0, got "
                                f"({' '.join(str(d) for d in shape) or 'a scalar'})")
            if blob in self.param.top:
                raise self.fail(f"cannot work in place on {blob!r} (its tops hold fewer items than its bottoms)")
        self.inner = [count(s, 1) for s in data]
        self.capacity = rows
        self.positions = self.add_buffer("positions", (rows,))  # the kept items' positions, as floats
        return [tuple(s) for s in data]

    def backward_needs(self):
        return frozenset()  # the positions buffer says where each row's gradient goes

    def scratch_entries(self):
        return need.total()  # the gather's count of bad positions

    def forward(self, bottom, top):
        ops = self.ops
        rows = bottom[-1].shape[0]  # fewer than `capacity` when the bottoms come from another Filter
        positions = self.positions.array[:rows]
        n = self.selected = ops.select_nonzero(bottom[-1], positions)
        picked = positions[:n]
        for x, y, inner in zip(bottom, top, self.inner):
            ops.embed_forward(picked, ops.reshape(x, (rows, inner)), None,
                              ops.reshape(y, (self.capacity, inner))[:n], scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        n = self.selected
        picked = self.positions.array[:n]
        for j, (dy, dx, inner) in enumerate(zip(top_diff, bottom_diff, self.inner)):
            if not propagate_down[j] or dx is None:
                continue
            ops.fill(dx, 0.0)
            ops.embed_backward(picked, ops.reshape(dy, (self.capacity, inner))[:n],
                               ops.reshape(dx, (dx.shape[0], inner)), None, scratch=self.ctx.scratch)
