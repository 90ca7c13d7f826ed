"""Eltwise: combine equally shaped blobs elementwise by weighted SUM, PROD or MAX."""
from __future__ import annotations

import numpy as np

from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, register
from superneurons.proto import superneurons_pb2 as pb

_OP = pb.EltwiseParameter


@register("Eltwise")
class Eltwise(Layer):
    channels_last = True
    n_bottoms = (2, None)

    def setup(self, bottom_shapes):
        p = self.param.eltwise_param
        self.op = p.operation
        self.stable = bool(p.stable_prod_grad)
        n = len(bottom_shapes)
        if p.coeff and len(p.coeff) != n:
            raise self.fail(f"eltwise_param gives {len(p.coeff)} coeff values for {n} bottoms (need one per bottom)")
        if p.coeff and self.op == _OP.PROD:
            raise self.fail("eltwise_param.coeff applies to SUM only, not PROD")
        # Caffe ignores coeff under MAX; so do we, so that its prototxts load unchanged.
        self.coeffs = [float(c) for c in p.coeff] if p.coeff else [1.0] * n
        for j, shape in enumerate(bottom_shapes[1:], start=1):
            if shape != bottom_shapes[0]:
                raise self.fail(f"bottom {j} has shape {shape} but bottom 0 has {bottom_shapes[0]}; "
                                f"all bottoms must have the same shape")
        if self.op == _OP.PROD and self.in_place and self.phase == pb.TRAIN:
            raise self.fail(f"PROD cannot work in place on {self.param.bottom[0]!r}: its backward reads "
                            f"the original bottoms; give the top its own name")
        if self.op == _OP.MAX:
            self.argmax = self.add_buffer("argmax", bottom_shapes[0], np.int32,
                                          for_backward=self.phase == pb.TRAIN)
        return [bottom_shapes[0]]

    def identity_diff_bottoms(self):
        """Under SUM, the bottoms with coefficient 1: their gradient is the top gradient."""
        if self.op != _OP.SUM:
            return ()
        return tuple(k for k, c in enumerate(self.coeffs) if c == 1.0)

    def backward_needs(self):
        if self.op == _OP.PROD:
            return frozenset({NEEDS_BOTTOM} if self.stable else {NEEDS_BOTTOM, NEEDS_TOP})
        return frozenset()  # SUM: only the coefficients; MAX: the argmax buffer

    def forward(self, bottom, top):
        ops = self.ops
        if self.op == _OP.SUM:
            ops.eltwise_sum(bottom, self.coeffs, top[0])
        elif self.op == _OP.PROD:
            ops.eltwise_prod(bottom, top[0])
        else:
            ops.eltwise_max(bottom, top[0], self.argmax.array)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        dy = top_diff[0]
        # Last bottom first: in place, bottom 0's diff is the top diff, so it must be written last. A bottom
        # gradient that is the top gradient's memory (in place, or shared by memory/aliases.py: the runtime
        # then passes dy's array itself) with coefficient 1 holds its value already.
        for i in reversed(range(len(bottom))):
            if not propagate_down[i] or (bottom_diff[i] is dy and self.coeffs[i] == 1.0 and self.op == _OP.SUM):
                continue
            if self.op == _OP.SUM:
                ops.scaled_copy(self.coeffs[i], dy, bottom_diff[i])
            elif self.op == _OP.PROD:
                ops.eltwise_prod_backward(bottom, i, None if self.stable else top[0], dy, bottom_diff[i],
                                          self.stable)
            else:
                ops.eltwise_max_backward(dy, self.argmax.array, i, bottom_diff[i])
