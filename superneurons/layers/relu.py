"""ReLU (with Caffe's leaky negative_slope). graph/fuse.py may fold it into a preceding BatchNorm+Scale, Eltwise
SUM or Convolution (`absorb_into`): its forward is then a pass-through, and so is its backward unless the owner
leaves the backward to this step (`runs_absorbed_backward`: Convolution does). Its backward may also go to the
max Pooling that reads its output (`leave_backward_to`), which then masks the gradient it writes. In place on
a Concat's bottom, it may read its gradient straight from its slice of the Concat's top gradient
(`read_gradient_slice`), and the Concat copies nothing for that bottom."""
from __future__ import annotations

from superneurons.layers.base import NEEDS_TOP, Layer, register


@register("ReLU")
class ReLU(Layer):
    def setup(self, bottom_shapes):
        self.slope = float(self.param.relu_param.negative_slope)
        return [bottom_shapes[0]]

    def _backward_done_by_owner(self) -> bool:
        if self.backward_taken_by is not None:
            return True
        return self.fused_into is not None and self.fused_into.runs_absorbed_backward

    def backward_needs(self):
        if self._backward_done_by_owner():
            return frozenset()
        # y > 0 exactly where x > 0 (for any slope >= 0), so the output suffices and in-place works.
        return frozenset({NEEDS_TOP})

    def forward(self, bottom, top):
        if self.fused_into is not None:
            return
        self.ops.relu_forward(bottom[0], top[0], self.slope)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if not propagate_down[0] or self._backward_done_by_owner():
            return
        where = self.gradient_slice
        if where is None:
            self.ops.relu_backward(top[0], top_diff[0], bottom_diff[0], self.slope)
        else:  # top_diff[0] is the Concat's top gradient (Node.top_gradient_blobs)
            self.ops.relu_backward_slab(top[0], top_diff[0], bottom_diff[0], where.axis, where.offset, self.slope)
