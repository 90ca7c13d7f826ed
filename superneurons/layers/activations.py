"""The activations (Caffe semantics): ReLU, Sigmoid, TanH, PReLU, ELU, AbsVal, BNLL, Exp, Log, Power, Threshold,
Clip and Swish. The fusion passes (graph/fuse.py) may give a ReLU's step to a fused layer (layers/fused/).

ReLU, Sigmoid, TanH, ELU, BNLL and Exp compute their gradient from the output, so they work in place. AbsVal, Log,
non-trivial Power, Clip and Swish read the input; they refuse to work in place in training, where their input would be
overwritten. PReLU in place keeps a copy of its input for backward, as Caffe does.
"""
from __future__ import annotations

import math
from typing import ClassVar

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, count, register
from superneurons.proto import superneurons_pb2 as pb


class _Activation(Layer):
    """y = f(x) elementwise through two backend ops, `<op>_forward(x, y, *scalars)` and
    `<op>_backward(v, dy, dx, *backward_scalars)`. `v` is what the gradient is computed from: the output when
    `reads` is NEEDS_TOP (the layer then works in place), the input when it is NEEDS_BOTTOM (in place is
    refused in training, where forward would overwrite it), None when the gradient needs neither. A subclass
    names `op` and `reads` and turns its parameter message into `scalars` (and `backward_scalars`, when the
    backward takes others) in `configure`."""
    channels_last = True

    op: ClassVar[str]
    reads: str | None = NEEDS_TOP
    scalars: tuple[float, ...] = ()
    backward_scalars: tuple[float, ...] | None = None  # None: the forward's

    def setup(self, bottom_shapes):
        self.configure()
        if self.reads == NEEDS_BOTTOM and self.in_place and self.phase == pb.TRAIN:
            raise self.fail(f"cannot work in place on {self.param.bottom[0]!r} when training: its backward "
                            f"reads the input; give the top its own name")
        return [bottom_shapes[0]]

    def configure(self) -> None:
        """Read the layer's parameter message (checking it) into `scalars`."""

    def backward_needs(self):
        return frozenset({self.reads}) if self.reads else frozenset()

    def forward(self, bottom, top):
        getattr(self.ops, f"{self.op}_forward")(bottom[0], top[0], *self.scalars)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            v = {NEEDS_TOP: top[0], NEEDS_BOTTOM: bottom[0]}.get(self.reads)
            scalars = self.scalars if self.backward_scalars is None else self.backward_scalars
            getattr(self.ops, f"{self.op}_backward")(v, top_diff[0], bottom_diff[0], *scalars)


@register("ReLU")
class ReLU(_Activation):
    """Caffe's ReLU, with its leaky negative_slope. y > 0 exactly where x > 0 (for any slope >= 0), so the
    gradient needs only the output."""

    op = "relu"

    def configure(self):
        self.slope = float(self.param.relu_param.negative_slope)
        self.scalars = (self.slope,)


@register("Sigmoid")
class Sigmoid(_Activation):
    op = "sigmoid"  # dx = dy * y * (1 - y)


@register("TanH")
class TanH(_Activation):
    op = "tanh"  # dx = dy * (1 - y^2)


def _log_base(layer: Layer, base: float) -> float:
    """ln(base), where Caffe's default base -1 means e."""
    if base == -1.0:
        return 1.0
    if base <= 0 or base == 1.0:
        raise layer.fail(f"base must be a positive number other than 1 (or -1 for e), got {base:g}")
    return math.log(base)


@register("ELU")
class ELU(_Activation):
    op = "elu"

    def configure(self):
        alpha = float(self.param.elu_param.alpha)
        if alpha < 0:
            raise self.fail(f"elu_param.alpha must be >= 0, got {alpha:g}")
        self.scalars = (alpha,)


@register("AbsVal")
class AbsVal(_Activation):
    op = "absval"
    reads = NEEDS_BOTTOM


@register("BNLL")
class BNLL(_Activation):
    op = "bnll"


@register("Exp")
class Exp(_Activation):
    op = "exp"

    def configure(self):
        p = self.param.exp_param
        log_base = _log_base(self, float(p.base))
        self.scalars = (log_base, float(p.scale), float(p.shift))
        self.backward_scalars = (log_base, float(p.scale))


@register("Log")
class Log(_Activation):
    op = "log"
    reads = NEEDS_BOTTOM

    def configure(self):
        p = self.param.log_param
        self.scalars = (_log_base(self, float(p.base)), float(p.scale), float(p.shift))


@register("Power")
class Power(_Activation):
    op = "power"

    def configure(self):
        p = self.param.power_param
        power, scale, shift = float(p.power), float(p.scale), float(p.shift)
        # The gradient is a constant when power is 0 or 1 or scale is 0; otherwise it reads the input.
        self.reads = None if power in (0.0, 1.0) or scale == 0.0 else NEEDS_BOTTOM
        self.scalars = (power, scale, shift)


@register("Clip")
class Clip(_Activation):
    """y = min(max(x, min), max); the gradient passes where min <= x <= max (Caffe's, which reads the input)."""

    op = "clip"
    reads = NEEDS_BOTTOM

    def configure(self):
        p = self.param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise self.fail("clip_param needs both min and max")
        if p.min > p.max:
            raise self.fail(f"clip_param.min {p.min:g} is above clip_param.max {p.max:g}")
        self.scalars = (float(p.min), float(p.max))


@register("Swish")
class Swish(_Activation):
    """y = x * sigmoid(beta * x); backward recomputes the sigmoid from the input (Caffe keeps it from forward)."""

    op = "swish"
    reads = NEEDS_BOTTOM

    def configure(self):
        self.scalars = (float(self.param.swish_param.beta),)


@register("Threshold")
class Threshold(_Activation):
    op = "threshold"
    reads = None
    has_backward = False  # a step function: no useful gradient (Caffe does not implement one)

    def configure(self):
        self.scalars = (float(self.param.threshold_param.threshold),)


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

    def scratch_entries(self):
        return need.row_sums(self.dims[1])  # the slope gradient's per-channel sums

    def forward(self, bottom, top):
        if self.saved_x is not None:
            self.ops.copy(bottom[0], self.saved_x.array)
        self.ops.prelu_forward(bottom[0], self.slope.data, top[0], *self.dims)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        x = self.saved_x.array if self.saved_x is not None else bottom[0]
        # The slope's gradient first: in place, the bottom diff is the top diff.
        self.ops.prelu_backward(x, self.slope.data, top_diff[0], None, self.slope.diff, *self.dims,
                                scratch=self.ctx.scratch)
        if propagate_down[0]:
            self.ops.prelu_backward(x, self.slope.data, top_diff[0], bottom_diff[0], None, *self.dims)
