"""Concat: join several blobs along one axis (channels by default)."""
from __future__ import annotations

from superneurons.layers.base import Layer, canonical_axis, register


@register("Concat")
class Concat(Layer):
    channels_last = True  # slab copies over the stored rows (backend/cuda/channels_last_ops.py)
    n_bottoms = (1, None)

    def setup(self, bottom_shapes):
        p = self.param.concat_param
        first = bottom_shapes[0]
        if p.HasField("concat_dim"):
            if p.HasField("axis"):
                raise self.fail("give concat_param.axis or the legacy concat_dim, not both")
            axis = int(p.concat_dim)
        else:
            axis = int(p.axis)
        self.axis = canonical_axis(axis, len(first), self)
        for j, shape in enumerate(bottom_shapes[1:], start=1):
            same_rank = len(shape) == len(first)
            if not same_rank or any(a != b for k, (a, b) in enumerate(zip(shape, first)) if k != self.axis):
                raise self.fail(f"bottom {j} has shape {shape} but bottom 0 has {first}; "
                                f"all dimensions except axis {self.axis} must match")
        # Where each bottom starts along the axis in the top.
        self.offsets = []
        width = 0
        for shape in bottom_shapes:
            self.offsets.append(width)
            width += shape[self.axis]
        return [first[:self.axis] + (width,) + first[self.axis + 1:]]

    def backward_needs(self):
        return frozenset()  # each bottom's diff is a slice of the top diff

    def forward(self, bottom, top):
        self.ops.concat_forward(bottom, top[0], self.axis)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        for pd, diff, offset in zip(propagate_down, bottom_diff, self.offsets):
            if pd:
                self.ops.concat_backward(top_diff[0], diff, self.axis, offset)
