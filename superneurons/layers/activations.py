"""Sigmoid and TanH: elementwise, with a backward that reads only the output (so they work in place)."""
from __future__ import annotations

from typing import ClassVar

from superneurons.layers.base import NEEDS_TOP, Layer, register


class _OutputGradActivation(Layer):
    """y = f(x) elementwise where f'(x) is a function of y; subclasses name their two backend ops."""

    forward_op: ClassVar[str]
    backward_op: ClassVar[str]

    def setup(self, bottom_shapes):
        return [bottom_shapes[0]]

    def backward_needs(self):
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        getattr(self.ops, self.forward_op)(bottom[0], top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            getattr(self.ops, self.backward_op)(top[0], top_diff[0], bottom_diff[0])


@register("Sigmoid")
class Sigmoid(_OutputGradActivation):
    forward_op = "sigmoid_forward"
    backward_op = "sigmoid_backward"  # dx = dy * y * (1 - y)


@register("TanH")
class TanH(_OutputGradActivation):
    forward_op = "tanh_forward"
    backward_op = "tanh_backward"  # dx = dy * (1 - y^2)
