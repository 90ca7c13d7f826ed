""".caffemodel files: a Net's weights as a NetParameter whose layers carry their blobs.

Saving writes what Caffe's Net::ToProto writes: every layer of the (filtered, split-inserted)
net in prototxt order, with its full LayerParameter and its blobs (shape + float data).
Loading matches layers by name as Caffe's CopyTrainedLayersFrom does: source layers the net
lacks are ignored, and a blob count or shape disagreement is an error naming both shapes.
Unlike Caffe, the result also lists the net's layers that the file did not cover, so a renamed
layer training from scratch is visible rather than silent.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from superneurons.dtypes import BFLOAT16, tensor_bytes
from superneurons.errors import UserError
from superneurons.io.prototxt import open_temp_beside, read_binary, write_binary
from superneurons.io.upgrade import upgrade_net
from superneurons.proto import superneurons_pb2 as pb


_DATA_TAG = bytes([(pb.BlobProto.DATA_FIELD_NUMBER << 3) | 2])  # field `data`, wire type: length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def array_to_blob(array: np.ndarray, blob: pb.BlobProto) -> pb.BlobProto:
    """`blob` = shape + float data of `array` (Blob::ToProto without the diff)."""
    blob.Clear()
    blob.shape.dim.extend(int(d) for d in array.shape)
    # The packed `data` field is the raw little-endian floats; parsing them is ~20x faster than
    # extending the repeated field from a Python list, which matters for 100 MB models.
    raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    if raw:
        blob.MergeFromString(_DATA_TAG + _varint(len(raw)) + raw)
    return blob


def blob_shape(blob: pb.BlobProto) -> tuple[int, ...]:
    """A blob's shape: `shape` if set, else the legacy (num, channels, height, width)."""
    if blob.HasField("shape"):
        return tuple(int(d) for d in blob.shape.dim)
    return (blob.num, blob.channels, blob.height, blob.width)


# NVCaffe's `raw_data`: little-endian elements of `raw_data_type`.
_RAW_TYPES = {pb.DOUBLE: np.dtype("<f8"), pb.FLOAT: np.dtype("<f4"), pb.FLOAT16: np.dtype("<f2"),
              pb.BFLOAT16: BFLOAT16}


def blob_to_array(blob: pb.BlobProto, where: str = "") -> np.ndarray:
    """The blob's values in its shape (float32); a negative dimension or a count that disagrees with the
    shape is an error naming `where` (Python integers: a product beyond int64 cannot wrap into a match).
    Values come from `double_data`, `data`, or NVCaffe's `raw_data` in its `raw_data_type` (FLOAT16 included)."""
    shape = blob_shape(blob)
    if any(d < 0 for d in shape):
        raise UserError(f"{where}: blob has a negative dimension in its shape {_fmt(shape)}")
    n = math.prod(shape)
    if blob.HasField("raw_data"):
        kind = blob.raw_data_type if blob.HasField("raw_data_type") else pb.FLOAT
        if kind not in _RAW_TYPES:
            raise UserError(f"{where}: blob's raw_data_type is {pb.Type.Name(kind)}; weights are read from "
                            f"{', '.join(pb.Type.Name(t) for t in _RAW_TYPES)}")
        dtype = _RAW_TYPES[kind]
        if len(blob.raw_data) != tensor_bytes(shape, dtype):
            raise UserError(f"{where}: the blob's shape {_fmt(shape)} needs {n} {pb.Type.Name(kind)} values "
                            f"({tensor_bytes(shape, dtype)} bytes) but its raw_data holds {len(blob.raw_data)} bytes")
        return np.frombuffer(blob.raw_data, dtype=dtype).astype(np.float32).reshape(shape)
    double = len(blob.double_data) > 0
    values = blob.double_data if double else blob.data
    if len(values) != n:
        raise UserError(f"{where}: the blob's shape {_fmt(shape)} needs {n} values but it holds {len(values)}")
    return np.asarray(values, dtype=np.float64 if double else np.float32).astype(np.float32, copy=False).reshape(shape)


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
        if node.layer.part_of is not None:
            continue  # a step of an unrolled layer: the layer of the prototxt holds its weights
        lp = out.layer.add()
        lp.CopyFrom(node.layer.prototxt_param)
        del lp.blobs[:]
        for decl in node.layer.params:
            array_to_blob(net.backend.to_host(_param_source(decl).data), lp.blobs.add())
    return out


