"""Pinned host memory and asynchronous host<->device copies for the Unified Tensor Pool (paper 3.3).

All compute (numba kernels, cuDNN, cuBLAS) runs on the legacy default stream 0. Copies run on two
streams of their own, created NON_BLOCKING: a blocking stream would implicitly serialize with
stream 0 and nothing would overlap. Ordering is therefore explicit, with events:

- to_host (offload, D2H): record a marker on stream 0, the offload stream waits on it (so the copy
  reads what the compute issued so far wrote), copies, and records a done event. The caller returns
  the tensor's device block to the pool only once that event has completed.
- to_device (prefetch, H2D): the same marker first (the device block may have been freed a moment
  ago by the host while stream-0 kernels still read it), copy, done event. Before a step reads the
  tensor the caller `join`s the event: stream 0 waits on it on the GPU (cuStreamWaitEvent), the host
  does not block.

The host side is one pinned allocation (numba's `cuda.pinned_array`, i.e. cuMemHostAlloc) that
the memory package carves with its HeapPool, as it does the device arena. Driver calls go through
cuda-python (`cuda.bindings.driver`), which returns (CUresult, value...) tuples.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cuda.pointers import pointer

STREAM0 = drv.CUstream(0)  # the legacy default stream: where numba, cuDNN and cuBLAS run


def compute_stream() -> Any:
    """The stream compute is queued on now: stream 0, or a graph's capturing stream (graphs.py)."""
    from superneurons.backend.cuda import kernels

    handle = kernels.stream_handle()
    return drv.CUstream(handle) if handle else STREAM0


def _check(result: tuple, what: str) -> Any:
    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if len(result) == 2 else result[1:] or None


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    info = cuda.current_context().get_memory_info()
    return int(info[0]), int(info[1])


def release_freed_allocations() -> None:
    """numba defers cudaFree of dropped device arrays; run the pending frees now (MallocPool, Table 2)."""
    cuda.current_context().deallocations.clear()


def copy_to_host_async(src: Any, dst: np.ndarray, stream: Any) -> None:
    """Queue a D2H copy of device array `src` into pinned `dst` on `stream` (the host goes on)."""
    _check(drv.cuMemcpyDtoHAsync(dst.ctypes.data, drv.CUdeviceptr(pointer(src)), int(dst.nbytes), stream),
           "cuMemcpyDtoHAsync")


class CudaEvent:
    """A completion marker recorded on one of the copy streams."""

    __slots__ = ("handle",)

    def __init__(self, stream: Any):
        self.handle = _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        _check(drv.cuEventRecord(self.handle, stream), "cuEventRecord")

    def query(self) -> bool:
        (err,) = drv.cuEventQuery(self.handle)
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed: {err!r}")

    def synchronize(self) -> None:
        _check(drv.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def __del__(self) -> None:
        # Destroying a pending event is allowed: its resources go once the work completes.
        try:
            drv.cuEventDestroy(self.handle)
        except Exception:
            pass


class CudaTransfer:
    name = "cuda"

    def __init__(self, backend: Any = None):
        flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.offload_stream = _check(drv.cuStreamCreate(flags), "cuStreamCreate")
        self.prefetch_stream = _check(drv.cuStreamCreate(flags), "cuStreamCreate")
        # One reusable marker per copy stream: cuStreamWaitEvent waits for the event's most recent
        # record at the time of the call, so re-recording it for the next copy is safe.
        no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._marker = {id(s): _check(drv.cuEventCreate(no_timing), "cuEventCreate")
                        for s in (self.offload_stream, self.prefetch_stream)}
        self._host = CpuBackend()

    # -- the pinned host arena (HeapPool's backend interface) ------------------------------------
    def arena(self, nbytes: int) -> np.ndarray:
        return cuda.pinned_array(max(int(nbytes), 1), np.uint8)

    def view(self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return self._host.view(arena, offset, shape, dtype)  # a slice of pinned memory is pinned

    # -- copies ------------------------------------------------------------------------------------
    def _after_compute(self, stream: Any) -> None:
        marker = self._marker[id(stream)]
        _check(drv.cuEventRecord(marker, STREAM0), "cuEventRecord")
        _check(drv.cuStreamWaitEvent(stream, marker, 0), "cuStreamWaitEvent")

    def to_host(self, src: Any, dst: np.ndarray) -> CudaEvent:
        """D2H of device array `src` into pinned `dst` on the offload stream, after stream 0's work so far."""
        self._after_compute(self.offload_stream)
        copy_to_host_async(src, dst, self.offload_stream)
        return CudaEvent(self.offload_stream)

    def to_device(self, src: np.ndarray, dst: Any) -> CudaEvent:
        """H2D of pinned `src` into device array `dst` on the prefetch stream, after stream 0's work so far."""
        self._after_compute(self.prefetch_stream)
        _check(drv.cuMemcpyHtoDAsync(drv.CUdeviceptr(pointer(dst)), src.ctypes.data, int(src.nbytes),
                                     self.prefetch_stream), "cuMemcpyHtoDAsync")
        return CudaEvent(self.prefetch_stream)

    def join(self, event: CudaEvent) -> None:
        """Work issued to stream 0 from now on waits for `event` (on the GPU; the host goes on)."""
        _check(drv.cuStreamWaitEvent(STREAM0, event.handle, 0), "cuStreamWaitEvent")
