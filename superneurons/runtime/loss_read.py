"""Reading the loss without stopping the device between forward and backward.

Training needs the loss on the host (the smoothed loss, the display, the progress bar), but not before
backward starts. Read synchronously after forward, the host would wait for forward to finish and the device
would then sit idle until the host had queued backward's first kernels; with a short backward the gap is
a visible share of the step. Instead the loss blobs are copied into pinned host memory on a copy stream as
soon as forward is queued, compute issued after that waits for the copy (so backward may reuse the blobs'
memory), and the host collects the value after queuing backward, while the device runs it.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from superneurons.dtypes import tensor_bytes

LossBlob = tuple[Any, Any, float]  # (data tensor, diff tensor or None, loss weight), as Net.loss_blobs


def weighted_loss(backend: Any, loss_blobs: list[LossBlob]) -> float:
    """The weighted sum of the loss blobs, read now (what Net.forward returns)."""
    return sum(w * float(backend.to_host(data.array).sum()) for data, _diff, w in loss_blobs)


class LossReader:
    """Starts the copy of a net's loss blobs to the host (`start`), returning a callable that gives the
    weighted loss once the copy has completed."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.transfer = backend.make_transfer() if backend.asynchronous else None
        self._host: dict[tuple[int, tuple[int, ...], str], np.ndarray] = {}  # pinned buffers, reused

    def _buffer(self, slot: int, array: Any) -> np.ndarray:
        key = (slot, tuple(array.shape), str(array.dtype))
        buf = self._host.get(key)
        if buf is None:
            nbytes = tensor_bytes(array.shape, array.dtype)
            buf = self._host[key] = self.transfer.view(self.transfer.arena(nbytes), 0, tuple(array.shape),
                                                       array.dtype)
        return buf

    def start(self, loss_blobs: list[LossBlob]) -> Callable[[], float]:
        if self.transfer is None:  # the host computes: the loss is there already
            value = weighted_loss(self.backend, loss_blobs)
            return lambda: value
        copies = []
        for slot, (data, _diff, w) in enumerate(loss_blobs):
            host = self._buffer(slot, data.array)
            event = self.transfer.to_host(data.array, host)
            self.transfer.join(event)  # later compute may overwrite the blob only once it is copied
            copies.append((event, host, w))

        def value() -> float:
            loss = 0.0
            for event, host, w in copies:
                event.synchronize()
                loss += w * float(host.sum())
            return loss

        return value
