"""The graph-level table of what the fusion passes (graph/fuse.py) decided, read by everything that needs it.

A node of the graph is a prototxt layer (`Node.layer`: its parameters, its name and type, what pycaffe and
caffemodels see). What its steps compute is `Fusions.step_layer(node)`: the layer itself, or the fused layer
a pass gave it (layers/fused/). The planner and the Net run and plan that; the partial-run check reads which
layers must run together (`joined`); the parameter streaming which parameters a step reads
(`layers_computed_by`); the gradient routing which blob's gradient a step reads and which bottoms it writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from superneurons.graph.node import Node
    from superneurons.layers.base import Layer


@dataclass(frozen=True)
class Match:
    """One match of a fusion pattern: `layers` (node names, the one whose step computes the others' work
    first). `forward`/`backward`: whether the others' forward/backward runs in that step; `why`: what a
    range that separates them is told."""

    pattern: str
    layers: tuple[str, ...]
    forward: bool
    backward: bool
    why: str


@dataclass(frozen=True)
class ConcatSlice:
    """ReLU `relu`, in place on bottom `bottom` of Concat `concat`, may read its gradient from the slice
    [offset, offset + width) along `axis` of the gradient of `blob`, the Concat's top."""

    relu: str
    concat: str
    blob: str
    axis: int
    offset: int
    bottom: int


@dataclass
class Fusions:
    matches: list[Match] = field(default_factory=list)
    # node name -> the layer its steps run instead of its own
    step_layers: dict[str, "Layer"] = field(default_factory=dict)
    # Blobs a pass split off a blob of the prototxt (a fused BatchNorm's input): name -> that blob.
    internal_blobs: dict[str, str] = field(default_factory=dict)
    # The ReLUs that may read their gradient from a Concat's top gradient, and the layers their and the
    # Concats' steps run then; on only while `slices_on` (memory.make_manager: under baseline).
    slices: list[ConcatSlice] = field(default_factory=list)
    slice_layers: dict[str, "Layer"] = field(default_factory=dict)
    slices_on: bool = False

    def add(self, match: Match, step_layers: dict[str, "Layer"]) -> None:
        self.matches.append(match)
        self.step_layers.update(step_layers)

    def step_layer(self, node: "Node") -> "Layer":
        """What `node`'s forward and backward steps run."""
        if self.slices_on and node.name in self.slice_layers:
            return self.slice_layers[node.name]
        return self.step_layers.get(node.name, node.layer)

    def forward_owner(self, name: str) -> str | None:
        """The layer whose step computes layer `name`'s forward, when another's does."""
        return next((m.layers[0] for m in self.matches if m.forward and name in m.layers[1:]), None)

    def backward_owner(self, name: str) -> str | None:
        """The layer whose step computes layer `name`'s backward, when another's does."""
        return next((m.layers[0] for m in self.matches if m.backward and name in m.layers[1:]), None)

    def _active_slices(self) -> list[ConcatSlice]:
        return self.slices if self.slices_on else []

    def top_gradient_blobs(self, node: "Node") -> list[str]:
        """The blobs whose gradients `node`'s backward reads as its top gradients: its tops, or the Concat top
        whose slice it reads. The planner and the Net both ask here."""
        for s in self._active_slices():
            if s.relu == node.name:
                return [s.blob]
        return node.tops

    def bottom_gradients_written(self, node: "Node", propagate_down: list[bool]) -> list[bool]:
        """Per bottom, whether `node`'s backward writes its gradient under `propagate_down`: not for those a
        ReLU writes from this Concat's top gradient."""
        taken = {s.bottom for s in self._active_slices() if s.concat == node.name}
        return [pd and j not in taken for j, pd in enumerate(propagate_down)]

    def joined(self, nodes: list["Node"], backward: bool) -> list[tuple[str, str, str]]:
        """(layer, layer, why) for every pair of layers a forward (`backward` False) or backward range must
        hold both or neither of, in route order of the second."""
        pairs = [(m.layers[0], other, m.why) for m in self.matches if (m.backward if backward else m.forward)
                 for other in m.layers[1:]]
        if backward:
            pairs += [(s.concat, s.relu, f"whose backward writes {s.concat!r}'s bottom gradient")
                      for s in self._active_slices()]
        order = {n.name: i for i, n in enumerate(nodes)}
        pairs.sort(key=lambda p: order[p[1]])
        # A blob split off for a fused BatchNorm holds what Caffe's blob holds between its producer and the
        # BatchNorm: a range starting or ending between them would read or show the wrong one.
        for internal, blob in self.internal_blobs.items():
            producer = next(n.name for n in nodes if internal in n.tops)
            consumer = next(n.name for n in nodes if internal in n.bottoms)
            pairs.append((producer, consumer, f"which works in place on blob {blob!r} and runs fused"))
        return pairs

    def layers_computed_by(self, nodes: list["Node"]) -> list[list[Any]]:
        """Per node, the prototxt layers whose parameters its steps read: its own layer plus those whose
        forward it computes (a fused BatchNorm applies its Scale's weights); none for an absorbed layer."""
        by_name = {n.name: n.layer for n in nodes}
        folded: dict[str, list[Any]] = {}
        absorbed: set[str] = set()
        for m in self.matches:
            if m.forward:
                folded.setdefault(m.layers[0], []).extend(by_name[name] for name in m.layers[1:])
                absorbed.update(m.layers[1:])
        return [[] if n.name in absorbed else [n.layer] + folded.get(n.name, []) for n in nodes]
