"""pycaffe's `caffe.draw`: a picture of a net (a NetParameter) through Graphviz.

Layers are boxes labelled with their name and type (convolutions and poolings also with kernel, stride
and pad), blobs are octagons, edges run bottom -> layer -> top. `net_to_dot` gives the Graphviz text and
needs nothing; `get_pydot_graph` needs pydot, `draw_net`/`draw_net_to_file` pydot or Graphviz's `dot`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from superneurons.errors import UserError, UserValueError
from superneurons.proto import superneurons_pb2 as pb

LAYER_STYLE = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
_COLORS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900", "InnerProduct": "#CC33FF"}


def _included(layer: pb.LayerParameter, phase: int | None) -> bool:
    """pycaffe's rule for pictures: any include rule of the phase admits a layer, an exclude rule of it drops it."""
    if phase is None:
        return True
    included = not len(layer.include) or any(rule.phase == phase for rule in layer.include)
    return included and not any(rule.phase == phase for rule in layer.exclude)


def _layer_label(layer: pb.LayerParameter, separator: str, display_lrm: bool) -> str:
    label = f"{layer.name}{separator}({layer.type})"
    if layer.type in ("Convolution", "Deconvolution"):
        p = layer.convolution_param
        kernel = p.kernel_size[0] if len(p.kernel_size) else p.kernel_h or 1
        stride = p.stride[0] if len(p.stride) else p.stride_h or 1
        pad = p.pad[0] if len(p.pad) else p.pad_h or 0
        label += f"{separator}kernel size: {kernel}{separator}stride: {stride}{separator}pad: {pad}"
    elif layer.type == "Pooling":
        p = layer.pooling_param
        label += (f"{separator}{pb.PoolingParameter.PoolMethod.Name(p.pool)}{separator}kernel size: "
                  f"{p.kernel_size or p.kernel_h}{separator}stride: {p.stride or p.stride_h}{separator}"
                  f"pad: {p.pad or p.pad_h}")
    if display_lrm and len(layer.param):
        label += separator + "lr mult: " + ", ".join(f"{q.lr_mult:g}" for q in layer.param)
    return label


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(attrs: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k}={_quote(str(v))}" for k, v in attrs.items()) + "]"


