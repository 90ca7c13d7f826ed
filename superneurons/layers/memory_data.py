"""MemoryData: batches from arrays the caller hands over with `reset(data, labels)`.

As in Caffe, the arrays are used as given (no transformation), the number of samples must be a
multiple of batch_size, and reading past the end wraps to the start.
"""
from __future__ import annotations

import numpy as np

from superneurons.layers.base import Layer, register


@register("MemoryData")
class MemoryData(Layer):
    is_data = True
    has_backward = False
    n_bottoms = (0, 0)
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
        self._next = 0
        tops = [(self.batch_size,) + self.item_shape]
        if len(self.param.top) > 1:
            tops.append((self.batch_size,))
        return tops

    def reset(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Serve `data` (n, C, H, W) and `labels` (n,) from the first sample on."""
        data = np.asarray(data, dtype=np.float32)
        labels = np.asarray(labels, dtype=np.float32).reshape(-1)
        if data.ndim != 4 or data.shape[1:] != self.item_shape:
            want = ", ".join(str(d) for d in self.item_shape)
            raise self.fail(f"reset() got data of shape {data.shape}, expected (n, {want})")
        n = data.shape[0]
        if n == 0 or n % self.batch_size:
            raise self.fail(f"reset() got {n} samples, which is not a positive multiple of batch_size "
                            f"{self.batch_size}")
        if labels.shape[0] != n:
            raise self.fail(f"reset() got {n} samples but {labels.shape[0]} labels")
        self._data, self._labels = data, labels
        self._next = 0

    def forward(self, bottom, top):
        if self._data is None:
            raise self.fail("no data: call reset(data, labels) on the layer before running the net")
        # A recomputed forward replays the batch it served last.
        k = self._next - 1 if self.ctx is not None and self.ctx.recomputing and self._next > 0 else self._next
        n_batches = self._data.shape[0] // self.batch_size
        lo = (k % n_batches) * self.batch_size
        self.ops.upload(top[0], self._data[lo:lo + self.batch_size])
        if len(top) > 1:
            self.ops.upload(top[1], self._labels[lo:lo + self.batch_size])
        self._next = k + 1

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass

    def state(self) -> dict[str, int]:
        return {"batch": self._next}

    def restore(self, state: dict[str, int]) -> None:
        k = state.get("batch") if isinstance(state, dict) else None
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise self.fail(f"cannot restore the data position from {state!r}; expected {{'batch': n}} with n >= 0")
        self._next = int(k)
