""".caffemodel files: a Net's weights as a NetParameter whose layers carry their blobs.

Saving writes what Caffe's Net::ToProto writes: every layer of the (filtered, split-inserted)
net in prototxt order, with its full LayerParameter and its blobs (shape + float data).
Loading matches layers by name as Caffe's CopyTrainedLayersFrom does: source layers the net
lacks are ignored, and a blob count or shape disagreement is an error naming both shapes.
Unlike Caffe, the result also lists the net's layers that the file did not cover, so a renamed
layer training from scratch is visible rather than silent.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from superneurons.errors import UserError
from superneurons.io.prototxt import read_binary, write_binary
from superneurons.proto import superneurons_pb2 as pb


def array_to_blob(array: np.ndarray, blob: pb.BlobProto) -> pb.BlobProto:
    blob.Clear()
    blob.shape.dim.extend(int(d) for d in array.shape)
    blob.data.extend(np.asarray(array, dtype=np.float32).ravel().tolist())
    return blob


def blob_shape(blob: pb.BlobProto) -> tuple[int, ...]:
    """A blob's shape: `shape` if set, else the legacy (num, channels, height, width)."""
    if blob.HasField("shape"):
        return tuple(int(d) for d in blob.shape.dim)
    return (blob.num, blob.channels, blob.height, blob.width)


def blob_to_array(blob: pb.BlobProto, where: str = "") -> np.ndarray:
    values = blob.double_data if len(blob.double_data) else blob.data
    shape = blob_shape(blob)
    n = int(np.prod(shape)) if shape else 1
    if len(values) != n:
        raise UserError(f"{where}: blob of shape {_fmt(shape)} holds {len(values)} values, expected {n}")
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _shapes_match(target: tuple[int, ...], blob: pb.BlobProto) -> bool:
    if blob.HasField("shape"):
        return target == blob_shape(blob)
    # Legacy 4-D blobs match a target of up to 4 axes padded with leading 1s (Caffe's ShapeEquals).
    if len(target) > 4:
        return False
    return (1,) * (4 - len(target)) + tuple(target) == blob_shape(blob)


def _param_source(decl: Any) -> Any:
    while getattr(decl, "owner", None) is not None:
        decl = decl.owner
    return decl


def net_to_proto(net: Any) -> pb.NetParameter:
    """The net's layers in prototxt order with their current weights, as Caffe's Net::ToProto."""
    net.bind_params()
    out = pb.NetParameter(name=net.name)
    for node in net.layers_in_prototxt_order():
        lp = out.layer.add()
        lp.CopyFrom(node.layer.param)
        del lp.blobs[:]
        for decl in node.layer.params:
            array_to_blob(net.backend.to_host(_param_source(decl).data), lp.blobs.add())
    return out


def save_weights(net: Any, path: str) -> None:
    """Write the net's weights to `path` (atomically: a reader never sees half a file)."""
    try:
        write_binary(path, net_to_proto(net))
    except OSError as e:
        raise UserError(f"{path}: cannot write the weights ({e.strerror or e})") from None


@dataclass
class LoadReport:
    copied: list[str] = field(default_factory=list)  # layers whose blobs were copied
    ignored: list[str] = field(default_factory=list)  # layers in the file, not in the net
    missing: list[str] = field(default_factory=list)  # layers with params in the net, not in the file

    def lines(self, path: str) -> list[str]:
        out = [f"Copied weights of {len(self.copied)} layer(s) from {path}"]
        if self.ignored:
            out.append(f"Ignoring source layer(s) not in the net: {', '.join(self.ignored)}")
        if self.missing:
            out.append(f"Layer(s) keeping their initial weights (not in {path}): {', '.join(self.missing)}")
        return out


def read_weights(path: str) -> pb.NetParameter:
    if path.endswith((".h5", ".hdf5")):
        raise UserError(f"{path}: HDF5 weights are not supported yet; use a binary .caffemodel")
    return read_binary(path, pb.NetParameter())


def load_weights(net: Any, source: str | pb.NetParameter) -> LoadReport:
    """Copy blobs from a .caffemodel (path or parsed NetParameter) into `net`, matching layers by name."""
    path = source if isinstance(source, str) else "<weights>"
    model = read_weights(source) if isinstance(source, str) else source
    net.bind_params()
    nodes = {node.name: node for node in net.graph.nodes}
    report = LoadReport()
    seen = set()
    for lp in model.layer:
        node = nodes.get(lp.name)
        if node is None:
            if len(lp.blobs):
                report.ignored.append(lp.name)
            continue
        seen.add(lp.name)
        decls = node.layer.params
        if len(lp.blobs) != len(decls):
            if not len(lp.blobs):
                continue  # a layer saved without weights (Caffe writes none for parameterless layers)
            raise UserError(f"{path}: layer {lp.name!r} has {len(lp.blobs)} blob(s) in the file, "
                            f"the net's layer has {len(decls)}")
        for k, (blob, decl) in enumerate(zip(lp.blobs, decls)):
            if not _shapes_match(decl.shape, blob):
                raise UserError(
                    f"{path}: cannot copy param {k} of layer {lp.name!r}: shape mismatch, file has "
                    f"{_fmt(blob_shape(blob))}, net has {_fmt(decl.shape)}. To learn this layer from scratch "
                    "instead, rename the layer.")
        for k, (blob, decl) in enumerate(zip(lp.blobs, decls)):
            values = blob_to_array(blob, f"{path}: layer {lp.name!r} param {k}").reshape(decl.shape)
            net.backend.from_host(_param_source(decl).data, values)
        if decls:
            report.copied.append(lp.name)
    report.missing = [n.name for n in net.layers_in_prototxt_order() if n.layer.params and n.name not in seen]
    return report


def load_weights_files(net: Any, paths: str) -> list[str]:
    """`--weights a.caffemodel,b.caffemodel`: load each in turn; returns the report lines."""
    lines: list[str] = []
    for path in (p.strip() for p in paths.split(",") if p.strip()):
        if not os.path.exists(path):
            raise UserError(f"{path}: no such weights file")
        lines.extend(load_weights(net, path).lines(path))
    return lines


def _fmt(shape) -> str:
    return "(" + " ".join(str(d) for d in shape) + ")"
