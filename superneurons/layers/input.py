"""Input: blobs the caller fills (deploy nets); their shapes come from input_param."""
from __future__ import annotations

from superneurons.layers.base import Layer, register


@register("Input")
class Input(Layer):
    is_data = True
    n_bottoms = (0, 0)
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        shapes = list(self.param.input_param.shape)
        n = len(self.param.top)
        if len(shapes) not in (1, n):
            raise self.fail(f"input_param gives {len(shapes)} shapes for {n} tops (need 1 or {n})")
        if len(shapes) == 1:
            shapes = shapes * n
        return [tuple(int(d) for d in s.dim) for s in shapes]

    def forward(self, bottom, top):
        pass  # the caller has written the inputs

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass
