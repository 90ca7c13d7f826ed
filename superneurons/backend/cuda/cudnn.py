"""cuDNN through ctypes: descriptors, convolutions, softmax.

Every call's status is checked; a failure raises RuntimeError naming the function and cuDNN's message.
Descriptors are cached per shape. Each convolution direction of each (shapes, geometry) runs either through
cuDNN's graph API (cudnn_graph.py: execution plans built once; the default, because cuDNN 9's legacy calls
spend ~3x the host time per call) or through the legacy API with algorithms ranked by cuDNN's heuristics or,
with SUPERNEURONS_CUDNN_FIND=1, measured with cudnnFind*AlgorithmEx (see ConvPlan). Workspace comes from the
device's workspace source (base.WorkspaceSource: by default one private buffer grown on demand up to a limit).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from superneurons import settings
from superneurons.backend.cuda import cudnn_graph, libs
from superneurons.backend.cuda.cudnn_graph import Candidates, NoFit
from superneurons.backend.cuda.pointers import pointer
from superneurons.backend.geometry import ConvGeometry
from superneurons.dtypes import BFLOAT16 as BFLOAT16_DTYPE, FLOAT16, FLOAT32

_c = ctypes
FLOAT, DOUBLE, HALF, BFLOAT16 = 0, 1, 2, 9  # cudnnDataType_t
NCHW, NHWC = 0, 1  # cudnnTensorFormat_t: NHWC descriptors for channels-last tensors (graph/layout.py)
CROSS_CORRELATION = 1
DEFAULT_MATH, FMA_MATH = 0, 3
CUDNN_DETERMINISTIC = 1  # cudnnDeterminism_t
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


_functions: dict[str, ctypes._CFuncPtr] = {}


def function(fn: str):
    """cuDNN's `fn`, looked up once (the hot calls also get argtypes: see _bind_convolutions)."""
    f = _functions.get(fn)
    if f is None:
        f = _functions[fn] = getattr(_lib(), fn)
    return f


def check(status: int, fn: str) -> None:
    if status != 0:
        raise RuntimeError(f"{fn} failed: cuDNN status {status} ({_lib().cudnnGetErrorString(status).decode()})")


def call(fn: str, *args) -> None:
    check(function(fn)(*args), fn)


def version() -> int:
    return int(_lib().cudnnGetVersion())


_DATA_TYPES = {FLOAT32: FLOAT, np.dtype(np.float64): DOUBLE, FLOAT16: HALF, BFLOAT16_DTYPE: BFLOAT16}


def _dtype_code(dtype) -> int:
    code = _DATA_TYPES.get(np.dtype(dtype))
    if code is None:
        raise TypeError(f"cuDNN ops support float32, float64, float16 and bfloat16 arrays, not {np.dtype(dtype)}")
    return code


def compute_code(dtype) -> int:
    """The type a convolution of `dtype` operands accumulates in: float32 for half storage (cuDNN's
    PSEUDO_HALF / bfloat16 configurations, on tensor cores), else the operands' own."""
    code = _dtype_code(dtype)
    return FLOAT if code in (HALF, BFLOAT16) else code


def _scalars(dtype):
    """(one, zero) host scalars of the type cuDNN's alpha/beta take for `dtype`."""
    kind = _c.c_double if np.dtype(dtype) == np.float64 else _c.c_float
    return kind(1.0), kind(0.0)


class Handle:
    def __init__(self, stream: int, tf32: bool, workspace_source):
        self.value = _c.c_void_p()
        call("cudnnCreate", _c.byref(self.value))
        self.set_stream(stream)
        self.math = DEFAULT_MATH if tf32 else FMA_MATH
        self.workspace_source = workspace_source  # a base.WorkspaceSource; Device swaps it
        self._tensors: dict = {}
        self._convs: dict = {}

    def set_stream(self, stream: int) -> None:
        """Queue this handle's work on `stream` from now on (0: the legacy default stream; graphs.py)."""
        call("cudnnSetStream", self.value, _c.c_void_p(stream))

    # -- descriptors ----------------------------------------------------------------------------
    def tensor(self, shape: tuple[int, ...], dtype, nhwc: bool = False) -> _c.c_void_p:
        """A packed descriptor for a 4-D (N, C, H, W) shape, NCHW or stored channels last (cached)."""
        key = (tuple(int(d) for d in shape), np.dtype(dtype).str, bool(nhwc))
        desc = self._tensors.get(key)
        if desc is None:
            desc = _c.c_void_p()
            call("cudnnCreateTensorDescriptor", _c.byref(desc))
            call("cudnnSetTensor4dDescriptor", desc, NHWC if nhwc else NCHW, _dtype_code(dtype), *key[0])
            self._tensors[key] = desc
        return desc

    def conv_plan(self, x_shape, w_shape, y_shape, geom: ConvGeometry, dtype, nhwc: bool = False) -> "ConvPlan":
        """`nhwc`: x, w and y stored channels last (the filter KRSC)."""
        key = (tuple(x_shape), tuple(w_shape), tuple(y_shape), geom, np.dtype(dtype).str, bool(nhwc))
        plan = self._convs.get(key)
        if plan is None:
            plan = self._convs[key] = ConvPlan(self, *key[:4], dtype, nhwc=bool(nhwc))
        return plan

    def existing_conv_plan(self, x_shape, w_shape, y_shape, geom: ConvGeometry) -> "ConvPlan | None":
        """The plan of these shapes made last, whatever its operands' type and layout (the profiler's: a layer
        knows its shapes, not the type its working copies or the layout its blobs have); None if none was."""
        shapes = (tuple(x_shape), tuple(w_shape), tuple(y_shape), geom)
        found = None
        for key, plan in self._convs.items():
            if key[:4] == shapes:
                found = plan
        return found

    # -- softmax over (outer, channels, inner) ----------------------------------------------------
    def softmax_forward(self, x, y, dims) -> None:
        desc = self.tensor((dims[0], dims[1], dims[2], 1), x.dtype)
        one, zero = _scalars(x.dtype)
        call("cudnnSoftmaxForward", self.value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, _c.byref(one), desc,
             _c.c_void_p(pointer(x)), _c.byref(zero), desc, _c.c_void_p(pointer(y)))

    def softmax_backward(self, y, dy, dx, dims) -> None:
        desc = self.tensor((dims[0], dims[1], dims[2], 1), y.dtype)
        one, zero = _scalars(y.dtype)
        call("cudnnSoftmaxBackward", self.value, SOFTMAX_ACCURATE, SOFTMAX_MODE_CHANNEL, _c.byref(one), desc,
             _c.c_void_p(pointer(y)), desc, _c.c_void_p(pointer(dy)), _c.byref(zero), desc, _c.c_void_p(pointer(dx)))


class AlgoChoice(NamedTuple):
    algo: int
    workspace: int  # bytes
    math: int  # cudnnMathType_t to set on the descriptor for this algorithm


class AlgoTable(Candidates):
    """The usable legacy algorithms of one convolution direction, fastest first; `pick(available)` (Candidates)
    returns the fastest whose workspace fits. Only the Pareto front matters (each entry faster than every later
    one that needs less workspace), so only that is scanned."""

    def __init__(self, ranked: list[AlgoChoice], measured: bool):
        if not ranked:
            raise RuntimeError("cuDNN offers no usable convolution algorithm")
        self.ranked = ranked
        self.measured = measured
        front: list[AlgoChoice] = []
        for choice in ranked:
            if not front or choice.workspace < front[-1].workspace:
                front.append(choice)
        super().__init__(iter(()), front)

    @property
    def front(self) -> list[AlgoChoice]:
        return self.items


