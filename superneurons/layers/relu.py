"""ReLU (with Caffe's leaky negative_slope)."""
from __future__ import annotations

from superneurons.layers.base import NEEDS_TOP, Layer, register


@register("ReLU")
class ReLU(Layer):
    def setup(self, bottom_shapes):
        self.slope = float(self.param.relu_param.negative_slope)
        return [bottom_shapes[0]]

    def backward_needs(self):
        # y > 0 exactly where x > 0 (for any slope >= 0), so the output suffices and in-place works.
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        self.ops.relu_forward(bottom[0], top[0], self.slope)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.relu_backward(top[0], top_diff[0], bottom_diff[0], self.slope)
