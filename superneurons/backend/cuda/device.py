"""The current GPU (handles, the default cuDNN workspace source) and zero-copy array views, shared by every CUDA op.

Arrays are numba DeviceNDArrays. All of them are C-contiguous views onto pool arenas, so a reshape
is a new header over the same `gpu_data` and a raw pointer is `device_ctypes_pointer`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

try:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
except ImportError:  # the CUDA simulator (tests without a GPU): the ops then run on host arrays
    DeviceNDArray = None

from superneurons.backend.base import WorkspaceSource
from superneurons.backend.cuda import cublas, cudnn
from superneurons.backend.cuda.pointers import pointer  # also re-exported: the ops' helpers live here
from superneurons.dtypes import HALF_TYPES

_current: "Device | None" = None


class FixedWorkspace:
    """The default source: one private device buffer, grown on demand up to `limit` bytes, never shrunk.

    Only convolutions called without a source use it (tests, tools/bench): a Net's layers pass their run's
    (`RunContext.workspace`, memory/workspace.py's PoolWorkspace over the Net's pool), so a run's workspace is
    pool memory. Everything runs on one stream in order, so the buffer can be reused as soon as a call is
    queued."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.nbytes = 0  # current size of the buffer
        self._buf = None
        self._measure = None  # cuDNN's measuring output while lent (`borrow`)

    def available(self) -> int:
        return self.limit

    def acquire(self, nbytes: int) -> int:
        if nbytes > self.limit:
            raise RuntimeError(f"cuDNN workspace of {nbytes} bytes asked for, over the {self.limit}-byte limit")
        if nbytes > self.nbytes or self._buf is None:
            self._buf = None  # free the old buffer before allocating the larger one
            self._buf = cuda.device_array(max(int(nbytes), 1), np.uint8)
            self.nbytes = int(nbytes)
        return pointer(self._buf)

    def release(self) -> None:
        pass

    def borrow(self, nbytes: int) -> int | None:
        """cuDNN's measuring output (cudnn.py `_run_accumulating`), outside any Net as this buffer is: a device
        array of its own, kept until `give_back`."""
        self._measure = cuda.device_array(max(int(nbytes), 1), np.uint8)
        return pointer(self._measure)

    def give_back(self) -> None:
        self._measure = None


class Device:
    """One GPU: cuDNN and cuBLAS handles on the default stream and the cuDNN workspace source. Nothing here holds
    device memory a run uses: its workspace and its float64 sums come from the Net's pool, passed with each op
    call (`workspace=`, `scratch=`)."""

    def __init__(self, index: int, tf32: bool, workspace_limit: int):
        cuda.select_device(index)
        self.index = index
        self.default_workspace = FixedWorkspace(workspace_limit)
        self.cudnn = cudnn.Handle(0, tf32, self.default_workspace)
        self.cublas = cublas.Handle(0)

    @property
    def workspace_source(self) -> WorkspaceSource:
        return self.cudnn.workspace_source

    @workspace_source.setter
    def workspace_source(self, source: WorkspaceSource | None) -> None:
        """Install `source` for every convolution from now on; None restores the default FixedWorkspace."""
        self.cudnn.workspace_source = source if source is not None else self.default_workspace

    def workspace_from(self, source: WorkspaceSource | None) -> "WorkspaceScope":
        """Convolutions in this block borrow their workspace from `source` (a run's pool: the layers pass their
        RunContext's); None: from whatever is installed (the default FixedWorkspace). The source is the op
        call's argument: cuDNN's plans read it from the handle only while that call runs, and the one installed
        before is back when it returns, so a train net and its test nets each borrow from their own pool."""
        return WorkspaceScope(self.cudnn, source)


class WorkspaceScope:
    """`Device.workspace_from`'s block: a plain class, as every convolution call enters one (a generator-based
    context manager costs a few microseconds more per call)."""

    __slots__ = ("cudnn", "source", "before")

    def __init__(self, cudnn: Any, source: WorkspaceSource | None) -> None:
        self.cudnn, self.source, self.before = cudnn, source, None

    def __enter__(self) -> None:
        if self.source is not None:
            self.before = self.cudnn.workspace_source
            self.cudnn.workspace_source = self.source

    def __exit__(self, *exc: object) -> None:
        if self.source is not None:
            self.cudnn.workspace_source = self.before


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


