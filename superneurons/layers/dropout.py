"""Dropout: in TRAIN, zero each element with probability dropout_ratio and scale the rest by 1/(1-ratio).

The mask is never stored. It is a hash of (run seed, iteration, layer index, element index) (see
`backend/cpu/dropout.py`), so the backward regenerates it and needs neither bottom nor top, and a
recomputed forward reproduces it bit for bit. In TEST the layer is the identity, as in Caffe.
"""
from __future__ import annotations

from superneurons.layers.base import Layer, register
from superneurons.proto import superneurons_pb2 as pb


@register("Dropout")
class Dropout(Layer):
    def setup(self, bottom_shapes):
        self.ratio = float(self.param.dropout_param.dropout_ratio)
        if not 0.0 <= self.ratio < 1.0:
            raise self.fail(f"dropout_ratio must be in [0, 1), got {self.ratio:g}")
        self.active = self.phase == pb.TRAIN
        return [bottom_shapes[0]]

    def backward_needs(self):
        return frozenset()

    def _apply(self, src, dst) -> None:
        if not self.active:
            if dst is not src:
                self.ops.copy(src, dst)
            return
        ctx = self.ctx
        self.ops.dropout_apply(src, dst, self.ratio, ctx.seed, ctx.iteration, self.layer_index)

    def prepare_replay(self) -> None:
        if self.active:  # the mask of this pass: the kernels read its key from the device
            self.ops.dropout_pass(self.ctx.seed, self.ctx.iteration)

    def forward(self, bottom, top):
        self._apply(bottom[0], top[0])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            # The same mask and scale map dy to dx as mapped x to y.
            self._apply(top_diff[0], bottom_diff[0])
