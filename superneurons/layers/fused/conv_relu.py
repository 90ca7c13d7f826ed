"""Convolution -> ReLU: the convolution's step adds the bias and applies the ReLU in one pass after the
convolution (backend op `conv_relu_forward`), instead of a bias pass and a ReLU pass. A replay of its forward
(recomputation) rebuilds relu(conv).

The backward is not fused: the ReLU's gradient stays in the ReLU's own step (`Absorbed(relu, forward=True)`).
Masking it in the convolution's step would need the top there beside the bottom, which raises the per-step
peak that offload and recompute are bounded by (VGG16: 1176 -> 1568 MiB); apart, each step needs what the
unfused layer needs.
"""
from __future__ import annotations

from superneurons.layers.convolution import Convolution
from superneurons.layers.fused import FusedLayer
from superneurons.layers.activations import ReLU


class ConvolutionReLU(FusedLayer):
    type_name = "Convolution+ReLU"
    can_accumulate_bottom_diff = True

    def __init__(self, conv: Convolution, relu: ReLU):
        super().__init__(conv)
        self.conv = conv
        self.slope = relu.slope
        self.buffers = conv.buffers

    def backward_needs(self):
        return self.conv.backward_needs()

    def forward(self, bottom, top):
        conv = self.conv
        x, y = conv.as_4d(bottom[0]), conv.top_as_4d(top[0])
        b = conv.bias.data if conv.bias is not None else None
        conv.refresh_working_copies()
        self.ops.conv_relu_forward(x, conv.param_operand(0), b, y, conv.geom, self.slope, workspace=self.ctx.workspace)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff, accumulate=frozenset()):
        self.conv.backward(top, top_diff, propagate_down, bottom, bottom_diff, accumulate=accumulate)
