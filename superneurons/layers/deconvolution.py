"""Deconvolution (Caffe semantics): the transposed convolution, built from the convolution ops.

With the same geometry, a convolution maps the deconvolution's top (N, M, OH, OW) to its bottom
(N, C, H, W) with a weight of shape (C, M / group, kh, kw), Caffe's deconvolution weight shape.
So deconvolution forward is that convolution's backward-data, and its backward is the convolution's
forward (bottom diff) plus its weight gradient with the roles of input and output swapped.
Output size: OH = stride * (H - 1) + dilation * (kh - 1) + 1 - 2 * pad.
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, Layer, count, register
from superneurons.layers.convolution import read_conv_param


@register("Deconvolution")
class Deconvolution(Layer):
    data_typed_params = (0,)  # cuDNN's operands share one type: half storage reads a half copy of W
    data_typed_grads = (0,)
    def setup(self, bottom_shapes):
        p = self.param.convolution_param
        shape = bottom_shapes[0]
        axis, m = read_conv_param(self, shape, "deconvolution")
        g = self.geom
        group, kernel, stride, pad = g.group, g.kernel, g.stride, g.pad
        ext = self.geom.extent()
        self.oh, self.ow = (s * (n - 1) + e - 2 * pd for s, n, e, pd in zip(stride, (self.h, self.w), ext, pad))
        if self.oh < 1 or self.ow < 1:
            raise self.fail(f"output would be {self.oh} x {self.ow}: padding {pad} is too large for input "
                            f"{self.h} x {self.w}, kernel {kernel}, stride {stride}")
        self.m = m
        self.weight = self.add_param((self.c, m // group) + kernel, p.weight_filler)
        self.bias = self.add_param((m,), p.bias_filler) if p.bias_term else None
        return [tuple(shape[:axis]) + (m, self.oh, self.ow)]

    def forward_flops(self):
        """Every input pixel of every image scatters through the whole weight."""
        return 2 * self.n * self.h * self.w * count(self.weight.shape)

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})  # the weight gradient correlates the bottom with the top diff

    def scratch_entries(self):
        return need.row_sums(self.m) if self.bias is not None else 0

    def _shapes(self):
        return (self.n, self.c, self.h, self.w), (self.n, self.m, self.oh, self.ow)

    def forward(self, bottom, top):
        ops = self.ops
        x_shape, y_shape = self._shapes()
        y = ops.reshape(top[0], y_shape)
        # The convolution's backward-data: its "input" is our top (only its shape is read, as dw is None).
        self.refresh_working_copies()
        ops.conv_backward(y, self.param_operand(0), ops.reshape(bottom[0], x_shape), y, None, None, self.geom,
                          workspace=self.ctx.workspace)
        if self.bias is not None:
            ops.add_bias(y, self.bias.data, self.n, self.m, self.oh * self.ow)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        x_shape, y_shape = self._shapes()
        dy = ops.reshape(top_diff[0], y_shape)
        x = ops.reshape(bottom[0], x_shape)
        if self.bias is not None:
            ops.bias_backward(dy, self.bias.diff, self.n, self.m, self.oh * self.ow, scratch=self.ctx.scratch)
        self.refresh_working_copies(backward=True)
        if propagate_down[0]:  # dx first: the weight gradient may overwrite the half copy of W it reads
            ops.conv_forward(dy, self.param_operand(0, backward=True), None, ops.reshape(bottom_diff[0], x_shape), self.geom,
                             workspace=self.ctx.workspace)
        # Weight gradient: the convolution's, with dy as its input and x as its output gradient.
        dw, overwrite_dw = self.param_gradient(0)
        ops.conv_backward(dy, self.param_operand(0, backward=True), x, None, dw, None, self.geom, overwrite_dw=overwrite_dw,
                          workspace=self.ctx.workspace)
        self.add_param_gradient(0)
