"""Split: one blob to several consumers (inserted automatically). Tops share the bottom's data; diffs are summed."""
from __future__ import annotations

from superneurons.layers.base import Layer, register


@register("Split")
class Split(Layer):
    channels_last = True
    shares_data = True
    can_copy_data = True  # when a consumer works in place on a top (graph.build sets copy_data)
    sums_top_diffs = True  # the bottom gradient may be a top gradient's memory (memory/aliases.py)
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        self._ones = [1.0] * len(self.param.top)
        return [bottom_shapes[0]] * len(self.param.top)

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        if self.copy_data:
            for t in top:
                self.ops.copy(bottom[0], t)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if not propagate_down[0]:
            return
        # The sum of the top diffs; eltwise_sum adds the first two in one pass on the GPU. A top diff that is
        # the bottom diff's memory (memory/aliases.py: the runtime then passes the bottom diff's array itself)
        # holds its share, and those of the consumers that added theirs into it, already: it goes first,
        # since eltwise_sum may write its output over bottoms[0].
        dx = bottom_diff[0]
        rest = [d for d in top_diff if d is not dx]
        if len(rest) == len(top_diff):
            diffs = top_diff
        elif not rest:
            return  # every share is in the bottom gradient already
        else:
            diffs = [dx] + rest
        self.ops.eltwise_sum(diffs, self._ones[:len(diffs)], bottom_diff[0])
