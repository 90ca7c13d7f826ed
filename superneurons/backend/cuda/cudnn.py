"""cuDNN (legacy API) through ctypes: descriptors, convolution with measured algorithms, softmax.

Every call's status is checked; a failure raises RuntimeError naming the function and cuDNN's message.
Descriptors are cached per shape. Convolution algorithms are ranked once per (shapes, geometry) and
direction, by cuDNN's heuristics or, with SUPERNEURONS_CUDNN_FIND=1, measured with cudnnFind*AlgorithmEx
(see ConvPlan); workspace comes from the device's workspace source
(device.WorkspaceSource: by default one private buffer grown on demand up to a limit).
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

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


class Handle:
    def __init__(self, stream: int, tf32: bool, workspace_source):
        self.value = _c.c_void_p()
        call("cudnnCreate", _c.byref(self.value))
        call("cudnnSetStream", self.value, _c.c_void_p(stream))
        self.math = DEFAULT_MATH if tf32 else FMA_MATH
        self.workspace_source = workspace_source  # a device.WorkspaceSource; Device swaps it
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


class AlgoChoice(NamedTuple):
    algo: int
    workspace: int  # bytes
    math: int  # cudnnMathType_t to set on the descriptor for this algorithm


class AlgoTable:
    """The usable algorithms of one convolution direction, fastest first, and the choice per workspace limit.

    Only the Pareto front matters (each entry faster than every later one that needs less workspace), so
    choosing for a new limit walks a few entries; choices are then cached per limit.
    """

    def __init__(self, ranked: list[AlgoChoice], measured: bool):
        if not ranked:
            raise RuntimeError("cuDNN offers no usable convolution algorithm")
        self.ranked = ranked
        self.measured = measured
        self.front: list[AlgoChoice] = []
        for choice in ranked:
            if not self.front or choice.workspace < self.front[-1].workspace:
                self.front.append(choice)
        self._by_limit: dict[int, AlgoChoice] = {}

    def pick(self, available: int) -> AlgoChoice:
        choice = self._by_limit.get(available)
        if choice is None:
            choice = next((c for c in self.front if c.workspace <= available), None)
            if choice is None:
                raise RuntimeError(f"no convolution algorithm fits in {available} bytes of workspace "
                                   f"(the smallest needs {self.front[-1].workspace})")
            if len(self._by_limit) >= 64:  # a pool-backed source may report many different sizes
                self._by_limit.clear()
            self._by_limit[available] = choice
        return choice


def _find_enabled() -> bool:
    """SUPERNEURONS_CUDNN_FIND=1 measures algorithms; the default ranks by cuDNN's heuristics, because on an
    H200 (cuDNN 9.19, ResNet-50 batch 64) the measured choices trained slower end to end: 1120 against 1350
    img/s (docs/BENCHMARKS.md, issue 3), Find timing each algorithm alone on an idle GPU."""
    return os.environ.get("SUPERNEURONS_CUDNN_FIND", "0").strip().lower() not in ("", "0", "false", "no", "off")


# Per direction: the heuristic query, the measuring query, the call itself.
FORWARD, BACKWARD_DATA, BACKWARD_FILTER = 0, 1, 2
_FUNCTIONS = (
    ("cudnnGetConvolutionForwardAlgorithm_v7", "cudnnFindConvolutionForwardAlgorithmEx", "cudnnConvolutionForward"),
    ("cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnFindConvolutionBackwardDataAlgorithmEx",
     "cudnnConvolutionBackwardData"),
    ("cudnnGetConvolutionBackwardFilterAlgorithm_v7", "cudnnFindConvolutionBackwardFilterAlgorithmEx",
     "cudnnConvolutionBackwardFilter"),
)


class ConvPlan:
    """Descriptors and algorithms of one convolution shape (forward, backward data, backward filter).

    Algorithms are measured with cudnnFind*AlgorithmEx at the first call of each direction (the real
    operands are needed; Find writes its output, so forward measures into y and backward data into dx,
    which the call then overwrites, and backward filter into a scratch dw, because dw accumulates), as
    PyTorch's cudnn.benchmark does. Every call then takes the fastest measured algorithm whose workspace
    fits what the device's workspace source has available. Measuring is opt-in (SUPERNEURONS_CUDNN_FIND=1,
    see _find_enabled); by default the ranking is cuDNN's _v7 heuristics (nothing is run), with the same
    per-call choice against the workspace source.
    """

    def __init__(self, h: Handle, x_shape, w_shape, y_shape, geom: ConvGeometry, dtype):
        self.h = h
        self.dtype = dtype
        self.w_shape = tuple(int(d) for d in w_shape)
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
        self._math = h.math  # the math type currently set on the descriptor
        out = [_c.c_int() for _ in range(4)]
        call("cudnnGetConvolution2dForwardOutputDim", self.conv, self.x, self.w, *[_c.byref(d) for d in out])
        dims = tuple(d.value for d in out)
        if dims != tuple(y_shape):
            raise RuntimeError(f"cuDNN computes output {dims} for input {x_shape}, weights {w_shape}, "
                               f"{geom}; the layer expects {tuple(y_shape)}")
        self.tables: list[AlgoTable | None] = [None, None, None]
        self.last: list[AlgoChoice | None] = [None, None, None]  # what each direction ran last (profiler)
        one, zero = _scalars(dtype)
        self._one, self._zero = _c.byref(one), _c.byref(zero)
        self._keep = (one, zero)

    # -- choosing ----------------------------------------------------------------------------------
    def _usable(self, perfs, count: int) -> list[tuple[float, AlgoChoice]]:
        """(time, choice) of the entries that succeeded and respect the math mode, in cuDNN's order."""
        out = []
        for p in perfs[:count]:
            if p.status != 0:
                continue
            if self.h.math == FMA_MATH and p.mathType not in (FMA_MATH, DEFAULT_MATH):
                continue
            math = FMA_MATH if self.h.math == FMA_MATH else p.mathType
            out.append((float(p.time), AlgoChoice(p.algo, int(p.memory), math)))
        return out

    def _heuristics(self, direction: int, descs) -> list[AlgoChoice]:
        """cuDNN's ranking without running anything; `descs` = (a, b, out) as in _run."""
        perfs = (_Perf * _MAX_ALGOS)()
        count = _c.c_int()
        self._set_math(self.h.math)
        a_desc, b_desc, out_desc = descs
        call(_FUNCTIONS[direction][0], self.h.value, a_desc, b_desc, self.conv, out_desc, _MAX_ALGOS,
             _c.byref(count), perfs)
        return [choice for _t, choice in self._usable(perfs, count.value)]  # heuristic order

    def _measure(self, direction: int, operands) -> AlgoTable:
        """Rank the algorithms of `direction` on the real operands [(desc, ptr) x 3, the last the output]."""
        descs = [d for d, _p in operands]
        guesses = self._heuristics(direction, descs)
        if not _find_enabled():
            return AlgoTable(guesses, measured=False)
        source = self.h.workspace_source
        size = min(source.available(), max((g.workspace for g in guesses), default=0))
        args = [v for pair in operands for v in pair]
        perfs = (_Perf * _MAX_ALGOS)()
        count = _c.c_int()
        ws = source.acquire(size) if size else 0
        try:
            call(_FUNCTIONS[direction][1], self.h.value, *args[:4], self.conv, *args[4:], _MAX_ALGOS,
                 _c.byref(count), perfs, _c.c_void_p(ws), _c.c_size_t(size))
        finally:
            if size:
                source.release()
        # Find returns its results sorted by time already; sorting again keeps that explicit (and stable).
        ranked = [choice for _t, choice in sorted(self._usable(perfs, count.value), key=lambda tc: tc[0])]
        return AlgoTable(ranked or guesses, measured=bool(ranked))

    def _set_math(self, math: int) -> None:
        if math != self._math:
            call("cudnnSetConvolutionMathType", self.conv, math)
            self._math = math

    def _run(self, direction: int, a_desc, a, b_desc, b, beta, out_desc, out, measure_out=None) -> None:
        table = self.tables[direction]
        if table is None:
            scratch = measure_out if measure_out is not None else out
            table = self.tables[direction] = self._measure(direction, ((a_desc, a), (b_desc, b), (out_desc, scratch)))
        source = self.h.workspace_source
        choice = table.pick(source.available())
        self.last[direction] = choice
        self._set_math(choice.math)
        nbytes = choice.workspace
        ws = source.acquire(nbytes) if nbytes else 0
        try:
            call(_FUNCTIONS[direction][2], self.h.value, self._one, a_desc, a, b_desc, b, self.conv, choice.algo,
                 _c.c_void_p(ws), _c.c_size_t(nbytes), beta, out_desc, out)
        finally:
            if nbytes:
                source.release()

    # -- the calls -----------------------------------------------------------------------------------
    def forward(self, x, w, y) -> None:
        self._run(FORWARD, self.x, _ptr(x), self.w, _ptr(w), self._zero, self.y, _ptr(y))

    def backward_data(self, w, dy, dx) -> None:
        self._run(BACKWARD_DATA, self.w, _ptr(w), self.y, _ptr(dy), self._zero, self.x, _ptr(dx))

    def backward_filter(self, x, dy, dw) -> None:
        """dw += the filter gradient (beta = 1: parameter diffs accumulate, as in Caffe)."""
        scratch = None
        if self.tables[BACKWARD_FILTER] is None:  # Find overwrites its output: measure into a scratch dw
            from numba import cuda

            scratch = cuda.device_array(self.w_shape, np.dtype(self.dtype))
        self._run(BACKWARD_FILTER, self.x, _ptr(x), self.y, _ptr(dy), self._one, self.w, _ptr(dw),
                  measure_out=_ptr(scratch) if scratch is not None else None)

    def add_bias(self, b, y) -> None:
        call("cudnnAddTensor", self.h.value, self._one, self.bias, _ptr(b), self._one, self.y, _ptr(y))

    def backward_bias(self, dy, db) -> None:
        call("cudnnConvolutionBackwardBias", self.h.value, self._one, self.y, _ptr(dy), self._one, self.bias,
             _ptr(db))

