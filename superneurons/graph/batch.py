"""Changing a net's batch size in place (`--batch` for summary, memory, time)."""
from __future__ import annotations

from superneurons.proto import superneurons_pb2 as pb


def set_batch(net: pb.NetParameter, batch: int) -> None:
    """Set the leading dimension of every data-producing layer of `net` to `batch`."""
    for layer in net.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
        elif layer.type == "DummyData":
            p = layer.dummy_data_param
            for shape in p.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
            for i in range(len(p.num)):
                p.num[i] = batch
        elif layer.type == "Data":
            layer.data_param.batch_size = batch
        elif layer.type == "ImageData":
            layer.image_data_param.batch_size = batch
        elif layer.type == "MemoryData":
            layer.memory_data_param.batch_size = batch
        elif layer.type == "HDF5Data":
            layer.hdf5_data_param.batch_size = batch
