"""upload_async: a host batch to the device without stalling the host (what the data layers use).

`upload` (cuMemcpyHtoD from pageable memory) blocks the host until stream 0 has finished all work
queued so far and the copy is done, so each step's kernels can only be queued once the previous
step has drained. Here the batch is copied (by the host, at memory speed) into one of two pinned
staging buffers of its size and sent on the transfer's copy stream (`transfer.CudaTransfer`): the
copy waits for stream 0's work queued so far (the previous step may still read the tensor), and
stream 0's later work waits for the copy, both on the GPU. The host waits only when a staging
buffer is still being copied from, two uploads of that size ago.

`pin_host` + `upload_pinned` skip the staging copy for memory the caller keeps (the decode workers'
shared-memory slot ring): `pin_host` page-locks it once (cuMemHostRegister), and `upload_pinned`
sends a batch straight from it on the same copy stream, with the same GPU-side ordering, returning
the copy's event; the caller must not rewrite the memory before the event completes. The host then
does no per-batch memcpy and never waits for the GPU here.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from superneurons.dtypes import tensor_bytes

__all__ = ["upload_async", "pin_host", "upload_pinned"]

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
        nbytes = tensor_bytes(dst.shape, dst.dtype)
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


def _get_stager() -> _Stager:
    global _stager
    if _stager is None:
        _stager = _Stager()
    return _stager


def upload_async(dst, host: np.ndarray) -> None:
    """Copy `host` into device array `dst`; `host` may be reused as soon as this returns, and work
    queued after this call sees the new values."""
    _get_stager().upload(dst, host)


class HostPin:
    """A host range page-locked with cuMemHostRegister until `release()`. It keeps only the address:
    the owner of the memory releases the pin before unmapping it (and after the copies from it ended)."""

    def __init__(self, memory: np.ndarray):
        from cuda.bindings import driver as drv

        if not memory.flags.c_contiguous:
            raise ValueError("pin_host needs contiguous memory")
        self.address, self.nbytes = int(memory.ctypes.data), int(memory.nbytes)
        (err,) = drv.cuMemHostRegister(self.address, self.nbytes, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            self.address = 0
            raise MemoryError(f"cuMemHostRegister of {self.nbytes / 2**20:.0f} MiB failed: {err!r}")

    def release(self) -> None:
        if self.address:
            from cuda.bindings import driver as drv

            drv.cuMemHostUnregister(self.address)  # no error worth raising: the range is plain memory again
            self.address = 0


def pin_host(memory: np.ndarray) -> HostPin:
    """Page-lock `memory` (a contiguous host array the caller keeps mapped) as a source for
    `upload_pinned`, until the returned pin's `release()`; MemoryError when the driver refuses."""
    return HostPin(memory)


def upload_pinned(dst, host: np.ndarray):
    """Copy `host` (inside memory `pin_host` locked) into device array `dst` on the copy stream, after
    stream 0's work so far (earlier readers of `dst`); stream 0's later work waits for it, on the GPU.
    Returns the copy's CudaEvent: `host` must not change before it completes (poll it with `query`).
    Copies complete in the order issued (one stream)."""
    if not host.flags.c_contiguous or host.size != dst.size or host.dtype != dst.dtype:
        raise ValueError(f"upload_pinned of {host.dtype}{host.shape} into {dst.dtype}{dst.shape}: needs a "
                         f"contiguous array of the same size and dtype")
    transfer = _get_stager().transfer
    done = transfer.to_device(host, dst)
    transfer.join(done)
    return done
