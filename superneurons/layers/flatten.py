"""Flatten: merge axes axis..end_axis into one. The top is a reshaped view of the bottom (data and diff)."""
from __future__ import annotations

from superneurons.layers.base import canonical_axis, count, register
from superneurons.layers.shape_ops import ViewLayer


@register("Flatten")
class Flatten(ViewLayer):
    def setup(self, bottom_shapes):
        p = self.param.flatten_param
        shape = bottom_shapes[0]
        start = canonical_axis(p.axis, len(shape), self)
        end = canonical_axis(p.end_axis, len(shape), self)
        if end < start:
            raise self.fail(f"flatten_param.end_axis {p.end_axis} (axis {end}) comes before axis {p.axis} "
                            f"(axis {start}) for a {len(shape)}-D bottom")
        return [shape[:start] + (count(shape, start, end + 1),) + shape[end + 1:]]
