"""Convolutions through cuDNN's backend (graph) API: execution plans built once, run with cudnnBackendExecute.

Why: cuDNN 9 implements the legacy cudnnConvolution{Forward,BackwardData,BackwardFilter} calls on top of this
API, and a legacy call costs ~60 us of host time against ~20 us for executing a plan that is already built (H200,
cuDNN 9.19, ResNet-50 shapes; tools/bench/conv_overhead.py measures both). PyTorch does the same: one plan per
(shape, direction), one variant pack per set of pointers.

One `GraphDirection` is one direction of one convolution shape: a one-operation graph (tensor uids 1, 2, 3 for
the operands a, b and out, in the legacy call's order), the engine configurations cuDNN's heuristics rank for it
(filtered for numerics as PyTorch does), and execution plans built lazily in that order: `pick(available)`
returns the first plan whose workspace fits, building further plans only when the ones built so far do not
fit. A plan keeps one finalized variant pack per (a, b, out, workspace) pointer set, so a steady-state call is
one dict lookup and one cudnnBackendExecute. With SUPERNEURONS_CUDNN_FIND=1, `measure` instead times the first
MEASURED_PLANS precompiled candidates on the real operands at the direction's first call, as PyTorch's
cudnn.benchmark does, and ranks those by time (SUPERNEURONS_CUDNN_MEASURED sets how many).

Enum values are cuDNN's (cudnn_graph.h, stable since 9.0). Any failure while building raises `Unsupported`;
the caller then uses the legacy API for that direction.
"""
from __future__ import annotations

import ctypes as _c
from typing import Iterator

from superneurons import settings
from superneurons.backend.cuda import libs
from superneurons.backend.geometry import ConvGeometry

# cudnnBackendDescriptorType_t
_CONVOLUTION, _ENGINE, _ENGINECFG, _ENGINEHEUR, _EXECUTION_PLAN = 1, 2, 3, 4, 5
_OPERATION_GRAPH, _VARIANT_PACK, _TENSOR = 15, 16, 17
# cudnnBackendAttributeType_t
_T_HANDLE, _T_DATA_TYPE, _T_INT64, _T_FLOAT, _T_DOUBLE, _T_VOID_PTR = 0, 1, 3, 4, 5, 6
_T_CONV_MODE, _T_HEUR_MODE, _T_NUMERICAL_NOTE, _T_DESCRIPTOR, _T_BEHAVIOR_NOTE = 7, 8, 11, 15, 19
# cudnnBackendAttributeName_t
_CONV_COMP_TYPE, _CONV_MODE, _CONV_DILATIONS, _CONV_STRIDES, _CONV_POST_PAD, _CONV_PRE_PAD, _CONV_DIMS = range(100, 107)
_HEUR_MODE, _HEUR_GRAPH, _HEUR_RESULTS = 200, 201, 202
_CFG_ENGINE = 300
_PLAN_HANDLE, _PLAN_CONFIG, _PLAN_WORKSPACE = 400, 401, 402
_GRAPH_HANDLE, _GRAPH_OPS = 800, 801
_TENSOR_ALIGNMENT, _TENSOR_DATA_TYPE, _TENSOR_DIMS, _TENSOR_STRIDES, _TENSOR_UID = 900, 901, 902, 903, 906
_PACK_UIDS, _PACK_POINTERS, _PACK_WORKSPACE = 1000, 1001, 1003
_ENGINE_INDEX, _ENGINE_NUMERICAL_NOTES, _ENGINE_BEHAVIOR_NOTES = 1301, 1303, 1305
# cudnnBackendNumericalNote_t, cudnnBackendBehaviorNote_t, cudnnBackendHeurMode_t
_NOTE_TENSOR_CORE, _NOTE_DOWN_CONVERT, _NOTE_NONDETERMINISTIC = 0, 1, 4
_NOTE_RUNTIME_COMPILATION = 0
_HEUR_FALLBACK, _HEUR_A = 2, 3
_CROSS_CORRELATION = 1

