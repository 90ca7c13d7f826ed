"""Graph passes that fuse a layer with the in-place layers after it, so fewer passes cross the activations.

**BatchNorm -> Scale (-> ReLU)** (`fuse_batch_norm_chains`). ResNet-style nets follow almost every
convolution with `BatchNorm` (in place or not), then a per-channel `Scale` with bias in place on the
BatchNorm's top, then usually a `ReLU` in place on the same blob. Run separately they make 6-8 passes over
the activation each way and copy it twice for backward; fused (backend op `bn_affine_forward/backward`)
they make two each way and keep one copy: the BatchNorm's input x, from which backward normalizes x_hat again.
The zoo writes the chain in place on the convolution's top, so the pass gives the convolution a top of its
own (`<blob>/bn_input`, `Graph.internal_blobs`) and the BatchNorm writes y into the blob the net names;
without a producer to split from (in place on a net input, say) the BatchNorm keeps x_hat instead, which
forward writes beside y: one pass more. pycaffe shows the prototxt's blob names, and a range that runs the
convolution without the BatchNorm (or the other way round) is refused, as for the fused pairs below.

**Eltwise SUM -> ReLU** (`fuse_eltwise_relu`). A ResNet's residual joins sum two blobs and apply a ReLU in
place on the sum. Fused (backend op `eltwise_sum_relu(_backward)`), forward is one pass (read the bottoms,
write relu(sum)) and backward one pass (read y and dy, write every bottom gradient the Eltwise writes);
separately, the ReLU reads and writes the sum again, and its gradient again. The Eltwise then needs its top
for backward (the ReLU's mask) instead of the ReLU; a replay of its forward (recomputation) rebuilds relu(sum).

**Convolution -> ReLU** (`fuse_conv_relu`). VGG, AlexNet and SqueezeNet-style nets follow nearly every
convolution with a ReLU in place on its top. Fused (backend op `conv_relu_forward`), the forward adds the bias
and applies the ReLU in one pass after the convolution (instead of a bias pass and a ReLU pass); a replay of
its forward (recomputation) rebuilds relu(conv). The backward is not fused: the ReLU's gradient stays in the
ReLU's step (`Layer.runs_absorbed_backward`), because masking it in the convolution's step needs the top
there beside the bottom, a larger per-step peak for offload and recompute (VGG16's grew from 1176 to 1568
MiB when it was tried), and memory is what this runtime is for. Deconvolution and InnerProduct stay unfused.

**ReLU -> max Pooling, backward** (`fuse_relu_backward_into_max_pool`). VGG, AlexNet and SqueezeNet pool
the output of a ReLU in place on a convolution's top. The pooling's backward routes each gradient to its
window's chosen pixel; fused, it also applies the ReLU's mask there (op `pool_backward` with `relu_slope`):
a chosen pixel holds its window's maximum, whose sign the forward keeps in the argmax buffer (~argmax where
the maximum is not above 0: `pool_forward`'s `signed_mask`), and the pixels no window chose get no gradient
either way. The ReLU's backward step (a pass reading the activation and its gradient, writing the gradient)
then does nothing, and nothing reads the activation in backward any more, so liveness frees it after the
pooling's forward: VGG16's liveness peak falls by a third. The ReLU's forward is untouched (fused into the
convolution or not). Only for a ReLU whose backward runs in its own step (not one a BatchNorm or Eltwise
owns) that propagates to its bottom, in place, with negative_slope >= 0, whose output a max Pooling with
one top (no mask top, which holds Caffe's plain argmax) is the only and last reader of, and only where the
pooling shrinks the activation: recompute may keep the argmax buffer where it used to keep the activation.

**ReLU -> Concat, backward** (`concat_slice_readers`). GoogLeNet and SqueezeNet join the outputs of ReLUs
in place on convolutions' tops. The Concat's backward copies each bottom's slice of its top gradient out,
and the ReLU's then reads that copy and writes it masked; fused, the ReLU's backward reads its slice of the
Concat's top gradient itself (op `relu_backward_slab`, the same bits) and the Concat copies nothing for that
bottom: a pass over the gradient less per joined ReLU, SqueezeNet's whole Concat backward. The planner and
the Net take a step's gradient reads from `Node.top_gradient_blobs` and `Node.bottom_gradients_written`, so
they agree that the ReLU's step reads the Concat's top gradient. Only under `baseline`, where every tensor
stays resident and the fusion costs no memory (memory.make_manager turns it on, `Graph.use_concat_slices`,
once the mode is known): the Concat's top gradient then lives until the ReLU's step, beside the ReLU's
output and gradient, which under recompute is a replayed output (SqueezeNet's widest batch under 12 GiB
fell from 1784 to 1624 by the planner with it on in every mode). Only for a ReLU whose backward runs in its own step, in place on a blob it writes last
before the Concat, which reads it once and is its last reader, with negative_slope >= 0, both running
backward into that bottom.

A layer is fused only when the fused layer computes exactly what the separate layers did:
- each layer's output is read by the next layer of the chain and by nothing else: in route order, the
  next layer touching the first layer's top blob is the next of the chain (BatchNorm: the Scale, then the
  ReLU; Eltwise, Convolution: the ReLU), in place on it, so there is nothing else to write;
- the Scale multiplies by a learned per-channel vector (one bottom, axis 1, C values) and adds a bias;
  the Eltwise is a SUM (any coefficients) with one top; the Convolution has one top (any bias, group,
  dilation);
- the ReLU's negative_slope is >= 0 (its mask is then "pre-activation > 0", and "output > 0");
- all of them agree on whether they run backward (the BatchNorm's backward computes the Scale's
  parameter gradients, so it must run exactly when the Scale's would; the fused layer's backward does
  the ReLU's).

Params stay owned by their layers (caffemodel files and the solver see no change); the absorbed Scale and
ReLU stay in the graph as pass-through steps, so logs and the profiler list Caffe's layers.
graph.build runs all five unless the memory policy's `fuse_layers` is off (memory_param, SUPERNEURONS_FUSE=0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from superneurons.layers.base import GradientSlice, count
from superneurons.proto import superneurons_pb2 as pb

from superneurons.graph.node import Node

if TYPE_CHECKING:
    from superneurons.layers.base import Layer


def fuse_batch_norm_chains(nodes: list["Node"], shapes: dict[str, tuple[int, ...]],
                           internal_blobs: dict[str, str]) -> list[tuple[str, ...]]:
    """Fuse every eligible chain in `nodes` (route order); returns the fused chains' layer names. A fused
    BatchNorm in place on its producer's top is taken out of place (`_separate_input`): the new blobs go
    into `shapes` and `internal_blobs` (new name -> the blob it was split from)."""
    fused = []
    for i, bn in enumerate(nodes):
        if bn.layer.type_name != "BatchNorm" or len(bn.tops) != 1:
            continue
        blob = bn.tops[0]
        j = _next_toucher(nodes, i, blob)
        if j is None or not _is_fusable_scale(bn, nodes[j], blob):
            continue
        scale = nodes[j]
        k = _next_toucher(nodes, j, blob)
        relu = nodes[k] if k is not None and _is_fusable_relu(bn, nodes[k], blob) else None
        # Nets of the TEST phase never run backward (runtime.Net(train=phase == TRAIN)): keep nothing.
        keep = bn.need_backward and bn.layer.phase == pb.TRAIN
        separate = keep and _separate_input(nodes, i, shapes, internal_blobs)
        bn.layer.fuse_affine(scale.layer, relu.layer if relu is not None else None, keep_for_backward=keep,
                             separate_bottom=separate)
        fused.append(tuple(n.name for n in (bn, scale, relu) if n is not None))
    return fused


def _separate_input(nodes: list["Node"], i: int, shapes: dict[str, tuple[int, ...]],
                    internal_blobs: dict[str, str]) -> bool:
    """Take BatchNorm node `i` out of place where the layer before it on its blob made the blob: that
    producer's top and the BatchNorm's bottom become a new blob, `<blob>/bn_input`. The BatchNorm then
    keeps its input for backward instead of writing x_hat beside y (one pass less forward, the same bytes
    kept), and the two gradients still share memory (BatchNorm.diff_in_place_bottoms). Not where the
    producer is a net input, or writes the blob in place or as a view of its own bottom."""
    bn = nodes[i]
    blob = bn.tops[0]
    if not _in_place_on(bn, blob):
        return False
    j = _previous_toucher(nodes, i, blob)
    if j is None:
        return False
    producer = nodes[j]
    # A layer without bottoms makes a net input (Input, Data, ...), which the caller fills by its name.
    if not producer.bottoms or blob in producer.bottoms or producer.tops.count(blob) != 1 \
            or producer.layer.views_bottom_data or producer.layer.fused_into is not None:
        return False
    name, n = f"{blob}/bn_input", 1
    while name in shapes:
        n += 1
        name = f"{blob}/bn_input{n}"
    producer.tops[producer.tops.index(blob)] = name
    bn.bottoms[0] = name
    shapes[name] = shapes[blob]
    internal_blobs[name] = blob
    return True


def fuse_eltwise_relu(nodes: list["Node"]) -> list[tuple[str, str]]:
    """Fuse every Eltwise SUM whose top is next touched by an in-place ReLU; returns (eltwise, relu) names."""
    return _fuse_trailing_relu(nodes, lambda layer: layer.type_name == "Eltwise"
                               and layer.op == pb.EltwiseParameter.SUM)


def fuse_conv_relu(nodes: list["Node"]) -> list[tuple[str, str]]:
    """Fuse every Convolution whose top is next touched by an in-place ReLU; returns (convolution, relu) names."""
    return _fuse_trailing_relu(nodes, lambda layer: layer.type_name == "Convolution")


def fuse_relu_backward_into_max_pool(nodes: list["Node"]) -> list[tuple[str, str]]:
    """Give every eligible ReLU's backward to the max Pooling that reads its output; returns (relu, pooling)
    names."""
    fused = []
    for i, relu in enumerate(nodes):
        if relu.layer.type_name != "ReLU" or len(relu.tops) != 1 or not relu.need_backward \
                or not relu.propagate_down[0]:
            continue
        blob = relu.tops[0]
        owner = relu.layer.fused_into
        if not _in_place_on(relu, blob) or relu.layer.slope < 0 \
                or (owner is not None and owner.runs_absorbed_backward):
            continue
        j = _next_toucher(nodes, i, blob)
        if j is None or _next_toucher(nodes, j, blob) is not None:
            continue  # the pooling must be the blob's last reader
        pool = nodes[j]
        if pool.layer.type_name != "Pooling" or pool.layer.geom.method != "max" or pool.bottoms != [blob] \
                or len(pool.tops) != 1 or not pool.need_backward or not pool.propagate_down[0]:
            continue
        if count(pool.top_shapes[0]) >= count(nodes[i].top_shapes[0]):
            continue  # its argmax buffer, which replays may keep instead of the activation, would be no smaller
        pool.layer.take_relu_backward(relu.layer)
        fused.append((relu.name, pool.name))
    return fused


def concat_slice_readers(nodes: list["Node"]) -> list[tuple["Layer", GradientSlice, int]]:
    """(ReLU, where it would read its gradient, the Concat's bottom index) for every ReLU eligible to read
    its gradient from the slice of the Concat top that joins its output. Nothing is changed here:
    memory.make_manager turns them on under baseline only (`Graph.use_concat_slices`, see the module
    docstring)."""
    found = []
    for i, concat in enumerate(nodes):
        layer = concat.layer
        if layer.type_name != "Concat" or not concat.need_backward or len(concat.tops) != 1 \
                or concat.tops[0] in concat.bottoms:
            continue
        for j, blob in enumerate(concat.bottoms):
            if not concat.propagate_down[j] or concat.bottoms.count(blob) != 1 \
                    or _next_toucher(nodes, i, blob) is not None:
                continue  # the Concat must read the blob once, and last
            k = _previous_toucher(nodes, i, blob)
            if k is None:
                continue
            relu = nodes[k]
            owner = relu.layer.fused_into
            if relu.layer.type_name != "ReLU" or not _in_place_on(relu, blob) or relu.layer.slope < 0 \
                    or not relu.need_backward or not relu.propagate_down[0] \
                    or (owner is not None and owner.runs_absorbed_backward) \
                    or relu.layer.backward_taken_by is not None:
                continue
            found.append((relu.layer, GradientSlice(layer, concat.tops[0], layer.axis, layer.offsets[j]), j))
    return found


def _fuse_trailing_relu(nodes: list["Node"], owns: Callable[["Layer"], bool]) -> list[tuple[str, str]]:
    """Fold into every layer that `owns` accepts (one with `fuse_relu`) the ReLU that next touches its one top."""
    fused = []
    for i, node in enumerate(nodes):
        if not owns(node.layer) or len(node.tops) != 1:
            continue
        blob = node.tops[0]
        j = _next_toucher(nodes, i, blob)
        if j is not None and _is_fusable_relu(node, nodes[j], blob):
            node.layer.fuse_relu(nodes[j].layer)
            fused.append((node.name, nodes[j].name))
    return fused


def _next_toucher(nodes: list["Node"], i: int, blob: str) -> int | None:
    """The first node after `i` in route order that reads or writes `blob`."""
    for j in range(i + 1, len(nodes)):
        if blob in nodes[j].bottoms or blob in nodes[j].tops:
            return j
    return None


def _previous_toucher(nodes: list["Node"], i: int, blob: str) -> int | None:
    """The last node before `i` in route order that reads or writes `blob`."""
    for j in range(i - 1, -1, -1):
        if blob in nodes[j].bottoms or blob in nodes[j].tops:
            return j
    return None


def _in_place_on(node: "Node", blob: str) -> bool:
    return node.bottoms == [blob] and node.tops == [blob]


def _is_fusable_scale(bn: "Node", node: "Node", blob: str) -> bool:
    layer = node.layer
    if layer.type_name != "Scale" or not _in_place_on(node, blob) or node.need_backward != bn.need_backward:
        return False
    if layer.scale is None or layer.bias is None:
        return False
    return (layer.outer, layer.dim, layer.inner) == (bn.layer.outer, bn.layer.channels, bn.layer.inner) \
        and layer.scale.shape == (bn.layer.channels,)


def _is_fusable_relu(owner: "Node", node: "Node", blob: str) -> bool:
    return (node.layer.type_name == "ReLU" and _in_place_on(node, blob) and node.layer.slope >= 0
            and node.need_backward == owner.need_backward)
