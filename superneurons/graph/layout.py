"""Which memory layout each 4-D blob is stored in on a backend: NCHW (Caffe's) or NHWC (channels last).

Layout is a backend decision: cuDNN runs its tensor-core convolutions on NHWC operands (given NCHW half
tensors it transposes around them), while the CPU keeps NCHW. Everything a user sees (pycaffe's blobs,
caffemodels, the shapes `summary` and `memory --json` print) is N,C,H,W whatever the storage: the GPU
backend's views keep the logical shape (N, C, H, W) and only their strides say channels last, and its
downloads and uploads convert at that boundary.

`choose(graph, layouts)` decides once per Net, from SUPERNEURONS_LAYOUT (`auto`: `auto_channels_last`'s
rule, measured on the zoo) and the layouts the backend stores: a blob is NHWC when it is 4-D, its producer and
every reader have a channels-last path (`Layer.channels_last`), and so has every blob tied to it: the tops of a
layer that keeps shapes (ReLU, Eltwise, Split, BatchNorm, Scale, their fused forms) share a layout with its
bottoms, because in-place tops, Split's views and the gradients memory/aliases.py lets share memory must
agree. A layer reading blobs of both layouts (the first convolution reads the data layer's NCHW batch; the
last pooling writes the NCHW blob an InnerProduct flattens) converts on the device (backend/cuda/layout.py),
and its first such call logs one line. The layers whose blobs are NHWC also keep their 4-D buffers (a
convolution's weight working copies, in the filter layout cuDNN wants then, KRSC; BatchNorm's x_hat) channels
last, and a float32 convolution whose filter is not 1x1 gets working copies it has no need of in NCHW (float32
masters, caffemodels and the solver keep KCRS). Dropout stays NCHW: its mask hashes the NCHW element index,
as the CPU's does. `release` undoes what `choose` declared on the layers, for a Net that declares itself
again in NCHW (runtime/net.py: `auto` under memory pressure).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from superneurons import settings
from superneurons.dtypes import FLOAT32

NCHW, NHWC = "NCHW", "NHWC"


@dataclass
class BlobLayouts:
    """The layout of each blob stored NHWC (others are NCHW) and of each layer's 4-D buffers."""

    blobs: dict[str, str] = field(default_factory=dict)
    layers: set[str] = field(default_factory=set)  # layers whose 4-D buffers are NHWC
    automatic: bool = False  # chosen by `auto`'s rule (not asked for with `nhwc`)
    # `auto` chose channels last because the Net's passes replay as CUDA graphs (a half-precision BatchNorm net,
    # faster so only when the host issues no kernels): a Net whose passes will run eagerly declares itself NCHW
    replay_only: bool = False
    added: list = field(default_factory=list)  # (layer, buffer name) declared for it: what `release` removes

    def blob(self, name: str) -> str:
        return self.blobs.get(name, NCHW)

    def buffer(self, layer: str, shape) -> str:
        return NHWC if layer in self.layers and len(shape) == 4 else NCHW

    @property
    def any(self) -> bool:
        return bool(self.blobs)


def _permuted(shape) -> bool:
    """Whether a 4-D filter (K, C, R, S) is stored differently KRSC than KCRS."""
    return len(shape) == 4 and shape[1] > 1 and shape[2] * shape[3] > 1


def wanted(graph, setting: str | None = None) -> bool:
    """Whether `setting` (default SUPERNEURONS_LAYOUT) asks for NHWC for this net (`auto`: decided in `choose`,
    auto_channels_last)."""
    return (setting or settings.get("SUPERNEURONS_LAYOUT")) in ("nhwc", "auto")


# `auto`'s rule, from the nine zoo nets trained in both layouts and both types (one H200 each, 2026-11-28,
# tools/gpu/speed_map.sh, docs/BENCHMARKS.md): channels last was faster where every convolution writes a
# channels-last top (no layer without a channels-last path, such as LRN, reads one), no convolution is grouped
# (cuDNN's grouped and depthwise NHWC kernels were slower: AlexNet, MobileNet), and, for a net with BatchNorm,
# in float32 only (ResNet-50/101/152 in bfloat16 tied or lost: their steps are bound by the host, and the
# channels-last dispatch adds to it). VGG16 gained 29% in float32 and 45% in bfloat16, the ResNets 11-14% in
# float32. With Concat and Slice channels last too (2026-12-02, one H200, tools/gpu/layout.sh,
# docs/BENCHMARKS.md), the Concat nets still lost in NHWC: DenseNet-121 by 30% in float32 and 14% in bfloat16
# (its step is bound by the host, and the channels-last BatchNorm launches more kernels), SqueezeNet by 2-6% in
# both types in each of three runs; Inception-v4 gained 3% or less. So a net with a Concat stays NCHW.
# Once passes replayed as CUDA graphs (runtime/graph_replay.py), the host no longer bounds the ResNets in
# bfloat16: ResNet-50 b64 ran 3365.6 img/s channels last replayed against 2989.1 NCHW (replay on), 1829.7
# channels last eagerly (2026-12-02, one H200, one call, tools/gpu/graph_replay.sh `versus` and `speed`). So a
# half-precision BatchNorm net goes channels last where its passes will replay, and only there (`replay_only`).
MEASURED_TYPES = ("float32", "bfloat16")  # float16 nets were not timed channels last: auto keeps them NCHW


