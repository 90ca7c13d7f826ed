"""Eltwise SUM -> ReLU (a ResNet's residual joins): forward is one pass (read the bottoms, write relu(sum),
op `eltwise_sum_relu`) and backward one pass (read y and dy, write every bottom gradient the Eltwise writes,
op `eltwise_sum_relu_backward`); apart, the ReLU reads and writes the sum again, and its gradient again. The
fused step needs its top for backward (the ReLU's mask) instead of the ReLU's step; a replay of its forward
(recomputation) rebuilds relu(sum). The ReLU's steps pass through (`Absorbed`).
"""
from __future__ import annotations

from superneurons.layers.base import NEEDS_TOP
from superneurons.layers.eltwise import Eltwise
from superneurons.layers.fused import FusedLayer
from superneurons.layers.activations import ReLU


class EltwiseSumReLU(FusedLayer):
    type_name = "Eltwise+ReLU"

    def __init__(self, eltwise: Eltwise, relu: ReLU):
        super().__init__(eltwise)
        self.eltwise = eltwise
        self.slope = relu.slope
        self.buffers = eltwise.buffers

    def identity_diff_bottoms(self):
        """The bottoms with coefficient 1: their gradient may be the top gradient's memory, masked in place
        (written last, below)."""
        return self.eltwise.identity_diff_bottoms()

    def backward_needs(self):
        return frozenset({NEEDS_TOP})  # the ReLU's mask: top > 0

    def forward(self, bottom, top):
        self.ops.eltwise_sum_relu(bottom, self.eltwise.coeffs, top[0], self.slope)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        # The bottom whose gradient is dy's memory (in place, or shared by memory/aliases.py: the runtime then
        # passes dy's array itself) gets the masked gradient in place; the others are computed from dy first.
        dy = top_diff[0]
        shared = next((i for i, d in enumerate(bottom_diff) if d is dy), None)
        order = [i for i in range(len(bottom_diff)) if propagate_down[i] and i != shared]
        if shared is not None and propagate_down[shared]:
            order.append(shared)
        if order:
            coeffs = self.eltwise.coeffs
            self.ops.eltwise_sum_relu_backward(top[0], dy, [coeffs[i] for i in order],
                                               [bottom_diff[i] for i in order], self.slope)
