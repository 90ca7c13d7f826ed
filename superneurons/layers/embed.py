"""Embed: each bottom value is an index into a (input_dim, num_output) table; the top gains a last axis of
num_output. The indices get no gradient; the table (and bias) do."""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, Layer, register


@register("Embed")
class Embed(Layer):
    label_bottoms = (0,)

    def setup(self, bottom_shapes):
        p = self.param.embed_param
        if p.num_output < 1:
            raise self.fail(f"embed_param.num_output must be 1 or more, got {p.num_output}")
        if p.input_dim < 1:
            raise self.fail(f"embed_param.input_dim must be 1 or more, got {p.input_dim}")
        self.weight = self.add_param((int(p.input_dim), int(p.num_output)), p.weight_filler)
        self.bias = self.add_param((int(p.num_output),), p.bias_filler) if p.bias_term else None
        return [tuple(bottom_shapes[0]) + (int(p.num_output),)]

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})  # the indices pick the rows that get gradient

    def scratch_entries(self):
        return max(need.total(), need.row_sums(self.weight.shape[1]) if self.bias is not None else 0)

    def _run(self, op, *args):
        try:
            op(*args, scratch=self.ctx.scratch)
        except UserError as e:
            raise self.fail(f"{e} in bottom {self.param.bottom[0]!r}") from None

    def forward(self, bottom, top):
        self._run(self.ops.embed_forward, bottom[0], self.weight.data,
                  self.bias.data if self.bias is not None else None, top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        self._run(self.ops.embed_backward, bottom[0], top_diff[0], self.weight.diff,
                  self.bias.diff if self.bias is not None else None)
