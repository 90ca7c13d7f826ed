"""The current GPU (handles, scratch) and zero-copy array views, shared by every CUDA op.

Arrays are numba DeviceNDArrays. All of them are C-contiguous views onto pool arenas, so a reshape
is a new header over the same `gpu_data` and a raw pointer is `device_ctypes_pointer`.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.devicearray import DeviceNDArray

from superneurons.backend.cuda import cublas, cudnn

_current: "Device | None" = None


class Device:
    """One GPU: cuDNN and cuBLAS handles on the default stream, the cuDNN workspace, small float64 scratch."""

    def __init__(self, index: int, tf32: bool, workspace_limit: int):
        cuda.select_device(index)
        self.index = index
        self.cudnn = cudnn.Handle(0, tf32, workspace_limit)
        self.cublas = cublas.Handle(0)
        self._scratch: dict[int, DeviceNDArray] = {}

    def scratch(self, n: int) -> DeviceNDArray:
        """A float64 device array of `n` entries, reused across calls (allocated once per size)."""
        buf = self._scratch.get(n)
        if buf is None:
            buf = self._scratch[n] = cuda.device_array(n, np.float64)
        return buf


def activate(device: Device) -> None:
    global _current
    _current = device


def current() -> Device:
    if _current is None:
        raise RuntimeError("no CUDA device is active: create CudaBackend(device) first")
    return _current


def _strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def make(gpu_data, shape, dtype) -> DeviceNDArray:
    """A C-contiguous array of `shape` over `gpu_data` (a numba MemoryPointer): no allocation."""
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    return DeviceNDArray(shape, _strides(shape, dtype.itemsize), dtype, gpu_data=gpu_data)


def reshape(x: DeviceNDArray, shape) -> DeviceNDArray:
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1]))
        shape = tuple(x.size // max(known, 1) if d == -1 else d for d in shape)
    if int(np.prod(shape)) != x.size:
        raise ValueError(f"cannot reshape a device array of {x.size} elements {x.shape} to {shape}")
    if not x.is_c_contiguous():
        raise ValueError(f"reshape needs a contiguous device array, got strides {x.strides}")
    return make(x.gpu_data, shape, x.dtype)


def flat(a: DeviceNDArray) -> DeviceNDArray:
    """The 1-D view of `a`, built once per array object and kept on it (the kernels' launch cache keys
    arrays by identity, and building a numba array header costs more than launching a kernel)."""
    if a.ndim == 1:
        return a
    try:
        return a.__dict__["_sn_flat"]
    except (KeyError, AttributeError):
        pass
    f = reshape(a, (a.size,))
    try:
        a._sn_flat = f
    except AttributeError:
        pass
    return f


def scalar(a, value):
    """`value` as a scalar of a's dtype (float32 arrays get float32 arithmetic in the kernels)."""
    return a.dtype.type(value)