def is_hdf5(path: str) -> bool:
    return path.endswith((".h5", ".hdf5"))


def save_weights(net: Any, path: str, hdf5: bool | None = None) -> None:
    """Write the net's weights to `path` (atomically: a reader never sees half a file); `.h5` writes HDF5
    (`hdf5`: HDF5 or not whatever the name, pycaffe's save_hdf5)."""
    try:
        if is_hdf5(path) if hdf5 is None else hdf5:
            write_hdf5_atomic(path, lambda f: _proto_to_hdf5(net_to_proto(net), f))
        else:
            write_binary(path, net_to_proto(net))
    except OSError as e:
        raise UserError(f"{path}: cannot write the weights ({e.strerror or e})") from None


def require_h5py():
    try:
        import h5py
    except ImportError:
        raise UserError("HDF5 snapshots need the h5py package (pip install h5py)") from None
    return h5py


def write_hdf5_atomic(path: str, fill_file: Callable[[Any], None]) -> None:
    """Create an HDF5 file whole or not at all: written under a temporary name, then renamed."""
    h5py = require_h5py()
    fd, tmp = open_temp_beside(path, suffix=".h5")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            fill_file(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _proto_to_hdf5(model: pb.NetParameter, f: Any) -> None:
    """Caffe's Net::ToHDF5 layout: /data/<layer>/<param index> float datasets, one group per layer. HDF5 holds
    one group per name: of layers sharing a name (Caffe allows it) the first is written, the one loading
    matches by name anyway."""
    data = f.create_group("data")
    for lp in model.layer:
        if lp.name in data:
            continue
        group = data.create_group(lp.name)
        for k, blob in enumerate(lp.blobs):
            group.create_dataset(str(k), data=blob_to_array(blob, lp.name))


# What h5py raises for a damaged file: OSError when the file will not open, RuntimeError from the HDF5
# library on a corrupt object header or symbol table, KeyError/TypeError/ValueError when a dataset
# sits where a group belongs (or the reverse) or holds what cannot be converted.
HDF5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, ValueError, IndexError, OverflowError)


def _hdf5_to_proto(path: str) -> pb.NetParameter:
    h5py = require_h5py()
    model = pb.NetParameter()
    try:
        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise UserError(f"{path}: not a Caffe HDF5 model (no /data group)")
            for name, group in f["data"].items():
                lp = model.layer.add(name=name)
                for k in range(len(group)):
                    if str(k) not in group:
                        raise UserError(f"{path}: layer {name!r} lacks param dataset {k}")
                    array_to_blob(np.asarray(group[str(k)], dtype=np.float32), lp.blobs.add())
    except HDF5_ERRORS as e:
        raise UserError(f"{path}: cannot read it as a Caffe HDF5 model ({type(e).__name__}: {e})") from None
    return model


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


def read_weights(path: str, hdf5: bool | None = None) -> pb.NetParameter:
    """A .caffemodel (binary NetParameter) or Caffe's .caffemodel.h5 (`hdf5`: whatever the name), as a
    NetParameter with blobs."""
    if is_hdf5(path) if hdf5 is None else hdf5:
        if not os.path.exists(path):
            raise UserError(f"{path}: no such file")
        return _hdf5_to_proto(path)
    return read_binary(path, pb.NetParameter())


def load_weights(net: Any, source: str | pb.NetParameter) -> LoadReport:
    """Copy blobs from a .caffemodel (path or parsed NetParameter) into `net`, matching layers by name."""
    path = source if isinstance(source, str) else "<weights>"
    model = read_weights(source) if isinstance(source, str) else source
    model = upgrade_net(model, path)  # a V1 .caffemodel keeps its blobs in `layers`; current files pass through
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
    report.missing = [n.name for n in net.layers_in_prototxt_order()
                      if n.layer.params and n.name not in seen and n.layer.part_of is None]
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
