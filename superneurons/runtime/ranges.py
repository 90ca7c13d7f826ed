"""Runs over part of a net (Caffe's ForwardFromTo/BackwardFromTo, pycaffe's start=/end=): which are allowed.

pycaffe reads and writes any blob between calls and runs a slice of the layers, so a range needs every
tensor resident: it is refused under the memory modes that free or move tensors between steps. A range
that holds a fused layer (graph/fuse.py) without the layer computing it, or the other way round, would run
the pair's work whole or not at all: e.g. a Convolution fused with its ReLU ends a range at the convolution
with the ReLU applied, where Caffe's blob is still before it. The graph's `Fusions.joined` says which layers
run together forward and which backward.
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError


def check_range(net: Any, first: int, last: int | None, what: str, backward: bool = False) -> bool:
    """Whether prototxt positions first..last leave out some layer of `net`; such a range is checked here
    (UserError if refused). `what`: the run, for the message."""
    nodes = net.graph.nodes
    partial = first > 0 or (last is not None and last < max(n.layer.layer_index for n in nodes))
    if partial:
        if net.memory.name != "baseline" or net.streaming is not None:
            raise UserError(f"net {net.name!r}: {what} needs every tensor resident; it runs under memory mode "
                            f"{net.memory.name!r} (build the net with memory='baseline')")
        _refuse_split_fusion(net, first, last, what, backward)
    return partial


def _refuse_split_fusion(net: Any, first: int, last: int | None, what: str, backward: bool) -> None:
    nodes = net.graph.nodes
    positions = {n.name: n.layer.layer_index for n in nodes}
    types = {n.name: n.layer.type_name for n in nodes}

    def inside(name: str) -> bool:
        return first <= positions[name] and (last is None or positions[name] <= last)

    for a, b, why in net.graph.fusions.joined(nodes, backward):
        if inside(a) != inside(b):
            raise UserError(f"net {net.name!r}: {what} from layer {first} to "
                            f"{last if last is not None else 'the end'} separates {a!r} ({types[a]}) from "
                            f"{b!r} ({types[b]}), {why}; include both, or build the net with "
                            f"SUPERNEURONS_FUSE=0 to run every layer on its own")
