"""Convolution (Caffe semantics): 2-D, grouped, dilated, over the axes after `axis`.

Also home of `spatial_pair`, the reading of Caffe's "one value for every spatial axis or one per
axis, or the _h/_w fields" convention that Pooling shares.
"""
from __future__ import annotations

from typing import Sequence

from superneurons.backend import scratch as need
from superneurons.backend.geometry import ConvGeometry, Pair
from superneurons.layers.base import NEEDS_BOTTOM, Layer, canonical_axis, count, register


def spatial_pair(layer: Layer, msg, what: str, values: Sequence[int], default: int | None, minimum: int) -> Pair:
    """(h, w) for a window setting of `msg` given as `values` (1 or 2 of them) or as `what`_h / `what`_w.

    A side the _h/_w form leaves out takes `default`; with no default (the kernel) both are
    required, as Caffe requires.
    """
    h, w = (_optional(msg, f"{what}_{side}") for side in "hw")
    if h is not None or w is not None:
        if len(values):
            raise layer.fail(f"give either {what} or {what}_h/{what}_w, not both")
        if default is None and (h is None or w is None):
            raise layer.fail(f"{what}_h and {what}_w must both be given")
        pair = (default if h is None else h, default if w is None else w)
    elif not len(values):
        if default is None:
            raise layer.fail(f"{what} is required ({what}_size, or {what}_h and {what}_w)")
        pair = (default, default)
    elif len(values) <= 2:
        pair = (values[0], values[-1])
    else:
        raise layer.fail(f"{what} has {len(values)} values; only 2-D (1 or 2 values) is supported")
    if min(pair) < minimum:
        raise layer.fail(f"{what} must be >= {minimum}, got {pair[0]} x {pair[1]}")
    return int(pair[0]), int(pair[1])


def _optional(msg, field: str) -> int | None:
    """The value of an optional proto2 field; None when the prototxt leaves it out or the message lacks it."""
    if field not in msg.DESCRIPTOR.fields_by_name or not msg.HasField(field):
        return None
    return getattr(msg, field)


def read_conv_param(layer: Layer, shape, what: str) -> tuple[int, int]:
    """Validate convolution_param against the bottom shape; set layer.n/c/h/w and layer.geom.

    Shared by Convolution and Deconvolution (same parameter message, same checks).
    Returns (channel axis, num_output).
    """
    p = layer.param.convolution_param
    if layer.in_place:
        raise layer.fail("cannot work in place (its top must differ from its bottom)")
    if not p.HasField("num_output") or p.num_output == 0:
        raise layer.fail("convolution_param.num_output is required and must be > 0")
    axis = canonical_axis(p.axis, len(shape), layer)
    if len(shape) - axis - 1 != 2:
        raise layer.fail(f"needs 2 spatial axes after channel axis {axis}, bottom has {len(shape)} axes "
                         f"{shape}; only 2-D {what} is supported")
    layer.n = count(shape, 0, axis)
    layer.c, layer.h, layer.w = (int(d) for d in shape[axis:])
    m, group = int(p.num_output), int(p.group)
    if group < 1:
        raise layer.fail(f"group must be >= 1, got {group}")
    if layer.c % group:
        raise layer.fail(f"{layer.c} input channels are not divisible by group {group}")
    if m % group:
        raise layer.fail(f"num_output {m} is not divisible by group {group}")
    kernel = spatial_pair(layer, p, "kernel", p.kernel_size, None, 1)
    stride = spatial_pair(layer, p, "stride", p.stride, 1, 1)
    pad = spatial_pair(layer, p, "pad", p.pad, 0, 0)
    dilation = spatial_pair(layer, p, "dilation", p.dilation, 1, 1)
    layer.geom = ConvGeometry(kernel, stride, pad, dilation, group)
    return axis, m


@register("Convolution")
class Convolution(Layer):
    can_accumulate_bottom_diff = True
    data_typed_params = (0,)  # cuDNN convolves operands of one type: half storage reads a half copy of W
    data_typed_grads = (0,)
    channels_last = True

    def setup(self, bottom_shapes):
        p = self.param.convolution_param
        shape = bottom_shapes[0]
        axis, m = read_conv_param(self, shape, "convolution")
        g = self.geom
        group, kernel, pad, dilation = g.group, g.kernel, g.pad, g.dilation
        for n_in, pd, ext, side in zip((self.h, self.w), pad, self.geom.extent(), ("height", "width")):
            if ext > n_in + 2 * pd:
                raise self.fail(f"kernel extent {ext} (kernel {kernel}, dilation {dilation}) is larger than the "
                                f"padded input {side} {n_in} + 2*{pd} = {n_in + 2 * pd}")
        self.m = m
        self.oh, self.ow = self.geom.out_size((self.h, self.w))
        self.weight = self.add_param((m, self.c // group) + kernel, p.weight_filler)
        self.bias = self.add_param((m,), p.bias_filler) if p.bias_term else None
        return [tuple(shape[:axis]) + (m, self.oh, self.ow)]

    def forward_flops(self):
        """Every output pixel of every image: one dot product per weight element (the weight's shape
        already accounts for groups: each output channel sees c / group inputs)."""
        return 2 * self.n * self.oh * self.ow * count(self.weight.shape)

    @property
    def algo_name(self) -> str:
        """The backend's algorithm choice for this shape (what `superneurons time` shows)."""
        return self.ops.conv_algorithm((self.n, self.c, self.h, self.w), self.weight.shape,
                                       (self.n, self.m, self.oh, self.ow), self.geom, self.weight.data.dtype)

    def as_4d(self, x):
        """Bottom-shaped `x` as the (N, C, H, W) array the convolution ops take."""
        return self.ops.reshape(x, (self.n, self.c, self.h, self.w))

    def top_as_4d(self, y):
        return self.ops.reshape(y, (self.n, self.m, self.oh, self.ow))

    def backward_needs(self):
        # dW needs the input; dx needs only dy and W (a parameter, always resident).
        return frozenset({NEEDS_BOTTOM})

    def scratch_entries(self):
        return need.row_sums(self.m) if self.bias is not None else 0  # the bias gradient's per-channel sums

    def forward(self, bottom, top):
        b = self.bias.data if self.bias is not None else None
        self.refresh_working_copies()
        self.ops.conv_forward(self.as_4d(bottom[0]), self.param_operand(0), b, self.top_as_4d(top[0]), self.geom,
                              workspace=self.ctx.workspace)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff, accumulate=frozenset()):
        """`accumulate`: {0} when dx is to be added into what its memory holds (`can_accumulate_bottom_diff`)."""
        self.refresh_working_copies(backward=True)
        x, w, dy = self.as_4d(bottom[0]), self.param_operand(0, backward=True), self.top_as_4d(top_diff[0])
        dx = self.as_4d(bottom_diff[0]) if propagate_down[0] else None
        db = self.bias.diff if self.bias is not None else None
        dw, overwrite_dw = self.param_gradient(0)
        if self.gradient_in_copy(0):  # dw overwrites the backward's copy of W: compute dx, which reads W, first
            self.ops.conv_backward(x, w, dy, dx, None, db, self.geom, accumulate_dx=0 in accumulate,
                                   workspace=self.ctx.workspace, scratch=self.ctx.scratch)
            dx = db = None
        self.ops.conv_backward(x, w, dy, dx, dw, db, self.geom, accumulate_dx=0 in accumulate,
                               overwrite_dw=overwrite_dw, workspace=self.ctx.workspace, scratch=self.ctx.scratch)
        self.add_param_gradient(0)
