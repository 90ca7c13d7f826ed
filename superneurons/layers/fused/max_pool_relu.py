"""ReLU -> max Pooling, backward: the pooling's backward routes each gradient to its window's chosen pixel
and applies the ReLU's mask there too (op `pool_backward` with the ReLU's slope). A chosen pixel holds its
window's maximum, whose sign the forward keeps in the argmax buffer (~argmax where the maximum is not above 0:
`pool_forward`'s `signed_mask`); the pixels no window chose get no gradient either way. The ReLU's backward
step then passes through (`Absorbed(relu, backward=True)`) and nothing reads the activation in backward any
more, so liveness frees it after the pooling's forward (VGG16's liveness peak falls by a third).
"""
from __future__ import annotations

from superneurons.layers.fused import FusedLayer
from superneurons.layers.pooling import Pooling
from superneurons.layers.activations import ReLU


class MaxPoolingReLU(FusedLayer):
    type_name = "ReLU+Pooling"

    def __init__(self, pool: Pooling, relu: ReLU):
        super().__init__(pool)
        self.pool = pool
        self.slope = relu.slope
        self.buffers = pool.buffers  # the argmax, the one buffer of max pooling

    def backward_needs(self):
        return self.pool.backward_needs()

    def forward(self, bottom, top):
        self.ops.pool_forward(bottom[0], top[0], self.pool.mask.array, self.pool.geom, None, signed_mask=True)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.pool_backward(top_diff[0], self.pool.mask.array, bottom_diff[0], self.pool.geom, self.slope)
