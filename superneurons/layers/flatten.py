"""Flatten: merge axes axis..end_axis into one. The top is a reshaped view of the bottom (data and diff)."""
from __future__ import annotations

from superneurons.layers.base import Layer, canonical_axis, count, register


@register("Flatten")
class Flatten(Layer):
    # The runtime hands the top (and its diff) as views of the bottom, so nothing is copied.
    shares_data = True
    shares_diff = True

    def setup(self, bottom_shapes):
        p = self.param.flatten_param
        shape = bottom_shapes[0]
        start = canonical_axis(p.axis, len(shape), self)
        end = canonical_axis(p.end_axis, len(shape), self)
        if end < start:
            raise self.fail(f"flatten_param.end_axis {p.end_axis} (axis {end}) comes before axis {p.axis} "
                            f"(axis {start}) for a {len(shape)}-D bottom")
        return [shape[:start] + (count(shape, start, end + 1),) + shape[end + 1:]]

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        pass  # top is a view of bottom

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass  # top diff is a view of bottom diff
