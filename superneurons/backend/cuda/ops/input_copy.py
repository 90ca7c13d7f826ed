"""upload_async: a host batch to the device without stalling the host (what the data layers use).

`upload` (cuMemcpyHtoD from pageable memory) blocks the host until stream 0 has finished all work
queued so far and the copy is done, so each step's kernels can only be queued once the previous
step has drained. Here the batch is copied (by the host, at memory speed) into one of two pinned
staging buffers of its size and sent on the transfer's copy stream (`transfer.CudaTransfer`): the
copy waits for stream 0's work queued so far (the previous step may still read the tensor), and
stream 0's later work waits for the copy, both on the GPU. The host waits only when a staging
buffer is still being copied from, two uploads of that size ago.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

__all__ = ["upload_async"]

_STAGES = 2  # staging buffers per size: one being copied from while the host fills the other


class _Stager:
    def __init__(self) -> None:
        from superneurons.backend.cuda.transfer import CudaTransfer

        self.transfer = CudaTransfer()
        self.buffers: dict[int, list[list]] = {}  # nbytes -> [[pinned uint8 array, CudaEvent | None], ...]
        self.turn: dict[int, int] = {}

    def upload(self, dst, host: np.ndarray) -> None:
        src = np.asarray(host).reshape(-1)
        if src.size != dst.size:
            raise ValueError(f"upload of {np.shape(host)} into {dst.shape}: sizes differ")
        nbytes = dst.size * dst.dtype.itemsize
        if not nbytes:
            return
        if nbytes not in self.buffers:
            self.buffers[nbytes] = [[cuda.pinned_array(nbytes, np.uint8), None] for _ in range(_STAGES)]
        stages = self.buffers[nbytes]
        turn = self.turn[nbytes] = (self.turn.get(nbytes, -1) + 1) % _STAGES
        buffer, pending = stages[turn]
        if pending is not None:
            pending.synchronize()
        staged = buffer.view(dst.dtype)
        np.copyto(staged, src, casting="unsafe")
        done = self.transfer.to_device(staged, dst)
        self.transfer.join(done)
        stages[turn][1] = done


_stager: _Stager | None = None


def upload_async(dst, host: np.ndarray) -> None:
    """Copy `host` into device array `dst`; `host` may be reused as soon as this returns, and work
    queued after this call sees the new values."""
    global _stager
    if _stager is None:
        _stager = _Stager()
    _stager.upload(dst, host)
