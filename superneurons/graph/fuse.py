"""Fusion as a graph rewrite: each pass matches one pattern of prototxt layers in route order and gives their
steps a fused layer to run (layers/fused/, one class per pattern, calling the backend's fused ops), recording
the match in the graph's `Fusions` table (graph/fusions.py).

A match is taken only when the fused layer computes exactly what the separate layers did:
- each layer's output is read by the next layer of the pattern and by nothing else: in route order, the next
  layer touching the first layer's top blob is the next of the pattern, in place on it;
- the ReLU's negative_slope is >= 0 (its mask is then "pre-activation > 0", and "output > 0");
- the layers agree on whether they run backward.
Each pass below says what else its pattern needs. The passes run in this order (a later one reads what the
earlier ones decided: a ReLU whose backward a fused BatchNorm computes has none left to give a pooling);
graph.build runs them unless the memory policy's `fuse_layers` is off (memory_param, SUPERNEURONS_FUSE=0).
The layers after a Filter take part in none (graph/live_batch.py: they run set up for each batch's count).
A pass knows a layer's class by its type name, registered for that class (layers/base.register), and casts it so.
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import TYPE_CHECKING, cast

from superneurons.graph.fusions import ConcatSlice, Fusions, Match
from superneurons.layers.base import count
from superneurons.layers.fused import Absorbed
from superneurons.layers.fused.batch_norm_scale_relu import BatchNormScaleReLU
from superneurons.layers.fused.concat_slices import ConcatLeavingSlices, ReLUReadingSlice
from superneurons.layers.fused.conv_relu import ConvolutionReLU
from superneurons.layers.fused.eltwise_sum_relu import EltwiseSumReLU
from superneurons.layers.fused.max_pool_relu import MaxPoolingReLU
from superneurons.proto import superneurons_pb2 as pb

if TYPE_CHECKING:
    from superneurons.graph.node import Node
    from superneurons.layers.activations import ReLU
    from superneurons.layers.batch_norm import BatchNorm
    from superneurons.layers.concat import Concat
    from superneurons.layers.convolution import Convolution
    from superneurons.layers.eltwise import Eltwise
    from superneurons.layers.pooling import Pooling
    from superneurons.layers.scale import Scale

FUSED = "which run fused as one step"


def fuse(nodes: list["Node"], shapes: dict[str, tuple[int, ...]], apart: frozenset[str] = frozenset()) -> Fusions:
    """Every pass over `nodes` (route order, backward flags set); a BatchNorm taken out of place adds its
    new input blob to `shapes`. The layers named in `apart` run on their own (the layers after a Filter, which
    run set up for each batch's count: graph/live_batch.py)."""
    fusions = Fusions()
    if apart:
        # A stand-in reads as a node whose type no pass matches.
        nodes = [cast("Node", _Apart(n)) if n.name in apart else n for n in nodes]
    fuse_batch_norm_chains(nodes, shapes, fusions)
    fuse_eltwise_relu(nodes, fusions)
    fuse_conv_relu(nodes, fusions)
    fuse_relu_backward_into_max_pool(nodes, fusions)
    find_concat_slices(nodes, fusions)
    return fusions


class _Apart:
    """A node no pattern matches (its layer's type reads as none), with the wiring the passes look at, which
    they cannot change (a BatchNorm's producer never gets its top renamed here)."""

    def __init__(self, node: "Node"):
        self.name, self.bottoms, self.tops = node.name, tuple(node.bottoms), tuple(node.tops)
        self.layer = _NoType()


class _NoType:
    type_name = ""
    in_place = False
    views_bottom_data = False


def fuse_batch_norm_chains(nodes: list["Node"], shapes: dict[str, tuple[int, ...]], fusions: Fusions) -> None:
    """BatchNorm -> Scale (-> ReLU): layers/fused/batch_norm_scale_relu.py. The Scale multiplies by a learned
    per-channel vector (one bottom, axis 1, C values) and adds a bias. The zoo writes the chain in place on the
    convolution's top, so the pass gives the convolution a top of its own (`<blob>/bn_input`,
    `Fusions.internal_blobs`) and the BatchNorm writes y into the blob the net names; without a producer to
    split from (in place on a net input, say) the fused layer keeps x_hat instead, which forward writes
    beside y: one pass more."""
    touchers = _Touchers(nodes)
    for i, bn in enumerate(nodes):
        if bn.layer.type_name != "BatchNorm" or len(bn.tops) != 1:
            continue
        blob = bn.tops[0]
        j = touchers.next(i, blob)
        if j is None or not _is_fusable_scale(bn, nodes[j], blob):
            continue
        scale = nodes[j]
        k = touchers.next(j, blob)
        relu = nodes[k] if k is not None and _is_fusable_relu(bn, nodes[k], blob) else None
        # Nets of the TEST phase never run backward (runtime.Net(train=phase == TRAIN)): keep nothing.
        keep = bn.need_backward and bn.layer.phase == pb.TRAIN
        separate = keep and _separate_input(nodes, touchers, i, shapes, fusions)
        members = [n for n in (scale, relu) if n is not None]
        fused = BatchNormScaleReLU(cast("BatchNorm", bn.layer), cast("Scale", scale.layer),
                                   cast("ReLU", relu.layer) if relu is not None else None, keep,
                                   in_place=bn.layer.in_place and not separate)
        fusions.add(Match("BatchNorm+Scale+ReLU", tuple(n.name for n in [bn] + members), True, True, FUSED),
                    {bn.name: fused, **{n.name: Absorbed(n.layer, forward=True, backward=True) for n in members}})


def _separate_input(nodes: list["Node"], touchers: _Touchers, i: int, shapes: dict[str, tuple[int, ...]],
                    fusions: Fusions) -> bool:
    """Take BatchNorm node `i` out of place where the layer before it on its blob made the blob: that
    producer's top and the BatchNorm's bottom become a new blob, `<blob>/bn_input`. The BatchNorm then
    keeps its input for backward instead of writing x_hat beside y (one pass less forward, the same bytes
    kept), and the two gradients still share memory (`diff_in_place_bottoms`). Not where the producer is a
    net input, or writes the blob in place or as a view of its own bottom."""
    bn = nodes[i]
    blob = bn.tops[0]
    if not _in_place_on(bn, blob):
        return False
    j = touchers.previous(i, blob)
    if j is None:
        return False
    producer = nodes[j]
    # A layer without bottoms makes a net input (Input, Data, ...), which the caller fills by its name.
    if not producer.bottoms or blob in producer.bottoms or producer.tops.count(blob) != 1 \
            or producer.layer.views_bottom_data or fusions.forward_owner(producer.name) is not None:
        return False
    name, n = f"{blob}/bn_input", 1
    while name in shapes:
        n += 1
        name = f"{blob}/bn_input{n}"
    producer.tops[producer.tops.index(blob)] = name
    bn.bottoms[0] = name
    touchers.renamed(nodes, (j, i), blob, name)
    shapes[name] = shapes[blob]
    fusions.internal_blobs[name] = blob
    return True


def fuse_eltwise_relu(nodes: list["Node"], fusions: Fusions) -> None:
    """Eltwise SUM (any coefficients, one top) -> ReLU: layers/fused/eltwise_sum_relu.py."""
    for node, relu in _trailing_relus(nodes, lambda n: n.layer.type_name == "Eltwise"
                                      and cast("Eltwise", n.layer).op == pb.EltwiseParameter.SUM):
        fusions.add(Match("Eltwise+ReLU", (node.name, relu.name), True, True, FUSED),
                    {node.name: EltwiseSumReLU(cast("Eltwise", node.layer), cast("ReLU", relu.layer)),
                     relu.name: Absorbed(relu.layer, forward=True, backward=True)})


def fuse_conv_relu(nodes: list["Node"], fusions: Fusions) -> None:
    """Convolution (one top; any bias, group, dilation) -> ReLU, forward only: layers/fused/conv_relu.py.
    Deconvolution and InnerProduct stay unfused."""
    for node, relu in _trailing_relus(nodes, lambda n: n.layer.type_name == "Convolution"):
        fusions.add(Match("Convolution+ReLU", (node.name, relu.name), True, False, FUSED),
                    {node.name: ConvolutionReLU(cast("Convolution", node.layer), cast("ReLU", relu.layer)),
                     relu.name: Absorbed(relu.layer, forward=True)})


def fuse_relu_backward_into_max_pool(nodes: list["Node"], fusions: Fusions) -> None:
    """ReLU -> max Pooling, backward: layers/fused/max_pool_relu.py. Only for a ReLU whose backward runs in
    its own step that propagates to its bottom, in place, whose output a max Pooling with one top (no mask
    top, which holds Caffe's plain argmax) is the only and last reader of, and only where the pooling shrinks
    the activation: recompute may keep the argmax buffer where it used to keep the activation."""
    touchers = _Touchers(nodes)
    for i, relu in enumerate(nodes):
        if relu.layer.type_name != "ReLU" or len(relu.tops) != 1 or not relu.need_backward \
                or not relu.propagate_down[0]:
            continue
        blob = relu.tops[0]
        relu_layer = cast("ReLU", relu.layer)
        if not _in_place_on(relu, blob) or relu_layer.slope < 0 or fusions.backward_owner(relu.name) is not None:
            continue
        j = touchers.next(i, blob)
        if j is None or touchers.next(j, blob) is not None:
            continue  # the pooling must be the blob's last reader
        pool = nodes[j]
        if pool.layer.type_name != "Pooling" or cast("Pooling", pool.layer).geom.method != "max" \
                or pool.bottoms != [blob] \
                or len(pool.tops) != 1 or not pool.need_backward or not pool.propagate_down[0]:
            continue
        if count(pool.top_shapes[0]) >= count(relu.top_shapes[0]):
            continue  # its argmax buffer, which replays may keep instead of the activation, would be no smaller
        fusions.add(Match("ReLU+Pooling", (pool.name, relu.name), False, True,
                          f"whose backward runs in {pool.name!r}'s"),
                    {pool.name: MaxPoolingReLU(cast("Pooling", pool.layer), relu_layer),
                     relu.name: Absorbed(fusions.step_layer(relu), backward=True)})


def find_concat_slices(nodes: list["Node"], fusions: Fusions) -> None:
    """ReLU -> Concat, backward: layers/fused/concat_slices.py. Recorded here, used only while
    `Fusions.slices_on` (memory.make_manager turns them on under `baseline`, where every tensor stays
    resident and the fusion costs no memory: the Concat's top gradient then lives until the ReLU's step,
    beside the ReLU's output and gradient, which under recompute is a replayed output; SqueezeNet's widest
    batch under 12 GiB fell from 1784 to 1624 by the planner with it on in every mode). Only for a ReLU whose
    backward runs in its own step, in place on a blob it writes last before the Concat, which reads it once
    and is its last reader, with negative_slope >= 0, both running backward into that bottom."""
    touchers = _Touchers(nodes)
    for i, concat in enumerate(nodes):
        if concat.layer.type_name != "Concat" or not concat.need_backward or len(concat.tops) != 1 \
                or concat.tops[0] in concat.bottoms:
            continue
        layer = cast("Concat", concat.layer)
        taken = []
        reads = Counter(concat.bottoms)
        for j, blob in enumerate(concat.bottoms):
            if not concat.propagate_down[j] or reads[blob] != 1 \
                    or touchers.next(i, blob) is not None:
                continue  # the Concat must read the blob once, and last
            k = touchers.previous(i, blob)
            if k is None:
                continue
            relu = nodes[k]
            if relu.layer.type_name != "ReLU" or not _in_place_on(relu, blob) or cast("ReLU", relu.layer).slope < 0 \
                    or not relu.need_backward or not relu.propagate_down[0] \
                    or fusions.backward_owner(relu.name) is not None:
                continue
            where = ConcatSlice(relu.name, concat.name, concat.tops[0], layer.axis, layer.offsets[j], j)
            fusions.slices.append(where)
            fusions.slice_layers[relu.name] = ReLUReadingSlice(fusions.step_layer(relu), cast("ReLU", relu.layer),
                                                               where.axis, where.offset)
            taken.append(j)
        if taken:
            fusions.slice_layers[concat.name] = ConcatLeavingSlices(layer, frozenset(taken))


def _trailing_relus(nodes: list["Node"], owns) -> list[tuple["Node", "Node"]]:
    """(node, ReLU) for every node that `owns` accepts whose one top the ReLU touches next, in place."""
    found = []
    touchers = _Touchers(nodes)
    for i, node in enumerate(nodes):
        if not owns(node) or len(node.tops) != 1:
            continue
        blob = node.tops[0]
        j = touchers.next(i, blob)
        if j is not None and _is_fusable_relu(node, nodes[j], blob):
            found.append((node, nodes[j]))
    return found


class _Touchers:
    """The route indexes of the nodes that read or write each blob, ascending: the next or previous node on a
    blob is a bisection, not a scan of the route (which made fusing an unrolled recurrent net quadratic)."""

    def __init__(self, nodes: list["Node"]):
        self.at: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for blob in dict.fromkeys([*n.bottoms, *n.tops]):
                self.at.setdefault(blob, []).append(i)

    def next(self, i: int, blob: str) -> int | None:
        """The first node after `i` in route order that reads or writes `blob`."""
        at = self.at.get(blob, [])
        k = bisect.bisect_right(at, i)
        return at[k] if k < len(at) else None

    def previous(self, i: int, blob: str) -> int | None:
        """The last node before `i` in route order that reads or writes `blob`."""
        at = self.at.get(blob, [])
        k = bisect.bisect_left(at, i)
        return at[k - 1] if k else None

    def renamed(self, nodes: list["Node"], changed: tuple[int, ...], old: str, new: str) -> None:
        """Nodes `changed` (ascending) now name `new` where they named `old`."""
        self.at[new] = list(changed)
        self.at[old] = [i for i in self.at[old] if i not in changed or old in nodes[i].bottoms or old in nodes[i].tops]


def _in_place_on(node: "Node", blob: str) -> bool:
    return node.bottoms == [blob] and node.tops == [blob]


def _is_fusable_scale(bn: "Node", node: "Node", blob: str) -> bool:
    if node.layer.type_name != "Scale" or not _in_place_on(node, blob) or node.need_backward != bn.need_backward:
        return False
    layer, norm = cast("Scale", node.layer), cast("BatchNorm", bn.layer)
    if layer.scale is None or layer.bias is None:
        return False
    return (layer.outer, layer.dim, layer.inner) == (norm.outer, norm.channels, norm.inner) \
        and layer.scale.shape == (norm.channels,)


def _is_fusable_relu(owner: "Node", node: "Node", blob: str) -> bool:
    return (node.layer.type_name == "ReLU" and _in_place_on(node, blob) and cast("ReLU", node.layer).slope >= 0
            and node.need_backward == owner.need_backward)