def nhwc_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The byte strides of an (N, C, H, W) array stored channels last (N, H, W, C in memory)."""
    _n, c, h, w = shape
    c, h, w = max(c, 1), max(h, 1), max(w, 1)
    return (h * w * c * itemsize, itemsize, w * c * itemsize, c * itemsize)


def make(gpu_data, shape, dtype, layout: str = "NCHW") -> DeviceNDArray:
    """An array of `shape` over `gpu_data` (a numba MemoryPointer): no allocation. C-contiguous, or for
    `layout` NHWC a 4-D (N, C, H, W) array whose strides store it channels last (graph/layout.py)."""
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    strides = nhwc_strides(shape, dtype.itemsize) if layout == "NHWC" else _strides(shape, dtype.itemsize)
    return DeviceNDArray(shape, strides, dtype, gpu_data=gpu_data)


def channels_last(a) -> bool:
    """Whether `a` is a 4-D array stored channels last (and not also C-contiguous: one channel, or 1x1 planes)."""
    if getattr(a, "ndim", 0) != 4:
        return False
    strides = a.strides
    return strides == nhwc_strides(a.shape, a.dtype.itemsize) and strides != _strides(a.shape, a.dtype.itemsize)


def reshape(x: DeviceNDArray, shape) -> DeviceNDArray:
    """`x` seen as `shape` (one -1 allowed), sharing its memory. Layers reshape their blobs at every call,
    so the common case (the shape it already has) returns `x` itself, and other views are built once per
    array object and kept on it, as `flat` does."""
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    if DeviceNDArray is None:  # simulator
        return x.reshape(shape)
    views = x.__dict__.get("_sn_views")
    if views is not None and shape in views:
        return views[shape]
    key = shape
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(x.size // max(known, 1) if d == -1 else d for d in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"cannot reshape a device array of {x.size} elements {x.shape} to {shape}")
    if not x.is_c_contiguous():
        raise ValueError(f"reshape needs a contiguous device array, got strides {x.strides}")
    view = make(x.gpu_data, shape, x.dtype)
    try:
        x.__dict__.setdefault("_sn_views", {})[key] = view
    except AttributeError:
        pass
    return view


def flat(a: DeviceNDArray) -> DeviceNDArray:
    """The 1-D view of `a`, built once per array object and kept on it (the kernels' launch cache keys
    arrays by identity, and building a numba array header costs more than launching a kernel)."""
    if a.ndim == 1:
        return a
    try:
        return a.__dict__["_sn_flat"]
    except (KeyError, AttributeError):
        pass
    # a channels-last array: its memory in order (N, H, W, C); the ops that index channels know (layout.py)
    f = make(a.gpu_data, (a.size,), a.dtype) if channels_last(a) else reshape(a, (a.size,))
    try:
        a._sn_flat = f
    except AttributeError:
        pass
    return f


def scalar(a, value):
    """`value` as a scalar of a's dtype (float32 arrays get float32 arithmetic in the kernels); float32 for a half
    array, so the kernels compute in float32 on half storage and round once, on the store."""
    if a.dtype in HALF_TYPES:
        return np.float32(value)
    return a.dtype.type(value)


def bits(a):
    """The uint16 view of a half array (float16 or bfloat16), for copies that move bytes: numba's host<->device
    copies go through Python's buffer protocol, which cannot describe bfloat16."""
    if a.dtype == np.uint16 or DeviceNDArray is None or not isinstance(a, DeviceNDArray):
        return a  # the simulator's arrays are NumPy arrays: its copies take any dtype
    try:
        return a.__dict__["_sn_bits"]
    except KeyError:
        pass
    view = make(a.gpu_data, a.shape, np.uint16)
    a._sn_bits = view
    return view
