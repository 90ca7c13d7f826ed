"""MemoryData: batches from arrays the caller hands over with `reset(data, labels)`.

Caffe's MemoryDataLayer::Reset and pycaffe's `net.set_input_arrays(data, labels)`: the arrays are
float32, C-contiguous, data (n, C, H, W) with the layer's C, H, W and labels (n,) or (n, 1, 1, 1);
n is a positive multiple of batch_size. The layer reads the caller's arrays in place, without a
copy (as Caffe keeps the pointers), so changing them changes later batches; nothing is transformed
(Caffe warns that transform_param is ignored here). Batch k holds samples
`(k mod n/batch_size) * batch_size ...`: reading past the end wraps to the start, and `reset` starts
again at the first sample.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from superneurons.errors import UserError
from superneurons.layers.base import Layer, register
from superneurons.layers.batch_position import BatchPosition
from superneurons.layers.source import SourceLayer


@register("MemoryData")
class MemoryData(BatchPosition, SourceLayer):
    n_tops = (1, 2)

    def setup(self, bottom_shapes):
        p = self.param.memory_data_param
        dims = (p.batch_size, p.channels, p.height, p.width)
        if min(dims) < 1:
            raise self.fail(f"memory_data_param needs batch_size, channels, height and width >= 1, got "
                            f"{' '.join(str(d) for d in dims)}")
        self.batch_size = int(p.batch_size)
        self.item_shape = (int(p.channels), int(p.height), int(p.width))
        self._data: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self.next_batch = 0
        tops = [(self.batch_size,) + self.item_shape]
        if len(self.param.top) > 1:
            tops.append((self.batch_size,))
        return tops

    def reset(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Serve `data` (n, C, H, W) and `labels` (n,) or (n, 1, 1, 1) from the first sample on."""
        want = "(n, " + ", ".join(str(d) for d in self.item_shape) + ")"
        _check_array(self, "data", data, want)
        _check_array(self, "labels", labels, "(n,) or (n, 1, 1, 1)")
        if data.ndim != 4 or data.shape[1:] != self.item_shape:
            raise self.fail(f"data has shape {data.shape}, expected {want}")
        n = data.shape[0]
        if labels.shape not in ((n,), (n, 1, 1, 1)):
            raise self.fail(f"labels have shape {labels.shape} for {n} samples, expected ({n},) or ({n}, 1, 1, 1)")
        if n == 0 or n % self.batch_size:
            raise self.fail(f"got {n} samples, which is not a positive multiple of batch_size {self.batch_size}")
        self._data, self._labels = data, labels.reshape(n)  # a view: the caller's memory is read in place
        self.next_batch = 0

    def forward(self, bottom, top):
        if self._data is None:
            raise self.fail("no data: call reset(data, labels) (pycaffe: net.set_input_arrays) before running "
                            "the net")
        # A recomputed forward replays the batch it served last.
        replay = self.ctx is not None and self.ctx.recomputing and self.next_batch > 0
        k = self.next_batch - 1 if replay else self.next_batch
        n_batches = self._data.shape[0] // self.batch_size
        lo = (k % n_batches) * self.batch_size
        self.ops.upload(top[0], self._data[lo:lo + self.batch_size])
        if len(top) > 1:
            self.ops.upload(top[1], self._labels[lo:lo + self.batch_size])
        self.next_batch = k + 1

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass


def _check_array(layer: Layer, what: str, array, shape: str) -> None:
    """pycaffe's checks: a NumPy float32 C-contiguous array (anything else would be copied, and Caffe reads
    the caller's memory)."""
    if not isinstance(array, np.ndarray):
        raise layer.fail(f"{what} must be a NumPy array {shape}, got {type(array).__name__}")
    if array.dtype != np.float32 or not array.flags.c_contiguous:
        problem = f"dtype {array.dtype}" if array.dtype != np.float32 else "not C-contiguous"
        raise layer.fail(f"{what} must be a float32 C-contiguous array ({problem}); pass "
                         f"np.ascontiguousarray({what}, dtype=np.float32)")


def set_input_arrays(layers_in_prototxt_order: Iterable[Layer], data: np.ndarray, labels: np.ndarray) -> None:
    """pycaffe's `Net.set_input_arrays`: reset the net's first layer, which must be a MemoryData layer."""
    first = next(iter(layers_in_prototxt_order), None)
    if not isinstance(first, MemoryData):
        what = f"{first.name!r} ({first.type_name})" if first is not None else "nothing (the net is empty)"
        raise UserError(f"set_input_arrays may only be called if the first layer is a MemoryData layer; it is {what}")
    first.reset(data, labels)
