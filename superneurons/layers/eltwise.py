"""Eltwise: combine equally shaped blobs elementwise by weighted SUM, PROD or MAX.

graph/fuse.py may fold the ReLU in place on a SUM's top into this layer (`fuse_relu`, a ResNet's joins): it then
writes relu(sum) itself and its backward masks the top gradient with its top, so it needs its top.
"""
from __future__ import annotations

import numpy as np

from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, register
from superneurons.proto import superneurons_pb2 as pb

_OP = pb.EltwiseParameter


@register("Eltwise")
class Eltwise(Layer):
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
        self.relu_slope = None  # the absorbed ReLU's negative_slope (>= 0), once fused
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

    def fuse_relu(self, relu) -> None:
        """Apply `relu` (a ReLU in place on our top, slope >= 0; graph/fuse.py checks) ourselves."""
        self.relu_slope = relu.slope
        relu.absorb_into(self)

    def identity_diff_bottoms(self):
        """Under SUM, the bottoms with coefficient 1: their gradient is the top gradient (masked in place
        by the fused ReLU's backward, which writes that bottom last)."""
        if self.op != _OP.SUM:
            return ()
        return tuple(k for k, c in enumerate(self.coeffs) if c == 1.0)

    def backward_needs(self):
        if self.op == _OP.PROD:
            return frozenset({NEEDS_BOTTOM} if self.stable else {NEEDS_BOTTOM, NEEDS_TOP})
        if self.relu_slope is not None:
            return frozenset({NEEDS_TOP})  # the ReLU's mask: top > 0
        return frozenset()  # SUM: only the coefficients; MAX: the argmax buffer

    def forward(self, bottom, top):
        ops = self.ops
        if self.relu_slope is not None:
            ops.eltwise_sum_relu(bottom, self.coeffs, top[0], self.relu_slope)
        elif self.op == _OP.SUM:
            ops.eltwise_sum(bottom, self.coeffs, top[0])
        elif self.op == _OP.PROD:
            ops.eltwise_prod(bottom, top[0])
        else:
            ops.eltwise_max(bottom, top[0], self.argmax.array)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        dy = top_diff[0]
        if self.relu_slope is not None:
            self._backward_sum_relu(top[0], dy, propagate_down, bottom_diff)
            return
        # Last bottom first: in place, bottom 0's diff is the top diff, so it must be written last.
        for i in reversed(range(len(bottom))):
            if not propagate_down[i] or i == self.diff_alias:
                continue
            if self.op == _OP.SUM:
                ops.scaled_copy(self.coeffs[i], dy, bottom_diff[i])
            elif self.op == _OP.PROD:
                ops.eltwise_prod_backward(bottom, i, None if self.stable else top[0], dy, bottom_diff[i],
                                          self.stable)
            else:
                ops.eltwise_max_backward(dy, self.argmax.array, i, bottom_diff[i])

    def _backward_sum_relu(self, y, dy, propagate_down, bottom_diff) -> None:
        # The bottom whose gradient is dy's memory (aliased, or bottom 0 in place) gets the masked gradient
        # in place; the others are computed from dy, so it goes last.
        shared = self.diff_alias if self.diff_alias is not None else (0 if self.in_place else None)
        order = [i for i in range(len(bottom_diff)) if propagate_down[i] and i != shared]
        if shared is not None and propagate_down[shared]:
            order.append(shared)
        if order:
            self.ops.eltwise_sum_relu_backward(y, dy, [self.coeffs[i] for i in order],
                                               [dy if i == shared else bottom_diff[i] for i in order],
                                               self.relu_slope)
