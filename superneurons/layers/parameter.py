"""Parameter: a learnable blob of parameter_param.shape as the layer's only top (no bottoms), as in Caffe.

Caffe's top shares the blob's memory; here the top is a copy the forward writes, and backward adds the
top's gradient into the blob's, so the blob trains exactly as Caffe's does. Caffe fills it with no filler:
zeros, until a caffemodel or the solver changes it.
"""
from __future__ import annotations

from superneurons.layers.base import Layer, register


@register("Parameter")
class Parameter(Layer):
    n_bottoms = (0, 0)

    def setup(self, bottom_shapes):
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        if any(d < 1 for d in shape):
            raise self.fail(f"parameter_param.shape {list(shape)} must have dimensions of 1 or more")
        self.blob = self.add_param(shape, None)
        return [shape]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        self.ops.copy(self.blob.data, top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        self.ops.axpy(1.0, top_diff[0], self.blob.diff)