# Per direction (FORWARD, BACKWARD_DATA, BACKWARD_FILTER, as in cudnn.py): the operation's descriptor type and
# its attributes (alpha, beta, conv, a, b, out), (a, b, out) being the legacy call's operand order.
_OPERATIONS = (
    (10, (700, 701, 702, 704, 703, 705)),  # forward: a = x, b = w, out = y
    (12, (706, 707, 708, 709, 711, 710)),  # backward data: a = w, b = dy, out = dx
    (11, (712, 713, 714, 716, 717, 715)),  # backward filter: a = x, b = dy, out = dw
)
ALIGNMENT = 16  # bytes: every operand (and the workspace) must be this aligned to take the graph path
_PACK_CACHE_LIMIT = 256  # variant packs per plan (memory modes other than baseline move tensors around)
MEASURED_PLANS = 8  # candidates timed per direction when measuring (SUPERNEURONS_CUDNN_MEASURED's default; engines
# compiled at run time never are)
MEASURE_RUNS = 3  # timed executions per candidate, after one untimed


class Unsupported(RuntimeError):
    """The graph API cannot run this convolution direction here (the legacy API is used instead)."""


def enabled() -> bool:
    """SUPERNEURONS_CUDNN_GRAPH=0 keeps every convolution on the legacy API."""
    return settings.get("SUPERNEURONS_CUDNN_GRAPH")


def deterministic_only() -> bool:
    """SUPERNEURONS_CUDNN_DETERMINISTIC=1 leaves out the engines and algorithms cuDNN marks nondeterministic
    (some weight-gradient ones add partial sums with atomics), so two runs compute the same bits."""
    return settings.get("SUPERNEURONS_CUDNN_DETERMINISTIC")


