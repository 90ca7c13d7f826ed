"""Softmax over one axis (softmax_param.axis, default 1), and the (outer, channels, inner) split it and the
loss/accuracy layers use to hand a blob of any rank to the backend."""
from __future__ import annotations

from superneurons.layers.base import NEEDS_TOP, Layer, Shape, canonical_axis, count, register


def axis_split(shape: Shape, axis: int) -> tuple[int, int, int]:
    """(product of the axes before `axis`, size of `axis`, product of the axes after it)."""
    return count(shape, 0, axis), int(shape[axis]), count(shape, axis + 1)


@register("Softmax")
class Softmax(Layer):
    float32_only = True

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        self.dims = axis_split(shape, canonical_axis(self.param.softmax_param.axis, len(shape), self))
        return [shape]

    def backward_needs(self):
        return frozenset({NEEDS_TOP})  # dx = y * (dy - <dy, y>): the output suffices, so in place works

    def forward(self, bottom, top):
        ops = self.ops
        ops.softmax_forward(ops.reshape(bottom[0], self.dims), ops.reshape(top[0], self.dims))

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            ops = self.ops
            ops.softmax_backward(ops.reshape(top[0], self.dims), ops.reshape(top_diff[0], self.dims),
                                 ops.reshape(bottom_diff[0], self.dims))
