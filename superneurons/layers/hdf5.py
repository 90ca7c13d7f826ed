"""HDF5Data and HDF5Output: Caffe's layers that read a net's input from, and write blobs to, HDF5 files.

HDF5Data: `hdf5_data_param { source: "train.txt" batch_size: N shuffle: B }`; the source lists `.h5`
files; top `name` is the dataset `name` of every file, its first dimension the samples. As in
Caffe there is no transformation and values become float32. Batch k is a pure function of k
(`data.hdf5_source`), so a resumed run continues exactly (`BatchPosition`). Reads are synchronous,
as Caffe's are: the rows of a file are in memory once loaded.

HDF5Output: `hdf5_output_param { file_name: "out.h5" }` writes its two bottoms as the datasets
`data` and `label`, float32 with Caffe's four legacy axes (N, C, H, W; missing axes are 1). Caffe
truncates the file when the net is built and fails on a second forward (the datasets exist);
here the file is truncated at the first forward and every later forward appends its rows.
"""
from __future__ import annotations

import os

import numpy as np

from superneurons.data.batches import Seeds
from superneurons.data.hdf5_source import Hdf5Rows
from superneurons.io.caffemodel import require_h5py
from superneurons.layers.base import Layer, register
from superneurons.layers.batch_position import BatchPosition
from superneurons.layers.source import SourceLayer

_OUTPUT_NAMES = ("data", "label")  # Caffe's HDF5_DATA_DATASET_NAME and HDF5_DATA_LABEL_NAME


@register("HDF5Data")
class HDF5Data(BatchPosition, SourceLayer):
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        p = self.param.hdf5_data_param
        if not p.source:
            raise self.fail("hdf5_data_param.source is required (a text file listing .h5 files)")
        if p.batch_size < 1:
            raise self.fail(f"hdf5_data_param.batch_size must be at least 1, got {p.batch_size}")
        self.batch_size = int(p.batch_size)
        where = f"layer {self.name!r} (HDF5Data), source {p.source!r}"
        self.rows = Hdf5Rows(p.source, list(self.param.top), where, bool(p.shuffle))
        self.next_batch = 0
        self._last: list[np.ndarray] | None = None
        return [(self.batch_size,) + self.rows.row_shapes[name] for name in self.param.top]

    def forward(self, bottom, top):
        # A recomputed forward (memory manager replaying this step) must see the same batch again.
        if not (self.ctx.recomputing and self._last is not None):
            seeds = Seeds.for_layer(self.ctx.seed, self.phase, self.layer_index)
            self._last = self.rows.batch(self.next_batch, self.batch_size, seeds)
            self.next_batch += 1
        for t, array in zip(top, self._last):
            self.ops.upload(t, array)

    def backward_needs(self):
        return frozenset()

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass

    def position_changed(self) -> None:
        self._last = None


def legacy_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """Caffe's (num, channels, height, width) view of a blob of at most four axes."""
    return tuple(shape) + (1,) * (4 - len(shape))  # type: ignore[return-value]


@register("HDF5Output")
class HDF5Output(Layer):
    has_backward = False
    n_bottoms = (2, 2)
    n_tops = (0, 0)

    def setup(self, bottom_shapes):
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.fail("hdf5_output_param.file_name is required (the .h5 file to write)")
        for name, shape in zip(_OUTPUT_NAMES, bottom_shapes):
            if not 1 <= len(shape) <= 4:
                raise self.fail(f"bottom {name!r} has {len(shape)} axes; Caffe's HDF5Output writes blobs of "
                                f"1 to 4 axes")
        if bottom_shapes[0][0] != bottom_shapes[1][0]:
            raise self.fail(f"the bottoms have {bottom_shapes[0][0]} and {bottom_shapes[1][0]} samples; they must "
                            f"have the same first dimension")
        self.shapes = [legacy_shape(s) for s in bottom_shapes]
        self._started = False  # the file is created (truncated) by the first forward
        return []

    def backward_needs(self):
        return frozenset()

    def forward(self, bottom, top):
        if self.ctx is not None and self.ctx.recomputing:
            return  # a replayed step: these rows are in the file already
        h5py = require_h5py()
        arrays = [np.asarray(self.ops.download(b), dtype=np.float32).reshape(s)
                  for b, s in zip(bottom, self.shapes)]
        try:
            with h5py.File(self.file_name, "a" if self._started else "w") as f:
                for name, array in zip(_OUTPUT_NAMES, arrays):
                    if name not in f:
                        f.create_dataset(name, data=array, maxshape=(None,) + array.shape[1:],
                                         chunks=True)
                    else:
                        dataset = f[name]
                        n = dataset.shape[0]
                        dataset.resize(n + array.shape[0], axis=0)
                        dataset[n:] = array
        except OSError as e:
            raise self.fail(f"cannot write {self.file_name!r} (resolved to {os.path.abspath(self.file_name)!r}): "
                            f"{e}") from None
        self._started = True

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        for pd, diff in zip(propagate_down, bottom_diff):
            if pd:
                self.ops.fill(diff, 0.0)
