"""LRN, local response normalization (Caffe semantics), across channels or within each channel.

ACROSS_CHANNELS: y = x * (k + alpha/size * sum of x^2 over `size` neighbouring channels)^-beta.
WITHIN_CHANNEL:  y = x * (1 + alpha/size^2 * sum of x^2 over a size x size zero-padded patch)^-beta;
Caffe builds this one from an average pooling and a Power layer with shift 1, so `k` plays no part.
"""
from __future__ import annotations

from superneurons.backend.geometry import LRNGeometry
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, register
from superneurons.proto import superneurons_pb2 as pb


@register("LRN")
class LRN(Layer):
    # Computes in float32 (the CPU's ops and the GPU's kernels) but stores its top in the layer's type, as a
    # half convolution usually reads it next (a float32 top there ran that convolution on float32 copies).

    def setup(self, bottom_shapes):
        p = self.param.lrn_param
        shape = bottom_shapes[0]
        if len(shape) != 4:
            raise self.fail(f"needs a 4-D (N, C, H, W) bottom, got {len(shape)}-D {shape}")
        if self.in_place:
            raise self.fail("cannot work in place: its backward reads both its bottom and its top")
        size = int(p.local_size)
        if size < 1 or size % 2 == 0:
            raise self.fail(f"local_size must be odd and positive (the window is centred), got {size}")
        self.geom = LRNGeometry(across=p.norm_region == pb.LRNParameter.ACROSS_CHANNELS, size=size,
                                alpha=float(p.alpha), beta=float(p.beta), k=float(p.k))
        # The per-element denominator: computed once in forward, read again by backward.
        self.scale = self.add_buffer("scale", shape, for_backward=self.phase == pb.TRAIN)
        return [shape]

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM, NEEDS_TOP})

    def forward(self, bottom, top):
        self.ops.lrn_forward(bottom[0], top[0], self.scale.array, self.geom)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.lrn_backward(bottom[0], top[0], self.scale.array, top_diff[0], bottom_diff[0], self.geom)
