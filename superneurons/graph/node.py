"""A node of the graph: one layer with its wiring (bottom and top blobs, shapes, loss weights, which bottoms
get gradients). `build.py` makes the nodes; the fusion passes (`fuse.py`), the planner and the Net read them."""
from __future__ import annotations

from dataclasses import dataclass, field

from superneurons.layers.base import Layer, Shape


@dataclass
class Node:
    """One layer in the graph with its wiring."""

    layer: Layer
    bottoms: list[str]
    tops: list[str]
    top_shapes: list[Shape] = field(default_factory=list)
    loss_weights: list[float] = field(default_factory=list)
    need_backward: bool = False
    propagate_down: list[bool] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.layer.name

    def top_gradient_blobs(self) -> list[str]:
        """The blobs whose gradients this node's backward reads as its top gradients: its tops, or the Concat
        top whose slice it reads (`Layer.gradient_slice`). The planner and the Net both ask here."""
        where = self.layer.gradient_slice
        return [where.blob] if where is not None else self.tops

    def bottom_gradients_written(self, propagate_down: list[bool]) -> list[bool]:
        """Per bottom, whether this node's backward writes its gradient under `propagate_down`: not for those a
        ReLU writes from this Concat's top gradient (`Layer.bottoms_taken`)."""
        taken = self.layer.bottoms_taken
        return [pd and j not in taken for j, pd in enumerate(propagate_down)]
