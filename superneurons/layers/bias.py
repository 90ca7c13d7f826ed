"""Bias: y = x + b, b broadcast over the axes it does not cover.

b is a learned param of shape bottom.shape[axis:axis + num_axes] (filled by `filler`, zero by
default), or, with two bottoms, the second bottom itself (which then gets a gradient).
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import Layer, canonical_axis, count, register


@register("Bias")
class Bias(Layer):
    n_bottoms = (1, 2)

    def setup(self, bottom_shapes):
        p = self.param.bias_param
        shape = bottom_shapes[0]
        if len(bottom_shapes) == 2:
            bias_shape = tuple(bottom_shapes[1])
            # A scalar bias needs no axis (Caffe's rule), so any axis value is accepted then.
            axis = 0 if not bias_shape else canonical_axis(p.axis, len(shape), self)
            if tuple(shape[axis:axis + len(bias_shape)]) != bias_shape:
                raise self.fail(f"the bias bottom's shape {bias_shape} does not match the first bottom's "
                                f"shape {shape} from axis {axis} on")
        else:
            axis = canonical_axis(p.axis, len(shape), self)
            if p.num_axes < -1:
                raise self.fail(f"bias_param.num_axes must be -1 or more, got {p.num_axes}")
            end = len(shape) if p.num_axes == -1 else axis + p.num_axes
            if end > len(shape):
                raise self.fail(f"bias_param axis {axis} with num_axes {p.num_axes} goes past the "
                                f"{len(shape)} axes of the bottom {shape}")
            bias_shape = tuple(shape[axis:end])
        self.dims = (count(shape, 0, axis), count(bias_shape), count(shape, axis + len(bias_shape)))
        self.bias = self.add_param(bias_shape, p.filler) if len(bottom_shapes) == 1 else None
        return [shape]

    def backward_needs(self):
        return frozenset()  # the gradient is the top diff itself

    def scratch_entries(self):
        return need.row_sums(self.dims[1])

    def forward(self, bottom, top):
        ops = self.ops
        if not self.in_place:
            ops.copy(bottom[0], top[0])
        ops.add_bias(top[0], self.bias.data if self.bias is not None else bottom[1], *self.dims)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        dy = top_diff[0]
        if self.bias is not None:
            ops.bias_backward(dy, self.bias.diff, *self.dims, scratch=self.ctx.scratch)
        elif propagate_down[1]:
            ops.fill(bottom_diff[1], 0.0)
            ops.bias_backward(dy, bottom_diff[1], *self.dims, scratch=self.ctx.scratch)
        if propagate_down[0] and not self.in_place:
            ops.copy(dy, bottom_diff[0])