def auto_channels_last(graph, blobs: dict[str, str], replayed: bool = False) -> bool:
    """Whether `auto` keeps `graph` channels last, given the blobs NHWC would make channels last and whether
    the Net's passes will replay as CUDA graphs."""
    storage = graph.precision.name()
    if not blobs or storage not in MEASURED_TYPES:
        return False
    for node in graph.nodes:
        layer = node.layer
        if layer.type_name == "Convolution" and (layer.geom.group > 1 or any(blobs.get(t) != NHWC for t in node.tops)):
            return False
        if layer.type_name == "Concat":
            return False
    return replayed or not _needs_replay(graph)


def _needs_replay(graph) -> bool:
    """Whether `auto`'s channels last pays for `graph` only when its passes replay: a half-precision net with
    BatchNorm, whose eager channels-last step is bound by the host."""
    return graph.precision.name() != "float32" and any(n.layer.type_name == "BatchNorm" for n in graph.nodes)


def _declare_conversions(graph, node, out: BlobLayouts) -> None:
    """A layer with NHWC blobs whose other 4-D blobs are NCHW converts those on the device at each call (to NHWC
    copies, backend/cuda/layout_conversion.py): it declares the bytes, every such blob's values in forward and
    its values and gradient in backward, each rounded to the room's alignment (an upper bound: an op converts
    only the arrays it is given)."""
    from superneurons.backend.base import COPY_ALIGN as ALIGN
    from superneurons.dtypes import tensor_bytes

    precision = graph.precision
    mixed = [b for b in dict.fromkeys((*node.bottoms, *node.tops))
             if len(graph.blob_shapes[b]) == 4 and out.blob(b) == NCHW]
    if not mixed:
        return

    def room(b: str, types) -> int:
        return -(-tensor_bytes(graph.blob_shapes[b], types.get(b, FLOAT32)) // ALIGN) * ALIGN

    values = sum(room(b, precision.data) for b in mixed)
    graph.step_layer(node).use_layout_copies(values, values + sum(room(b, precision.diff) for b in mixed))


def choose(graph, layouts=(NCHW,), setting: str | None = None, replayed: bool = False) -> BlobLayouts:
    """The layouts of `graph`'s blobs on a backend storing `layouts` (see the module docstring), under `setting`
    (nchw, nhwc or auto; default SUPERNEURONS_LAYOUT); `replayed`: the Net's training passes will replay as CUDA
    graphs (runtime/graph_replay.expected), which `auto`'s rule weighs."""
    setting = setting or settings.get("SUPERNEURONS_LAYOUT")
    out = BlobLayouts()
    if NHWC not in layouts or not wanted(graph, setting) or getattr(graph, "live", None) is not None:
        return out  # a Filter's live batches (runtime/live_batch.py) cut NCHW rows
    blobs = channels_last_blobs(graph)
    if setting == "auto" and not auto_channels_last(graph, blobs, replayed):
        return out
    out.blobs = blobs
    out.automatic = setting == "auto"
    out.replay_only = out.automatic and _needs_replay(graph)
    for node in graph.nodes:
        if any(out.blob(b) == NHWC for b in (*node.bottoms, *node.tops)):
            out.layers.add(node.name)
            layer = node.layer
            touched = {id(x): (x, set(x.buffers)) for x in (layer, graph.step_layer(node))}
            _declare_conversions(graph, node, out)
            # cuDNN's NHWC convolutions want the filter KRSC: a float32 layer gets working copies to hold it,
            # unless its filter is 1x1 (or of one input channel), where KRSC and KCRS are the same bytes
            if layer.data_typed_params and not any("_copy" in name for name in layer.buffers) and any(
                    _permuted(layer.params[k].shape) for k in layer.data_typed_params if k < len(layer.params)):
                layer.use_working_copies(FLOAT32)
            out.added += [(x, name) for x, before in touched.values() for name in x.buffers if name not in before]
    return out


def release(out: BlobLayouts) -> None:
    """Undo what `choose` declared on the layers for `out` (its layout copies and KRSC working copies), before
    the graph is declared again in NCHW."""
    for layer, name in out.added:
        layer.buffers.pop(name, None)
    out.added.clear()


def channels_last_blobs(graph) -> dict[str, str]:
    """The blobs NHWC makes channels last: 4-D, every layer producing or reading it (and every blob tied to it)
    with a channels-last path."""
    nodes = graph.nodes
    shapes = graph.blob_shapes
    eligible = {b: len(s) == 4 for b, s in shapes.items()}
    parent = {b: b for b in shapes}

    def find(b: str) -> str:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    for node in nodes:
        capable = bool(getattr(node.layer, "channels_last", False))
        for b in (*node.bottoms, *node.tops):
            if not capable:
                eligible[b] = False
        if capable and node.bottoms and all(shapes[b] == shapes[node.bottoms[0]] for b in (*node.bottoms, *node.tops)):
            root = find(node.bottoms[0])
            for b in (*node.bottoms[1:], *node.tops):
                parent[find(b)] = root
    group_ok: dict[str, bool] = {}
    for b, ok in eligible.items():
        r = find(b)
        group_ok[r] = group_ok.get(r, True) and ok
    return {b: NHWC for b in shapes if group_ok[find(b)]}
