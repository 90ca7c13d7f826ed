"""InnerProduct: y = x W^T + b over the axes from `axis` on (Caffe's fully connected layer)."""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, Layer, canonical_axis, count, register


@register("InnerProduct")
class InnerProduct(Layer):
    data_typed_params = (0,)  # cuBLAS multiplies operands of one type: half storage reads a half copy of W
    def setup(self, bottom_shapes):
        p = self.param.inner_product_param
        if not p.HasField("num_output"):
            raise self.fail("inner_product_param.num_output is required")
        shape = bottom_shapes[0]
        axis = canonical_axis(p.axis, len(shape), self)
        self.m = count(shape, 0, axis)
        self.k = count(shape, axis)
        self.n = int(p.num_output)
        self.transpose = bool(p.transpose)
        self.bias_term = bool(p.bias_term)
        self.weight = self.add_param((self.k, self.n) if self.transpose else (self.n, self.k), p.weight_filler)
        self.bias = self.add_param((self.n,), p.bias_filler) if self.bias_term else None
        return [tuple(shape[:axis]) + (self.n,)]

    def forward_flops(self):
        return 2 * self.m * count(self.weight.shape)

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def scratch_entries(self):
        return need.row_sums(self.n) if self.bias is not None else 0

    def forward(self, bottom, top):
        ops = self.ops
        x = ops.reshape(bottom[0], (self.m, self.k))
        y = ops.reshape(top[0], (self.m, self.n))
        self.refresh_working_copies()
        ops.gemm(False, not self.transpose, 1.0, x, self.param_operand(0), 0.0, y)
        if self.bias is not None:
            ops.add_bias(y, self.bias.data, self.m, self.n, 1)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        x = ops.reshape(bottom[0], (self.m, self.k))
        dy = ops.reshape(top_diff[0], (self.m, self.n))
        if self.transpose:  # W is (k, n): dW += x^T dy
            ops.gemm(True, False, 1.0, x, dy, 1.0, self.weight.diff)
        else:  # W is (n, k): dW += dy^T x
            ops.gemm(True, False, 1.0, dy, x, 1.0, self.weight.diff)
        if self.bias is not None:
            ops.bias_backward(dy, self.bias.diff, self.m, self.n, 1, scratch=self.ctx.scratch)
        if propagate_down[0]:
            dx = ops.reshape(bottom_diff[0], (self.m, self.k))
            self.refresh_working_copies(backward=True)
            ops.gemm(False, self.transpose, 1.0, dy, self.param_operand(0, backward=True), 0.0, dx)
