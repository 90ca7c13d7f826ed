"""Im2col: a convolution's column buffer as a top (Caffe's layer, reading convolution_param's window).

Top (N, C * kh * kw, OH, OW): entry (n, (c * kh + i) * kw + j, oh, ow) is the pixel that kernel tap (i, j) of
output (oh, ow) reads in channel c, 0 in the padding. Backward adds each entry's gradient back to its pixel.
"""
from __future__ import annotations

from superneurons.backend.geometry import ConvGeometry
from superneurons.layers.base import Layer, canonical_axis, register
from superneurons.layers.convolution import spatial_pair


@register("Im2col")
class Im2col(Layer):
    def setup(self, bottom_shapes):
        p = self.param.convolution_param
        shape = bottom_shapes[0]
        if self.in_place:
            raise self.fail("cannot work in place (its top must differ from its bottom)")
        axis = canonical_axis(p.axis, len(shape), self)
        if len(shape) != 4 or axis != 1:
            raise self.fail(f"needs a 4-D (N, C, H, W) bottom with channel axis 1, got {len(shape)}-D {shape} "
                            f"and axis {axis}; only 2-D im2col is supported")
        if p.group != 1:
            raise self.fail(f"takes no group (got {p.group})")
        kernel = spatial_pair(self, p, "kernel", p.kernel_size, None, 1)
        stride = spatial_pair(self, p, "stride", p.stride, 1, 1)
        pad = spatial_pair(self, p, "pad", p.pad, 0, 0)
        dilation = spatial_pair(self, p, "dilation", p.dilation, 1, 1)
        self.geom = ConvGeometry(kernel, stride, pad, dilation)
        n, c, h, w = shape
        for n_in, pd, ext, side in zip((h, w), pad, self.geom.extent(), ("height", "width")):
            if ext > n_in + 2 * pd:
                raise self.fail(f"kernel extent {ext} (kernel {kernel}, dilation {dilation}) is larger than the "
                                f"padded input {side} {n_in} + 2*{pd} = {n_in + 2 * pd}")
        return [(n, c * kernel[0] * kernel[1]) + self.geom.out_size((h, w))]

    def backward_needs(self):
        return frozenset()  # the column entries map back to pixels by the window alone

    def forward(self, bottom, top):
        self.ops.im2col_forward(bottom[0], top[0], self.geom)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.im2col_backward(top_diff[0], bottom_diff[0], self.geom)