def measures_algorithms() -> bool:
    """Whether convolution choices are ranked by time on the real operands at each direction's first call
    (SUPERNEURONS_CUDNN_FIND, on by default, as PyTorch's cudnn.benchmark on): on the graph API the heuristics'
    first precompiled candidates (cudnn_graph.GraphDirection.measure), on the legacy API cudnnFind*AlgorithmEx.
    Measured on an H100 (2026-11-24, tools/bench/speed.py, ours alone): SqueezeNet b64 4094 -> 4392 img/s,
    AlexNet b256 10764 -> 12092 (its grouped convolutions run on the legacy API), ResNet-50 and VGG16 b64 within
    0.3 %. (On the legacy API alone, Find once trained ResNet-50 slower than the heuristics: 1120 against 1350
    img/s on an H200, 2026-11-22.) Under SUPERNEURONS_CUDNN_DETERMINISTIC=1 the heuristics rank,
    so that two runs also choose the same engines."""
    return settings.get("SUPERNEURONS_CUDNN_FIND") and not cudnn_graph.deterministic_only()


# Per direction: the heuristic query, the measuring query, the call itself.
FORWARD, BACKWARD_DATA, BACKWARD_FILTER = 0, 1, 2
# Backward data that adds into dx (beta = 1) instead of overwriting it: a consumer of a split blob writes its
# share of the gradient straight into the summed gradient (memory/aliases.py), so no second dx is ever live.
# It is cuDNN's backward-data operation with another beta, hence its own plans and algorithm choice.
BACKWARD_DATA_ADD = 3
# Backward filter that overwrites dw (beta = 0): the first gradient written into a dw the solver has just
# cleared, where adding into the zeros would give the same bits. cuDNN's heuristics pick other, faster wgrad
# engines without the read of dw: 6.14 against 6.79 ms per ResNet-50 batch-64 iteration on an H200
# (tools/bench/conv_algos.py).
BACKWARD_FILTER_SET = 4
# the cuDNN operation of each direction
_OPERATION = (FORWARD, BACKWARD_DATA, BACKWARD_FILTER, BACKWARD_DATA, BACKWARD_FILTER)
_ACCUMULATES = (False, False, True, True, False)  # beta = 1: parameter diffs accumulate as in Caffe; so does DATA_ADD
# Winograd's non-fused legacy algorithms (forward 7, backward data 5, backward filter 5) transform their operands in
# the storage type: in float16 they missed the float16 op tests' tolerance (2^-10) by up to 30x, on a grouped 5x5 and
# a depthwise 3x3 convolution (H200, cuDNN 9.19, 2026-11-28), so float16 convolutions rank the other algorithms.
_WINOGRAD_NONFUSED = {FORWARD: 7, BACKWARD_DATA: 5, BACKWARD_FILTER: 5}
_FUNCTIONS = (
    ("cudnnGetConvolutionForwardAlgorithm_v7", "cudnnFindConvolutionForwardAlgorithmEx", "cudnnConvolutionForward"),
    ("cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnFindConvolutionBackwardDataAlgorithmEx",
     "cudnnConvolutionBackwardData"),
    ("cudnnGetConvolutionBackwardFilterAlgorithm_v7", "cudnnFindConvolutionBackwardFilterAlgorithmEx",
     "cudnnConvolutionBackwardFilter"),
)
_bound: list | None = None


def _bind_convolutions() -> list:
    """The three legacy convolution calls with argtypes set once: (handle, alpha, a_desc, a, b_desc, b, conv,
    algo, workspace, workspace bytes, beta, out_desc, out), every pointer passed as a plain int."""
    global _bound
    if _bound is None:
        vp = _c.c_void_p
        _bound = []
        for names in _FUNCTIONS:
            fn = function(names[2])
            fn.argtypes = [vp, vp, vp, vp, vp, vp, vp, _c.c_int, vp, _c.c_size_t, vp, vp, vp]
            fn.restype = _c.c_int
            _bound.append(fn)
    return _bound