def _edge_label(layer: pb.LayerParameter) -> str:
    """What the edges out of a layer say: the batch size of a Data layer, the outputs of a conv or fc layer."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def net_to_dot(net: pb.NetParameter, rankdir: str = "LR", phase: int | None = None,
               display_lrm: bool = False, label_edges: bool = True) -> str:
    """The Graphviz (dot) text of the net: `phase` (caffe.TRAIN/TEST) keeps only that phase's layers. An
    in-place layer's edges go from its blob back to the same blob, as in pycaffe's pictures."""
    if rankdir not in ("LR", "TB", "BT", "RL"):
        raise UserError(f"caffe.draw: rankdir must be LR, TB, BT or RL, got {rankdir!r}")
    separator = " " if rankdir in ("TB", "BT") else "\n"
    nodes: dict[str, dict[str, str]] = {}
    edges: list[tuple[str, str, str]] = []
    for layer in net.layer:
        if not _included(layer, phase):
            continue
        node = f"{layer.name}_{layer.type}"
        nodes[node] = dict(LAYER_STYLE, fillcolor=_COLORS.get(layer.type, LAYER_STYLE["fillcolor"]),
                           label=_layer_label(layer, separator, display_lrm))
        for bottom in layer.bottom:
            nodes[bottom + "_blob"] = dict(BLOB_STYLE, label=bottom)
            edges.append((bottom + "_blob", node, ""))
        for top in layer.top:
            nodes[top + "_blob"] = dict(BLOB_STYLE, label=top)
            edges.append((node, top + "_blob", _edge_label(layer) if label_edges else ""))
    lines = [f"digraph {_quote(net.name or 'Net')} {{", f"  graph [rankdir={rankdir}];"]
    lines += [f"  {_quote(name)} {_attrs(attrs)};" for name, attrs in nodes.items()]
    lines += [f"  {_quote(src)} -> {_quote(dst)}" + (f" {_attrs({'label': label})}" if label else "") + ";"
              for src, dst, label in edges]
    return "\n".join(lines + ["}"]) + "\n"


def get_pydot_graph(caffe_net: pb.NetParameter, rankdir: str = "LR", label_edges: bool = True,
                    phase: int | None = None, display_lrm: bool = False) -> Any:
    """The net as a pydot graph."""
    try:
        import pydot
    except ImportError:
        raise UserError("caffe.draw.get_pydot_graph needs pydot (pip install pydot) and Graphviz") from None
    (graph,) = pydot.graph_from_dot_data(net_to_dot(caffe_net, rankdir, phase, display_lrm, label_edges))
    return graph


def draw_net(caffe_net: pb.NetParameter, rankdir: str = "LR", ext: str = "png", phase: int | None = None,
             display_lrm: bool = False) -> bytes:
    """The picture as bytes in format `ext` (png, svg, pdf, ... whatever Graphviz writes)."""
    text = net_to_dot(caffe_net, rankdir, phase, display_lrm)
    if ext == "dot":
        return text.encode()
    try:
        import pydot  # noqa: F401
    except ImportError:
        pydot = None
    if pydot is not None and shutil.which("dot"):
        return get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm).create(format=ext)
    dot = shutil.which("dot")
    if dot is None:
        raise UserError("caffe.draw needs Graphviz's `dot` program (e.g. apt-get install graphviz; pip install "
                        "pydot) to render a picture; draw_net(..., ext='dot') and net_to_dot() give the text")
    done = subprocess.run([dot, f"-T{ext}"], input=text.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise UserError(f"caffe.draw: dot -T{ext} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def draw_net_to_file(caffe_net: pb.NetParameter, filename: str, rankdir: str = "LR", phase: int | None = None,
                     display_lrm: bool = False) -> None:
    """Write the picture; the format is the file's extension (net.png, net.svg, net.dot)."""
    ext = os.path.splitext(str(filename))[1].lstrip(".") or "png"
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(data)


# pycaffe's helpers of caffe.draw, which scripts drawing their own pictures call.
def get_pooling_types_dict() -> dict[int, str]:
    """Pooling method number -> name (0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC')."""
    return {v.number: v.name for v in pb.PoolingParameter.PoolMethod.DESCRIPTOR.values}


def get_edge_label(layer: pb.LayerParameter) -> str:
    """The label of the edges out of `layer` ('""', an empty dot label, when it has none)."""
    return _edge_label(layer) or '""'


def get_layer_lr_mult(layer: pb.LayerParameter) -> tuple[float, float]:
    """The (weights, bias) learning-rate multipliers of a Convolution, Deconvolution or InnerProduct layer."""
    if layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        raise UserValueError(f"{layer.type} layers do not have a learning rate multiplier (layer {layer.name!r})")
    if len(layer.param) > 2:
        raise UserValueError(f"layer {layer.name!r}: {len(layer.param)} param entries; expected at most 2 "
                             "(weights, bias)")
    mults = [p.lr_mult for p in layer.param] + [1.0] * (2 - len(layer.param))
    return mults[0], mults[1]


def get_layer_label(layer: pb.LayerParameter, rankdir: str, display_lrm: bool = False) -> str:
    """The text of `layer`'s box: name, type, and kernel/stride/pad for convolutions and poolings (one line
    each, or space-separated for a top-to-bottom picture)."""
    return _layer_label(layer, " " if rankdir in ("TB", "BT") else "\n", display_lrm)


def choose_color_by_layertype(layertype: str) -> str:
    """The box colour of a layer type: convolutions red, poolings orange, inner products purple, else blue."""
    return _COLORS.get(layertype, LAYER_STYLE["fillcolor"])
