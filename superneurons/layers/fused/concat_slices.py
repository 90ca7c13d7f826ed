"""ReLU -> Concat, backward (GoogLeNet's and SqueezeNet's joins): the Concat's backward copies each bottom's
slice of its top gradient out, and the ReLU's then reads that copy and writes it masked; fused, the ReLU's
backward reads its slice of the Concat's top gradient itself (op `relu_backward_slab`, the same bits) and the
Concat copies nothing for that bottom: a pass over the gradient less per joined ReLU.

The ReLU's step reads the Concat's top gradient, which then lives until that step, beside the ReLU's output
and gradient: the graph turns these on only under `baseline` (graph/fuse.py, `Graph.use_concat_slices`).
"""
from __future__ import annotations

from superneurons.layers.base import NEEDS_TOP, Layer
from superneurons.layers.concat import Concat
from superneurons.layers.fused import FusedLayer
from superneurons.layers.activations import ReLU


class ReLUReadingSlice(FusedLayer):
    """The ReLU's step: forward as before (`step`: the ReLU, or what another pattern left of it), backward
    from the slice [offset, offset + width) along `axis` of the Concat's top gradient (the runtime hands that
    gradient in as the top gradient: `Fusions.top_gradient_blobs`)."""

    type_name = "ReLU+Concat"

    def __init__(self, step: Layer, relu: ReLU, axis: int, offset: int):
        super().__init__(relu)
        self.step = step
        self.slope = relu.slope
        self.axis = axis
        self.offset = offset

    def backward_needs(self):
        return frozenset({NEEDS_TOP})  # y > 0 exactly where x > 0

    def forward_flops(self) -> int:
        return self.step.forward_flops()

    def forward_bytes(self, bottom_shapes, top_shapes) -> int:
        return self.step.forward_bytes(bottom_shapes, top_shapes)

    def forward(self, bottom, top):
        self.step.forward(bottom, top)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.relu_backward_slab(top[0], top_diff[0], bottom_diff[0], self.axis, self.offset, self.slope)


class ConcatLeavingSlices(FusedLayer):
    """The Concat's step: its backward writes no gradient for the bottoms in `taken` (their ReLUs do)."""

    type_name = "Concat"

    def __init__(self, concat: Concat, taken: frozenset[int]):
        super().__init__(concat)
        self.concat = concat
        self.taken = taken

    def backward_needs(self):
        return self.concat.backward_needs()

    def forward(self, bottom, top):
        self.concat.forward(bottom, top)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        left = [pd and j not in self.taken for j, pd in enumerate(propagate_down)]
        self.concat.backward(top, top_diff, left, bottom, bottom_diff)
