"""The activations (Caffe semantics): ReLU, Sigmoid, TanH, PReLU, ELU, AbsVal, BNLL, Exp, Log, Power, Threshold,
Clip and Swish. The fusion passes (graph/fuse.py) may give a ReLU's step to a fused layer (layers/fused/).

ReLU, Sigmoid, TanH, ELU, BNLL and Exp compute their gradient from the output, so they work in place. AbsVal, Log,
non-trivial Power, Clip and Swish read the input; they refuse to work in place in training, where their input would be
overwritten. PReLU in place keeps a copy of its input for backward, as Caffe does.
"""
from __future__ import annotations

import math
from typing import ClassVar

from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, count, register
from superneurons.proto import superneurons_pb2 as pb


@register("ReLU")
class ReLU(Layer):
    """Caffe's ReLU, with its leaky negative_slope."""

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


def _log_base(layer: Layer, base: float) -> float:
    """ln(base), where Caffe's default base -1 means e."""
    if base == -1.0:
        return 1.0
    if base <= 0 or base == 1.0:
        raise layer.fail(f"base must be a positive number other than 1 (or -1 for e), got {base:g}")
    return math.log(base)


class _Elementwise(Layer):
    """Top has the bottom's shape."""

    def _no_in_place_training(self):
        if self.in_place and self.phase == pb.TRAIN:
            raise self.fail(f"cannot work in place on {self.param.bottom[0]!r} when training: its backward "
                            f"reads the input; give the top its own name")

    def setup(self, bottom_shapes):
        self.configure()
        return [bottom_shapes[0]]

    def configure(self):
        pass


@register("PReLU")
class PReLU(Layer):
    def setup(self, bottom_shapes):
        p = self.param.prelu_param
        shape = bottom_shapes[0]
        if len(shape) < 2:
            raise self.fail(f"needs a bottom with at least 2 axes (N, C, ...), got {shape}")
        self.dims = (shape[0], shape[1], count(shape, 2))
        self.shared = bool(p.channel_shared)
        filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=0.25)
        self.slope = self.add_param((1,) if self.shared else (shape[1],), filler)
        self.saved_x = self.add_buffer("x", shape) if self.in_place and self.phase == pb.TRAIN else None
        return [shape]

    def backward_needs(self):
        return frozenset() if self.saved_x is not None else frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        if self.saved_x is not None:
            self.ops.copy(bottom[0], self.saved_x.array)
        self.ops.prelu_forward(bottom[0], self.slope.data, top[0], *self.dims)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        x = self.saved_x.array if self.saved_x is not None else bottom[0]
        # The slope's gradient first: in place, the bottom diff is the top diff.
        self.ops.prelu_backward(x, self.slope.data, top_diff[0], None, self.slope.diff, *self.dims)
        if propagate_down[0]:
            self.ops.prelu_backward(x, self.slope.data, top_diff[0], bottom_diff[0], None, *self.dims)


@register("ELU")
class ELU(_Elementwise):
    def configure(self):
        self.alpha = float(self.param.elu_param.alpha)
        if self.alpha < 0:
            raise self.fail(f"elu_param.alpha must be >= 0, got {self.alpha:g}")

    def backward_needs(self):
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        self.ops.elu_forward(bottom[0], top[0], self.alpha)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.elu_backward(top[0], top_diff[0], bottom_diff[0], self.alpha)


@register("AbsVal")
class AbsVal(_Elementwise):
    def configure(self):
        self._no_in_place_training()

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        self.ops.absval_forward(bottom[0], top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.absval_backward(bottom[0], top_diff[0], bottom_diff[0])


@register("BNLL")
class BNLL(_Elementwise):
    def backward_needs(self):
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        self.ops.bnll_forward(bottom[0], top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.bnll_backward(top[0], top_diff[0], bottom_diff[0])


@register("Exp")
class Exp(_Elementwise):
    def configure(self):
        p = self.param.exp_param
        self.log_base = _log_base(self, float(p.base))
        self.scale, self.shift = float(p.scale), float(p.shift)

    def backward_needs(self):
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        self.ops.exp_forward(bottom[0], top[0], self.log_base, self.scale, self.shift)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.exp_backward(top[0], top_diff[0], bottom_diff[0], self.log_base, self.scale)


@register("Log")
class Log(_Elementwise):
    def configure(self):
        p = self.param.log_param
        self.log_base = _log_base(self, float(p.base))
        self.scale, self.shift = float(p.scale), float(p.shift)
        self._no_in_place_training()

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        self.ops.log_forward(bottom[0], top[0], self.log_base, self.scale, self.shift)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.log_backward(bottom[0], top_diff[0], bottom_diff[0], self.log_base, self.scale, self.shift)


@register("Power")
class Power(_Elementwise):
    def configure(self):
        p = self.param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)
        # The gradient is a constant when power is 0 or 1 or scale is 0; otherwise it reads the input.
        self.reads_x = not (self.power in (0.0, 1.0) or self.scale == 0.0)
        if self.reads_x:
            self._no_in_place_training()

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM}) if self.reads_x else frozenset()

    def forward(self, bottom, top):
        self.ops.power_forward(bottom[0], top[0], self.power, self.scale, self.shift)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.power_backward(bottom[0] if self.reads_x else None, top_diff[0], bottom_diff[0], self.power,
                                    self.scale, self.shift)


@register("Clip")
class Clip(_Elementwise):
    """y = min(max(x, min), max); the gradient passes where min <= x <= max (Caffe's, which reads the input)."""

    def configure(self):
        p = self.param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise self.fail("clip_param needs both min and max")
        if p.min > p.max:
            raise self.fail(f"clip_param.min {p.min:g} is above clip_param.max {p.max:g}")
        self.bounds = (float(p.min), float(p.max))
        self._no_in_place_training()

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        self.ops.clip_forward(bottom[0], top[0], *self.bounds)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.clip_backward(bottom[0], top_diff[0], bottom_diff[0], *self.bounds)


@register("Swish")
class Swish(_Elementwise):
    """y = x * sigmoid(beta * x); backward recomputes the sigmoid from the input (Caffe keeps it from forward)."""

    def configure(self):
        self.beta = float(self.param.swish_param.beta)
        self._no_in_place_training()

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        self.ops.swish_forward(bottom[0], top[0], self.beta)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.swish_backward(bottom[0], top_diff[0], bottom_diff[0], self.beta)


@register("Threshold")
class Threshold(_Elementwise):
    has_backward = False  # a step function: no useful gradient (Caffe does not implement one)

    def configure(self):
        self.threshold = float(self.param.threshold_param.threshold)

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        self.ops.threshold_forward(bottom[0], top[0], self.threshold)
