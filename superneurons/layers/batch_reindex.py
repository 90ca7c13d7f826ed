"""BatchReindex: top[i] = data[permut[i]] along the batch axis (Caffe's layer); the indices get no gradient.

The rows of data gather and their gradients scatter-add like an embedding table's (Embed's ops, over data
viewed as (N, everything else)): a row picked twice gets both gradients, a row not picked none.
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, Layer, count, register


@register("BatchReindex")
class BatchReindex(Layer):
    n_bottoms = (2, 2)
    label_bottoms = (1,)

    def setup(self, bottom_shapes):
        data, permut = bottom_shapes
        if len(permut) != 1:
            raise self.fail(f"bottom 1 (the indices) must be 1-D, got {len(permut)}-D {permut}")
        if not data:
            raise self.fail("bottom 0 needs a batch axis, got a scalar")
        if self.in_place:
            raise self.fail("cannot work in place (its top must differ from its bottom)")
        self.rows, self.inner = int(data[0]), count(data, 1)
        return [(int(permut[0]),) + tuple(data[1:])]

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})  # the indices say where each row's gradient goes

    def scratch_entries(self):
        return need.total()  # the count of bad indices (the gather and scatter take no bias)

    def _run(self, op, *args):
        try:
            op(*args, scratch=self.ctx.scratch)
        except UserError as e:
            raise self.fail(f"{e} in bottom {self.param.bottom[1]!r} (the batch has {self.rows} items)") from None

    def forward(self, bottom, top):
        table = self.ops.reshape(bottom[0], (self.rows, self.inner))
        self._run(self.ops.embed_forward, bottom[1], table, None, top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.fill(bottom_diff[0], 0.0)
            table = self.ops.reshape(bottom_diff[0], (self.rows, self.inner))
            self._run(self.ops.embed_backward, bottom[1], top_diff[0], table, None)