class LegacyDirection:
    """One direction of a ConvPlan on the legacy API: its ranked algorithms and the call."""

    graph = False

    def __init__(self, plan: "ConvPlan", direction: int, table: AlgoTable, beta: int):
        self.plan = plan
        self.table = table
        self.measured = table.measured
        self._fn = _bind_convolutions()[_OPERATION[direction]]
        self._name = _FUNCTIONS[_OPERATION[direction]][2]
        a_desc, b_desc, out_desc = plan.descriptors(direction)
        self._descs = (a_desc.value, b_desc.value, out_desc.value)
        self._beta = beta  # address of the host scalar

    def pick(self, available: int) -> AlgoChoice:
        return self.table.pick(available)

    def execute(self, choice: AlgoChoice, a: int, b: int, out: int, ws: int) -> None:
        plan = self.plan
        plan._set_math(choice.math)
        a_desc, b_desc, out_desc = self._descs
        status = self._fn(plan.h.value.value, plan.one_ptr, a_desc, a, b_desc, b, plan.conv.value, choice.algo,
                          ws, choice.workspace, self._beta, out_desc, out)
        if status != 0:
            check(status, self._name)


class ConvPlan:
    """Descriptors and algorithms of one convolution shape (forward, backward data, backward filter).

    Each direction is set up at its first call: on the graph API (cudnn_graph.GraphDirection, the default
    for ungrouped convolutions) or, where that is off (SUPERNEURONS_CUDNN_GRAPH=0) or cannot run the
    convolution, on the legacy API (LegacyDirection). Choices are ranked by time on the real operands
    (`measures_algorithms`, the default), as PyTorch's cudnn.benchmark does, or by cuDNN's heuristics:
    graph plans timed one by one, legacy algorithms with cudnnFind*AlgorithmEx. Measuring writes the output,
    so forward measures into y and backward data into dx, which the call then overwrites, and the directions
    that accumulate (backward filter, backward data into a summed gradient) into an output borrowed from the
    workspace source (`_run_accumulating`). Every call
    then takes the first choice whose workspace fits what the device's workspace source has available.
    """

    def __init__(self, h: Handle, x_shape, w_shape, y_shape, geom: ConvGeometry, dtype, nhwc: bool = False):
        self.h = h
        self.dtype = dtype
        self.nhwc = nhwc
        self.geom = geom
        self.shapes = (tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape), tuple(int(d) for d in y_shape))
        self.w_shape = self.shapes[1]
        self.x = h.tensor(x_shape, dtype, nhwc)
        self.y = h.tensor(y_shape, dtype, nhwc)
        self.bias = h.tensor((1, y_shape[1], 1, 1), dtype)
        self.w = _c.c_void_p()
        call("cudnnCreateFilterDescriptor", _c.byref(self.w))
        call("cudnnSetFilter4dDescriptor", self.w, _dtype_code(dtype), NHWC if nhwc else NCHW,
             *(int(d) for d in w_shape))
        self.conv = _c.c_void_p()
        call("cudnnCreateConvolutionDescriptor", _c.byref(self.conv))
        compute = compute_code(dtype)
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
        self.tables: list = [None] * len(_OPERATION)  # per direction: a GraphDirection or a LegacyDirection
        self._legacy: list[LegacyDirection | None] = [None] * len(_OPERATION)
        self.last: list = [None] * len(_OPERATION)  # what each direction ran last (profiler)
        one, zero = _scalars(dtype)
        self._one, self._zero = _c.byref(one), _c.byref(zero)
        self.one_ptr, self.zero_ptr = _c.addressof(one), _c.addressof(zero)
        self._keep = (one, zero)

    def descriptors(self, direction: int) -> tuple:
        """The legacy (a, b, out) descriptors of `direction`, in the call's operand order."""
        return ((self.x, self.w, self.y), (self.w, self.y, self.x), (self.x, self.y, self.w))[_OPERATION[direction]]

    def operand_shapes(self, direction: int) -> tuple:
        x, w, y = self.shapes
        return ((x, w, y), (w, y, x), (x, y, w))[_OPERATION[direction]]

    # -- choosing ----------------------------------------------------------------------------------
    def _usable(self, direction: int, perfs, count: int) -> list[tuple[float, AlgoChoice]]:
        """(time, choice) of the entries that succeeded and respect the math mode (and, under
        SUPERNEURONS_CUDNN_DETERMINISTIC=1, are deterministic; in float16, are not Winograd's non-fused ones), in
        cuDNN's order."""
        out = []
        deterministic = cudnn_graph.deterministic_only()
        inexact = _WINOGRAD_NONFUSED[_OPERATION[direction]] if np.dtype(self.dtype) == np.float16 else None
        for p in perfs[:count]:
            if p.status != 0 or (deterministic and p.determinism != CUDNN_DETERMINISTIC) or p.algo == inexact:
                continue
            if self.h.math == FMA_MATH and p.mathType not in (FMA_MATH, DEFAULT_MATH):
                continue
            math = FMA_MATH if self.h.math == FMA_MATH else p.mathType
            out.append((float(p.time), AlgoChoice(p.algo, int(p.memory), math)))
        return out

    def _heuristics(self, direction: int) -> list[AlgoChoice]:
        """cuDNN's ranking without running anything."""
        perfs = (_Perf * _MAX_ALGOS)()
        count = _c.c_int()
        self._set_math(self.h.math)
        a_desc, b_desc, out_desc = self.descriptors(direction)
        call(_FUNCTIONS[_OPERATION[direction]][0], self.h.value, a_desc, b_desc, self.conv, out_desc, _MAX_ALGOS,
             _c.byref(count), perfs)
        return [choice for _t, choice in self._usable(direction, perfs, count.value)]  # heuristic order

    def _measure(self, direction: int, pointers: tuple[int, int, int], measure: bool) -> AlgoTable:
        """Rank the legacy algorithms of `direction` on the real operands (a, b, out) when `measure`."""
        guesses = self._heuristics(direction)
        if not measure:
            return AlgoTable(guesses, measured=False)
        descs = self.descriptors(direction)
        source = self.h.workspace_source
        size = min(source.available(), max((g.workspace for g in guesses), default=0))
        perfs = (_Perf * _MAX_ALGOS)()
        count = _c.c_int()
        ws = source.acquire(size) if size else 0
        try:
            call(_FUNCTIONS[_OPERATION[direction]][1], self.h.value, descs[0], _c.c_void_p(pointers[0]), descs[1],
                 _c.c_void_p(pointers[1]), self.conv, descs[2], _c.c_void_p(pointers[2]), _MAX_ALGOS,
                 _c.byref(count), perfs, _c.c_void_p(ws), _c.c_size_t(size))
        finally:
            if size:
                source.release()
        # Find returns its results sorted by time already; sorting again keeps that explicit (and stable).
        ranked = [choice for _t, choice in sorted(self._usable(direction, perfs, count.value), key=lambda tc: tc[0])]
        return AlgoTable(ranked or guesses, measured=bool(ranked))

    def _set_math(self, math: int) -> None:
        if math != self._math:
            call("cudnnSetConvolutionMathType", self.conv, math)
            self._math = math

    def _beta(self, direction: int) -> int:
        return self.one_ptr if _ACCUMULATES[direction] else self.zero_ptr

    def legacy(self, direction: int, pointers: tuple[int, int, int], measure: bool = False) -> LegacyDirection:
        d = self._legacy[direction]
        if d is None:
            d = self._legacy[direction] = LegacyDirection(self, direction, self._measure(direction, pointers, measure),
                                                          self._beta(direction))
        return d

    def _setup(self, direction: int, pointers: tuple[int, int, int], measure: bool = True):
        """The direction's runner, chosen once (see the class docstring); `measure` False: ranked by cuDNN's
        heuristics whatever the setting (no output of its own to measure into)."""
        measure = measure and measures_algorithms()
        if cudnn_graph.enabled():
            try:
                graph = cudnn_graph.GraphDirection(self.h.value.value, _OPERATION[direction],
                                                   self.operand_shapes(direction), self.geom, _dtype_code(self.dtype),
                                                   self.h.math != FMA_MATH, 1.0 if _ACCUMULATES[direction] else 0.0,
                                                   compute_code(self.dtype), nhwc=self.nhwc)
            except cudnn_graph.Unsupported:
                pass
            else:
                if measure and not any(p % cudnn_graph.ALIGNMENT for p in pointers):
                    graph.measure(*pointers, self.h.workspace_source)
                return graph
        return self.legacy(direction, pointers, measure)

    def _run(self, direction: int, a: int, b: int, out: int, measure_out: int | None = None,
             measure: bool = True) -> None:
        runner = self.tables[direction]
        if runner is None:
            scratch = measure_out if measure_out is not None else out
            runner = self.tables[direction] = self._setup(direction, (a, b, scratch), measure)
        if runner.graph and (a | b | out) % cudnn_graph.ALIGNMENT:
            runner = self.legacy(direction, (a, b, out))  # the plans were built for aligned operands
        source = self.h.workspace_source
        available = source.available()
        try:
            choice = runner.pick(available)
        except NoFit:
            if not runner.graph:
                raise
            runner = self.legacy(direction, (a, b, out))
            choice = runner.pick(available)
        self.last[direction] = choice
        nbytes = choice.workspace
        ws = source.acquire(nbytes) if nbytes else 0
        try:
            runner.execute(choice, a, b, out, ws)
        finally:
            if nbytes:
                source.release()

    # -- the calls -----------------------------------------------------------------------------------
    def forward(self, x, w, y) -> None:
        self._run(FORWARD, pointer(x), pointer(w), pointer(y))

    def backward_data(self, w, dy, dx, accumulate: bool = False) -> None:
        """dx = the data gradient, or dx += it with `accumulate`."""
        if not accumulate:
            self._run(BACKWARD_DATA, pointer(w), pointer(dy), pointer(dx))
        else:
            self._run_accumulating(BACKWARD_DATA_ADD, pointer(w), pointer(dy), dx)

    def backward_filter(self, x, dy, dw, accumulate: bool = True) -> None:
        """dw += the filter gradient (beta = 1: parameter diffs accumulate, as in Caffe); dw = it without
        `accumulate` (beta = 0, for a dw known to hold zeros)."""
        if accumulate:
            self._run_accumulating(BACKWARD_FILTER, pointer(x), pointer(dy), dw)
        else:
            self._run(BACKWARD_FILTER_SET, pointer(x), pointer(dy), pointer(dw))

    def _run_accumulating(self, direction: int, a: int, b: int, out) -> None:
        """A beta = 1 call. Find writes the output it measures into, so the first call of a measured direction
        measures into an output of its own, never into the sum being accumulated. That output is borrowed from
        the workspace source for the call (`borrow`: in a Net, the run's pool, memory/workspace.py), like the
        workspace and for the same reason: it is needed once per shape, so the plan does not hold it every
        iteration, and it takes what the step leaves free. Where the source cannot spare it, the direction is
        ranked by cuDNN's heuristics instead: the same sums, maybe a slower engine."""
        if self.tables[direction] is not None or not measures_algorithms():
            self._run(direction, a, b, pointer(out))
            return
        source = self.h.workspace_source
        scratch = source.borrow(int(out.nbytes))
        try:
            self._run(direction, a, b, pointer(out), measure_out=scratch, measure=scratch is not None)
        finally:
            if scratch is not None:
                source.give_back()

    def add_bias(self, b, y) -> None:
        call("cudnnAddTensor", self.h.value, self._one, self.bias, _c.c_void_p(pointer(b)), self._one, self.y,
             _c.c_void_p(pointer(y)))

    def backward_bias(self, dy, db) -> None:
        call("cudnnConvolutionBackwardBias", self.h.value, self._one, self.y, _c.c_void_p(pointer(dy)), self._one,
             self.bias, _c.c_void_p(pointer(db)))