class _Api:
    """The six backend functions, bound once with argument types (ctypes then converts ints directly)."""

    def __init__(self, lib: _c.CDLL):
        vp, i32, i64 = _c.c_void_p, _c.c_int, _c.c_int64
        sig = {
            "cudnnBackendCreateDescriptor": [i32, _c.POINTER(vp)],
            "cudnnBackendDestroyDescriptor": [vp],
            "cudnnBackendFinalize": [vp],
            "cudnnBackendSetAttribute": [vp, i32, i32, i64, vp],
            "cudnnBackendGetAttribute": [vp, i32, i32, i64, _c.POINTER(i64), vp],
            "cudnnBackendExecute": [vp, vp, vp],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _c.c_int
        self.create = lib.cudnnBackendCreateDescriptor
        self.destroy = lib.cudnnBackendDestroyDescriptor
        self.finalize = lib.cudnnBackendFinalize
        self.set = lib.cudnnBackendSetAttribute
        self.get = lib.cudnnBackendGetAttribute
        self.execute = lib.cudnnBackendExecute
        self._last_error = getattr(lib, "cudnnGetLastErrorString", None)
        if self._last_error is not None:
            self._last_error.argtypes, self._last_error.restype = [_c.c_char_p, _c.c_size_t], None
        lib.cudnnGetErrorString.restype = _c.c_char_p
        self._error_string = lib.cudnnGetErrorString

    def check(self, status: int, what: str) -> None:
        if status != 0:
            text = self._error_string(status).decode()
            if self._last_error is not None:
                buf = _c.create_string_buffer(512)
                self._last_error(buf, len(buf))
                if buf.value:
                    text += f": {buf.value.decode(errors='replace')}"
            raise Unsupported(f"{what} failed: cuDNN status {status} ({text})")


_api: _Api | None = None


def api() -> _Api:
    global _api
    if _api is None:
        try:
            _api = _Api(libs.load("cudnn"))
        except AttributeError as e:  # a cuDNN without the backend API (before 8.0)
            raise Unsupported(f"this cuDNN has no backend API ({e})") from None
    return _api


def _optional(read, default):
    """An attribute some cuDNN versions do not report: its value, or `default`."""
    try:
        return read()
    except Unsupported:
        return default


class _Descriptor:
    """One backend descriptor, destroyed with its Python object."""

    __slots__ = ("value", "__weakref__")

    def __init__(self, kind: int):
        self.value = _c.c_void_p()
        api().check(api().create(kind, _c.byref(self.value)), f"cudnnBackendCreateDescriptor({kind})")

    def set(self, name: int, kind: int, ctype, values) -> "_Descriptor":
        arr = (ctype * len(values))(*values)
        api().check(api().set(self.value, name, kind, len(values), arr), f"cudnnBackendSetAttribute({name})")
        return self

    def set_int64(self, name: int, *values: int) -> "_Descriptor":
        return self.set(name, _T_INT64, _c.c_int64, values)

    def set_descriptors(self, name: int, *descs: "_Descriptor") -> "_Descriptor":
        return self.set(name, _T_DESCRIPTOR, _c.c_void_p, [d.value for d in descs])

    def finalize(self) -> "_Descriptor":
        api().check(api().finalize(self.value), "cudnnBackendFinalize")
        return self

    def get_ints(self, name: int, kind: int, ctype, capacity: int) -> list[int]:
        arr, count = (ctype * capacity)(), _c.c_int64()
        api().check(api().get(self.value, name, kind, capacity, _c.byref(count), arr),
                    f"cudnnBackendGetAttribute({name})")
        return [int(v) for v in arr[:count.value]]

    def __del__(self) -> None:
        if self.value and _api is not None:
            _api.destroy(self.value)
            self.value = _c.c_void_p()


def strides(shape: tuple[int, ...], nhwc: bool = False) -> tuple[int, ...]:
    """Element strides of a packed (N, C, H, W) tensor (or filter (K, C, R, S)): NCHW, or channels last."""
    if nhwc:
        _n, c, h, w = (max(int(d), 1) for d in shape)
        return (h * w * c, 1, w * c, c)
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def _tensor(uid: int, shape: tuple[int, ...], data_type: int, nhwc: bool = False) -> _Descriptor:
    t = _Descriptor(_TENSOR)
    t.set(_TENSOR_DATA_TYPE, _T_DATA_TYPE, _c.c_int, [data_type])
    t.set_int64(_TENSOR_DIMS, *shape).set_int64(_TENSOR_STRIDES, *strides(shape, nhwc))
    t.set_int64(_TENSOR_UID, uid).set_int64(_TENSOR_ALIGNMENT, ALIGNMENT)
    return t.finalize()


def _convolution(geom: ConvGeometry, data_type: int) -> _Descriptor:
    c = _Descriptor(_CONVOLUTION)
    c.set(_CONV_COMP_TYPE, _T_DATA_TYPE, _c.c_int, [data_type])
    c.set(_CONV_MODE, _T_CONV_MODE, _c.c_int, [_CROSS_CORRELATION])
    c.set_int64(_CONV_DIMS, 2).set_int64(_CONV_DILATIONS, *geom.dilation).set_int64(_CONV_STRIDES, *geom.stride)
    c.set_int64(_CONV_PRE_PAD, *geom.pad).set_int64(_CONV_POST_PAD, *geom.pad)
    return c.finalize()


class GraphPlan:
    """One finalized execution plan, its workspace size, and its variant packs per pointer set."""

    __slots__ = ("desc", "workspace", "engine", "precompiled", "_config", "_packs")

    def __init__(self, desc: _Descriptor, workspace: int, engine: int, config: _Descriptor, precompiled: bool = True):
        self.desc = desc
        self.workspace = workspace  # bytes
        self.engine = engine  # cuDNN's global engine index (the profiler's label)
        self.precompiled = precompiled  # False: compiled at run time when its plan was built
        self._config = config  # the plan refers to it
        self._packs: dict[tuple[int, int, int, int], _Descriptor] = {}

    def execute(self, handle: int, a: int, b: int, out: int, ws: int) -> None:
        key = (a, b, out, ws)
        pack = self._packs.get(key)
        if pack is None:
            pack = self._pack(key)
        status = _api.execute(handle, self.desc.value, pack.value)
        if status != 0:
            _api.check(status, f"cudnnBackendExecute (engine {self.engine})")

    def _pack(self, key: tuple[int, int, int, int]) -> _Descriptor:
        if len(self._packs) >= _PACK_CACHE_LIMIT:
            self._packs.clear()
        pack = _Descriptor(_VARIANT_PACK)
        pack.set_int64(_PACK_UIDS, 1, 2, 3)
        pack.set(_PACK_POINTERS, _T_VOID_PTR, _c.c_void_p, list(key[:3]))
        pack.set(_PACK_WORKSPACE, _T_VOID_PTR, _c.c_void_p, [key[3]])
        self._packs[key] = pack.finalize()
        return pack


def first_precompiled(plans: Iterator, limit: int) -> tuple[list, list]:
    """Draw plans from the ranked, lazily built `plans` until `limit` precompiled ones are drawn or one
    compiled at run time is (those rank last: timing one would first compile it, up to seconds): (the
    precompiled plans drawn, [the run-time-compiled one] or [])."""
    drawn: list = []
    for plan in plans:
        if not plan.precompiled:
            return drawn, [plan]
        drawn.append(plan)
        if len(drawn) == limit:
            break
    return drawn, []


class GraphDirection:
    """One direction of one convolution shape on the graph API (see the module docstring)."""

    graph = True

    def __init__(self, handle: int, direction: int, shapes: tuple, geom: ConvGeometry, data_type: int,
                 allow_tf32: bool, beta: float, compute_type: int | None = None, nhwc: bool = False):
        if geom.group != 1:
            raise Unsupported("grouped convolutions stay on the legacy API")
        self.handle = handle
        kind, (alpha_attr, beta_attr, conv_attr, a_attr, b_attr, out_attr) = _OPERATIONS[direction]
        tensors = [_tensor(uid, tuple(int(d) for d in shape), data_type, nhwc) for uid, shape in zip((1, 2, 3), shapes)]
        op = _Descriptor(kind)
        compute = data_type if compute_type is None else compute_type  # half operands accumulate in float32
        scalar_kind, scalar_type = (_T_DOUBLE, _c.c_double) if compute == 1 else (_T_FLOAT, _c.c_float)
        op.set(alpha_attr, scalar_kind, scalar_type, [1.0]).set(beta_attr, scalar_kind, scalar_type, [beta])
        conv = _convolution(geom, compute)
        op.set_descriptors(conv_attr, conv)
        for attr, t in zip((a_attr, b_attr, out_attr), tensors):
            op.set_descriptors(attr, t)
        op.finalize()
        self.graph_desc = _Descriptor(_OPERATION_GRAPH)
        self.graph_desc.set(_GRAPH_HANDLE, _T_HANDLE, _c.c_void_p, [handle])
        self.graph_desc.set_descriptors(_GRAPH_OPS, op).finalize()
        self._keep = (tensors, conv, op)  # kept alive while the graph refers to them
        self._configs, self._precompiled = self._ranked_configs(allow_tf32 or data_type != 0)
        if not self._configs:
            raise Unsupported("cuDNN's heuristics offer no engine for this convolution")
        self._plans = self._build_plans()
        self.choices = Candidates(self._plans)

    # -- ranking -----------------------------------------------------------------------------------
    def _heuristics(self, mode: int) -> list[_Descriptor]:
        heur = _Descriptor(_ENGINEHEUR).set_descriptors(_HEUR_GRAPH, self.graph_desc)
        heur.set(_HEUR_MODE, _T_HEUR_MODE, _c.c_int, [mode]).finalize()
        count = _c.c_int64()
        api().check(api().get(heur.value, _HEUR_RESULTS, _T_DESCRIPTOR, 0, _c.byref(count), None),
                    "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)")
        configs = [_Descriptor(_ENGINECFG) for _ in range(count.value)]
        arr = (_c.c_void_p * len(configs))(*[c.value for c in configs])
        api().check(api().get(heur.value, _HEUR_RESULTS, _T_DESCRIPTOR, len(configs), _c.byref(count), arr),
                    "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)")
        return configs[:count.value]

    def _ranked_configs(self, allow_tensor_cores: bool) -> tuple[list[tuple[_Descriptor, int]], int]:
        """(config, engine index) in heuristic order (mode A, then the fallback list), without engines that
        lower the inputs' precision nor, for float32 without TF32, tensor-core engines (PyTorch's filter),
        nor, under SUPERNEURONS_CUDNN_DETERMINISTIC=1, those whose sums run in no fixed order; engines
        compiled at run time (NVRTC, up to seconds per plan) go last. Also returns how many are precompiled."""
        ranked, compiled = [], []
        for mode in (_HEUR_A, _HEUR_FALLBACK):
            try:
                configs = self._heuristics(mode)
            except Unsupported:
                continue
            for cfg in configs:
                try:
                    engine = _Descriptor(_ENGINE)
                    arr, n = (_c.c_void_p * 1)(engine.value), _c.c_int64()
                    api().check(api().get(cfg.value, _CFG_ENGINE, _T_DESCRIPTOR, 1, _c.byref(n), arr),
                                "cudnnBackendGetAttribute(ENGINECFG_ENGINE)")
                    notes = set(engine.get_ints(_ENGINE_NUMERICAL_NOTES, _T_NUMERICAL_NOTE, _c.c_int, 16))
                except Unsupported:
                    continue  # without its numerical notes an engine cannot be vetted
                if _NOTE_DOWN_CONVERT in notes or (not allow_tensor_cores and _NOTE_TENSOR_CORE in notes):
                    continue
                if _NOTE_NONDETERMINISTIC in notes and deterministic_only():
                    continue
                index = _optional(lambda: engine.get_ints(_ENGINE_INDEX, _T_INT64, _c.c_int64, 1)[0], -1)
                behaviour = _optional(lambda: set(engine.get_ints(_ENGINE_BEHAVIOR_NOTES, _T_BEHAVIOR_NOTE,
                                                                  _c.c_int, 16)), set())
                (compiled if _NOTE_RUNTIME_COMPILATION in behaviour else ranked).append((cfg, index))
        return ranked + compiled, len(ranked)

    def _build_plans(self) -> Iterator[GraphPlan]:
        """Execution plans in ranking order, skipping configurations cuDNN cannot finalize."""
        for k, (cfg, index) in enumerate(self._configs):
            try:
                desc = _Descriptor(_EXECUTION_PLAN)
                desc.set(_PLAN_HANDLE, _T_HANDLE, _c.c_void_p, [self.handle])
                desc.set_descriptors(_PLAN_CONFIG, cfg).finalize()
                workspace = desc.get_ints(_PLAN_WORKSPACE, _T_INT64, _c.c_int64, 1)[0]
            except Unsupported:
                continue
            yield GraphPlan(desc, workspace, index, cfg, precompiled=k < self._precompiled)

    # -- measuring (SUPERNEURONS_CUDNN_FIND=1) -------------------------------------------------------
    measured = False  # True once `measure` has ranked the candidates by time

    def measure(self, a: int, b: int, out: int, workspace_source) -> None:
        """Time up to MEASURED_PLANS precompiled candidates whose workspace fits what `workspace_source` has
        available now on operands a, b, out (out is written: the caller passes a scratch where the direction
        accumulates), and rank them fastest first, ahead of the candidates not timed."""
        from numba import cuda

        built, compiled = first_precompiled(self._plans, max(1, settings.get("SUPERNEURONS_CUDNN_MEASURED")))
        self.choices = Candidates(self._plans, built + compiled)
        available = workspace_source.available()
        fits = [p for p in built if p.workspace <= available]
        self.measured = True  # ranked by time from here on (one candidate that fits needs no timing)
        if len(fits) < 2:
            return
        size = max(p.workspace for p in fits)
        ws = workspace_source.acquire(size) if size else 0
        start, stop = cuda.event(), cuda.event()
        timed = []
        try:
            for k, plan in enumerate(fits):
                try:
                    self.execute(plan, a, b, out, ws)
                    start.record()
                    for _ in range(MEASURE_RUNS):
                        self.execute(plan, a, b, out, ws)
                    stop.record()
                    stop.synchronize()
                except Unsupported:
                    continue  # the engine refused these operands: it is not ranked ahead
                timed.append((cuda.event_elapsed_time(start, stop), k, plan))
        finally:
            if size:
                workspace_source.release()
        fastest = [plan for _ms, _k, plan in sorted(timed, key=lambda t: t[:2])]
        self.choices = Candidates(self._plans, fastest + [p for p in self.choices.items if p not in fastest])

    # -- running -----------------------------------------------------------------------------------
    def pick(self, available: int) -> GraphPlan:
        return self.choices.pick(available)

    def execute(self, plan: GraphPlan, a: int, b: int, out: int, ws: int) -> None:
        plan.execute(self.handle, a, b, out, ws)


class Candidates:
    """Choices in preference order, each with a `.workspace`; `pick(available)` returns the first that fits.

    The answer holds for every `available` in [its workspace, the smallest workspace of the choices before it),
    so that interval is kept and a call whose available bytes stay inside it does not scan again. `more`
    yields further choices lazily (graph plans are built only when the earlier ones do not fit)."""

    def __init__(self, more: Iterator, first: list | None = None):
        self.items = list(first or [])
        self._more: Iterator | None = more
        self._lo, self._hi, self._last = 1, 0, None  # an empty interval

    def pick(self, available: int):
        if self._lo <= available < self._hi:
            return self._last
        hi = 1 << 62
        for choice in self._all():
            if choice.workspace <= available:
                self._lo, self._hi, self._last = choice.workspace, hi, choice
                return choice
            hi = min(hi, choice.workspace)
        smallest = min((c.workspace for c in self.items), default=None)
        raise NoFit(f"no convolution algorithm fits in {available} bytes of workspace"
                    + (f" (the smallest needs {smallest})" if smallest is not None else " (none is usable)"))

    def _all(self) -> Iterator:
        yield from self.items
        while self._more is not None:
            choice = next(self._more, None)
            if choice is None:
                self._more = None
                return
            self.items.append(choice)
            yield choice


class NoFit(RuntimeError):
    """No choice's workspace fits the bytes available."""

