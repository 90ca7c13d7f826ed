"""Reduction (SUM, ASUM, SUMSQ, MEAN over every axis from `axis` on, times `coeff`) and ArgMax."""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, Layer, canonical_axis, count, register
from superneurons.proto import superneurons_pb2 as pb


@register("Reduction")
class Reduction(Layer):
    float32_only = True

    def setup(self, bottom_shapes):
        p = self.param.reduction_param
        shape = bottom_shapes[0]
        # Caffe accepts axis == num_axes (nothing reduced: every value is its own sum).
        axis = p.axis if p.axis >= 0 else p.axis + len(shape)
        if not 0 <= axis <= len(shape):
            raise self.fail(f"reduction_param.axis {p.axis} out of range for a {len(shape)}-D bottom")
        self.op = pb.ReductionParameter.ReductionOp.Name(p.operation)
        self.coeff = float(p.coeff)
        self.outer = count(shape, 0, axis)
        self.inner = count(shape, axis)
        return [tuple(shape[:axis])]

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM}) if self.op in ("ASUM", "SUMSQ") else frozenset()

    def scratch_entries(self):
        return need.row_sums(self.outer)

    def forward(self, bottom, top):
        self.ops.reduction_forward(bottom[0], top[0], self.op, self.coeff, self.outer, self.inner,
                                   scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            x = bottom[0] if self.op in ("ASUM", "SUMSQ") else None
            self.ops.reduction_backward(x, top_diff[0], bottom_diff[0], self.op, self.coeff, self.outer,
                                        self.inner)


@register("ArgMax")
class ArgMax(Layer):
    """The top_k largest values' indices (or values) along `axis`; without an axis, over each sample,
    giving (N, 1, top_k) indices or (N, 2, top_k) indices then values (Caffe's layout)."""
    float32_only = True

    has_backward = False

    def setup(self, bottom_shapes):
        p = self.param.argmax_param
        shape = tuple(bottom_shapes[0])
        self.top_k = int(p.top_k)
        self.out_max_val = bool(p.out_max_val)
        self.by_axis = p.HasField("axis")
        if self.by_axis:
            axis = canonical_axis(p.axis, len(shape), self)
            dims = (count(shape, 0, axis), shape[axis], count(shape, axis + 1))
            top = shape[:axis] + (self.top_k,) + shape[axis + 1:]
        else:
            self.require_axes(shape, 1)  # ranks each item's values: an N axis first
            dims = (shape[0], count(shape, 1), 1)
            top = [1] * max(3, len(shape))
            top[0], top[1], top[2] = shape[0], 2 if self.out_max_val else 1, self.top_k
            top = tuple(top)
        if self.top_k < 1 or self.top_k > dims[1]:
            raise self.fail(f"top_k is {self.top_k}, but must be between 1 and the {dims[1]} values it ranks")
        self.dims = dims
        return [top]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        ops = self.ops
        ops.argmax_forward(ops.reshape(bottom[0], self.dims), top[0], self.top_k, self.out_max_val, self.by_axis)
