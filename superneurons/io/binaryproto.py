"""`.binaryproto` files: one serialized BlobProto, the format Caffe stores mean images in."""
from __future__ import annotations

import numpy as np

from superneurons.errors import UserError
from superneurons.io.caffemodel import blob_to_array
from superneurons.io.prototxt import read_binary, write_binary
from superneurons.proto import superneurons_pb2 as pb


def array_to_blob(array: np.ndarray) -> pb.BlobProto:
    """4-D arrays are written with the legacy num/channels/height/width fields, which every Caffe reads,
    other ranks with `shape`."""
    array = np.asarray(array, dtype=np.float32)
    blob = pb.BlobProto()
    if array.ndim == 4:
        blob.num, blob.channels, blob.height, blob.width = (int(d) for d in array.shape)
    else:
        blob.shape.dim.extend(int(d) for d in array.shape)
    blob.data.extend(array.ravel().tolist())
    return blob


def read_blob(path: str) -> np.ndarray:
    return blob_to_array(read_binary(path, pb.BlobProto()), path)


def write_blob(path: str, array: np.ndarray) -> None:
    write_binary(path, array_to_blob(array))


def read_mean(path: str) -> np.ndarray:
    """A mean image as (C, H, W); Caffe writes it as a (1, C, H, W) blob."""
    mean = read_blob(path)
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise UserError(f"{path}: a mean file holds one (1, C, H, W) image; this blob has shape {mean.shape}")
    return mean


def write_mean(path: str, mean: np.ndarray) -> None:
    """Write a (C, H, W) mean image as Caffe does: a (1, C, H, W) blob."""
    write_blob(path, np.asarray(mean)[None])
