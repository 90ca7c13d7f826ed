"""cuDNN (legacy API) through ctypes: descriptors, convolution with cached algorithms, softmax.

Every call's status is checked; a failure raises RuntimeError naming the function and cuDNN's message.
Descriptors are cached per shape. Convolution algorithms are chosen once per (shapes, geometry) with
the _v7 heuristics (they do not run anything, so no output is overwritten): the first algorithm whose
workspace fits `workspace_limit`. Workspace comes from one buffer that grows only when a new shape
needs more (first iteration), never inside the steady-state loop.
"""
from __future__ import annotations

import ctypes

import numpy as np

from superneurons.backend.cuda import libs
from superneurons.backend.geometry import ConvGeometry

_c = ctypes
FLOAT, DOUBLE = 0, 1
NCHW = 0
CROSS_CORRELATION = 1
DEFAULT_MATH, FMA_MATH = 0, 3
SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL = 1, 1
_MAX_ALGOS = 16


class _Perf(_c.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (one layout for all three)."""
    _fields_ = [("algo", _c.c_int), ("status", _c.c_int), ("time", _c.c_float), ("memory", _c.c_size_t),
                ("determinism", _c.c_int), ("mathType", _c.c_int), ("reserved", _c.c_int * 3)]


def _lib() -> ctypes.CDLL:
    lib = libs.load("cudnn")
    if not getattr(lib, "_sn_typed", False):
        lib.cudnnGetErrorString.restype = _c.c_char_p
        lib.cudnnGetVersion.restype = _c.c_size_t
        lib._sn_typed = True
    return lib


def call(fn: str, *args) -> None:
    status = getattr(_lib(), fn)(*args)
    if status != 0:
        raise RuntimeError(f"{fn} failed: cuDNN status {status} ({_lib().cudnnGetErrorString(status).decode()})")


def version() -> int:
    return int(_lib().cudnnGetVersion())


def _dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt == np.float32:
        return FLOAT
    if dt == np.float64:
        return DOUBLE
    raise TypeError(f"cuDNN ops support float32 and float64 arrays, not {dt}")


def _scalars(dtype):
    """(one, zero) host scalars of the type cuDNN's alpha/beta take for `dtype`."""
    kind = _c.c_double if np.dtype(dtype) == np.float64 else _c.c_float
    return kind(1.0), kind(0.0)


class Workspace:
    """One device buffer for cuDNN scratch, grown on demand (only when a new shape needs more)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._buf = None
        self.nbytes = 0

    def get(self, nbytes: int) -> int:
        if nbytes == 0:
            return 0
        if nbytes > self.nbytes:
            from numba import cuda

            self._buf = None
            self._buf = cuda.device_array(nbytes, np.uint8)
            self.nbytes = nbytes
        return self._buf.device_ctypes_pointer.value


class Handle:
    def __init__(self, stream: int = 0, tf32: bool = True, workspace_limit: int = 1 << 30):
        self.value = _c.c_void_p()
        call("cudnnCreate", _c.byref(self.value))
        call("cudnnSetStream", self.value, _c.c_void_p(stream))
        self.math = DEFAULT_MATH if tf32 else FMA_MATH
        self.workspace = Workspace(workspace_limit)
        self._tensors: dict = {}
        self._convs: dict = {}

    # -- descriptors ----------------------------------------------------------------------------
    def tensor(self, shape: tuple[int, ...], dtype) -> _c.c_void_p:
        """A packed NCHW descriptor for a 4-D shape (cached)."""
        key = (tuple(int(d) for d in shape), np.dtype(dtype).str)
        desc = self._tensors.get(key)
        if desc is None:
            desc = _c.c_void_p()
            call("cudnnCreateTensorDescriptor", _c.byref(desc))
            call("cudnnSetTensor4dDescriptor", desc, NCHW, _dtype_code(dtype), *key[0])
            self._tensors[key] = desc
        return desc

    def conv_plan(self, x_shape, w_shape, y_shape, geom: ConvGeometry, dtype) -> "ConvPlan":
        key = (tuple(x_shape), tuple(w_shape), tuple(y_shape), geom, np.dtype(dtype).str)
        plan = self._convs.get(key)
        if plan is None:
            plan = self._convs[key] = ConvPlan(self, *key[:4], dtype)
        return plan

    # -- softmax over (outer, channels, inner) ----------------------------------------------------
    def softmax_forward(self, x, y, dims) -> None:
        desc = self.tensor((dims[0], dims[1], dims[2], 1), x.dtype)
        one, zero = _scalars(x.dtype)
        call("cudnnSoftmaxForward", self.value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, _c.byref(one), desc,
             _ptr(x), _c.byref(zero), desc, _ptr(y))

    def softmax_backward(self, y, dy, dx, dims) -> None:
        desc = self.tensor((dims[0], dims[1], dims[2], 1), y.dtype)
        one, zero = _scalars(y.dtype)
        call("cudnnSoftmaxBackward", self.value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, _c.byref(one), desc,
             _ptr(y), desc, _ptr(dy), _c.byref(zero), desc, _ptr(dx))


def _ptr(a) -> _c.c_void_p:
    return _c.c_void_p(a.device_ctypes_pointer.value or 0)


class ConvPlan:
    """Descriptors and chosen algorithms of one convolution shape (forward, backward data, backward filter)."""

    def __init__(self, h: Handle, x_shape, w_shape, y_shape, geom: ConvGeometry, dtype):
        self.h = h
        self.dtype = dtype
        self.x = h.tensor(x_shape, dtype)
        self.y = h.tensor(y_shape, dtype)
        self.bias = h.tensor((1, y_shape[1], 1, 1), dtype)
        self.w = _c.c_void_p()
        call("cudnnCreateFilterDescriptor", _c.byref(self.w))
        call("cudnnSetFilter4dDescriptor", self.w, _dtype_code(dtype), NCHW, *(int(d) for d in w_shape))
        self.conv = _c.c_void_p()
        call("cudnnCreateConvolutionDescriptor", _c.byref(self.conv))
        compute = _dtype_code(dtype)
        call("cudnnSetConvolution2dDescriptor", self.conv, *geom.pad, *geom.stride, *geom.dilation,
             CROSS_CORRELATION, compute)
        call("cudnnSetConvolutionGroupCount", self.conv, geom.group)
        call("cudnnSetConvolutionMathType", self.conv, h.math)
        out = [_c.c_int() for _ in range(4)]
        call("cudnnGetConvolution2dForwardOutputDim", self.conv, self.x, self.w, *[_c.byref(d) for d in out])
        dims = tuple(d.value for d in out)
        if dims != tuple(y_shape):
            raise RuntimeError(f"cuDNN computes output {dims} for input {x_shape}, weights {w_shape}, "
                               f"{geom}; the layer expects {tuple(y_shape)}")
        self.fwd = self._choose("cudnnGetConvolutionForwardAlgorithm_v7", self.x, self.w, self.conv, self.y)
        self.bwd_data = self._choose("cudnnGetConvolutionBackwardDataAlgorithm_v7", self.w, self.y, self.conv,
                                     self.x)
        self.bwd_filter = self._choose("cudnnGetConvolutionBackwardFilterAlgorithm_v7", self.x, self.y,
                                       self.conv, self.w)

    def _choose(self, fn: str, *descs) -> tuple[int, int, int]:
        """(algo, workspace bytes, math type) of the fastest usable algorithm within the workspace limit."""
        perfs = (_Perf * _MAX_ALGOS)()
        count = _c.c_int()
        call(fn, self.h.value, *descs, _MAX_ALGOS, _c.byref(count), perfs)
        for p in perfs[:count.value]:
            if p.status != 0 or p.memory > self.h.workspace.limit:
                continue
            if self.h.math == FMA_MATH and p.mathType not in (FMA_MATH, DEFAULT_MATH):
                continue
            math = FMA_MATH if self.h.math == FMA_MATH else p.mathType
            return p.algo, p.memory, math
        raise RuntimeError(f"{fn}: no algorithm fits the {self.h.workspace.limit} byte workspace limit")

    def _run(self, fn: str, choice, a_desc, a, b_desc, b, beta, out_desc, out) -> None:
        algo, ws_bytes, math = choice
        call("cudnnSetConvolutionMathType", self.conv, math)
        ws = self.h.workspace.get(ws_bytes)
        one, _ = _scalars(self.dtype)
        call(fn, self.h.value, _c.byref(one), a_desc, a, b_desc, b, self.conv, algo, _c.c_void_p(ws),
             _c.c_size_t(ws_bytes), _c.byref(beta), out_desc, out)

    def forward(self, x, w, y) -> None:
        _, zero = _scalars(self.dtype)
        self._run("cudnnConvolutionForward", self.fwd, self.x, _ptr(x), self.w, _ptr(w), zero, self.y, _ptr(y))

    def backward_data(self, w, dy, dx) -> None:
        _, zero = _scalars(self.dtype)
        self._run("cudnnConvolutionBackwardData", self.bwd_data, self.w, _ptr(w), self.y, _ptr(dy), zero,
                  self.x, _ptr(dx))

    def backward_filter(self, x, dy, dw) -> None:
        """dw += the filter gradient (beta = 1: parameter diffs accumulate, as in Caffe)."""
        one, _ = _scalars(self.dtype)
        self._run("cudnnConvolutionBackwardFilter", self.bwd_filter, self.x, _ptr(x), self.y, _ptr(dy), one,
                  self.w, _ptr(dw))

    def add_bias(self, b, y) -> None:
        one, _ = _scalars(self.dtype)
        call("cudnnAddTensor", self.h.value, _c.byref(one), self.bias, _ptr(b), _c.byref(one), self.y, _ptr(y))

    def backward_bias(self, dy, db) -> None:
        one, _ = _scalars(self.dtype)
        call("cudnnConvolutionBackwardBias", self.h.value, _c.byref(one), self.y, _ptr(dy), _c.byref(one),
             self.bias, _ptr(db))
