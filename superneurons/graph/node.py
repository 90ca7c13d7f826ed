"""A node of the graph: one layer with its wiring (bottom and top blobs, shapes, loss weights, which bottoms
get gradients). `build.py` makes the nodes; the fusion passes (`fuse.py`), the planner and the Net read them.
What a node's steps compute, when a fusion pass rewrote them, is the graph's to say (`Graph.step_layer`)."""
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
