"""Fused layers: what one step of a rewritten graph runs in place of a prototxt layer (graph/fuse.py).

A graph pass matches a pattern of prototxt layers and gives their steps these layers to run: one class
per pattern computes the pattern's work in the first layer's step, and `Absorbed` is what is left of a
layer whose forward, backward or both that step computes. The prototxt's layers stay the graph's nodes:
they own the parameters (caffemodels, the solver and pycaffe see Caffe's layers) and keep their own
steps, so logs, the profiler and the memory plan list Caffe's layers. A fused layer declares no
parameters of its own; it reads the prototxt layers' and runs on their backend and run context.
"""
from __future__ import annotations

from typing import Sequence

from superneurons.layers.base import Layer, Shape


class FusedLayer(Layer):
    """The base of the fused layers: named after `layer`, the prototxt layer whose step runs it."""

    def __init__(self, layer: Layer):
        # Not Layer.__init__: the parameters, the backend and the run context are the prototxt layer's.
        self.layer = layer
        self.param = layer.param
        self.name = layer.name
        self.phase = layer.phase
        self.layer_index = layer.layer_index
        self.in_place = layer.in_place
        self.params = []
        self.buffers = {}
        self.copy_data = False

    @property
    def ops(self):
        return self.layer.ops

    @property
    def ctx(self):
        return self.layer.ctx

    def forward_flops(self) -> int:
        return self.layer.forward_flops()

    def scratch_entries(self) -> int:
        """The prototxt layer's: a fused step runs its ops (the ones it adds, a ReLU's or a Scale's, sum nothing
        or override this)."""
        return self.layer.scratch_entries()

    def forward_bytes(self, bottom_shapes: Sequence[Shape], top_shapes: Sequence[Shape]) -> int:
        return self.layer.forward_bytes(bottom_shapes, top_shapes)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class Absorbed(FusedLayer):
    """A prototxt layer whose forward (`forward`), backward (`backward`) or both another step computes:
    those of its steps pass through and need nothing; the others are the layer's own."""

    def __init__(self, layer: Layer, forward: bool = False, backward: bool = False):
        if isinstance(layer, Absorbed):  # absorbed by two patterns: the forward by one, the backward by another
            forward, backward, layer = forward or layer.forward_elsewhere, backward or layer.backward_elsewhere, \
                layer.layer
        super().__init__(layer)
        self.type_name = layer.type_name
        self.forward_elsewhere = forward
        self.backward_elsewhere = backward
        self.buffers = {} if forward and backward else layer.buffers

    def backward_needs(self):
        return frozenset() if self.backward_elsewhere else self.layer.backward_needs()

    def forward_flops(self) -> int:
        return 0 if self.forward_elsewhere else self.layer.forward_flops()

    def forward_bytes(self, bottom_shapes, top_shapes) -> int:
        return 0 if self.forward_elsewhere else self.layer.forward_bytes(bottom_shapes, top_shapes)

    def forward(self, bottom, top):
        if not self.forward_elsewhere:
            self.layer.forward(bottom, top)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff, **kwargs):
        if not self.backward_elsewhere:
            self.layer.backward(top, top_diff, propagate_down, bottom, bottom_diff, **kwargs)
