"""Per op call: which ops take channels-last arrays as they are, and conversions for the rest (layout.py has
the conversion; see its docstring for the rules)."""
from __future__ import annotations

import functools
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from superneurons.backend.cuda import channels_last_ops, copy_room
from superneurons.backend.cuda.device import make
from superneurons.backend.cuda.half_math import half_fallback
from superneurons.backend.cuda.layout import NCHW, NHWC, LayoutUnsupported, convert, layout_of
from superneurons.backend.log_line import log_line

# ---- which ops take what ---------------------------------------------------------------------------------
ELEMENTWISE = frozenset({
    "fill", "copy", "axpy", "axpby", "scal", "asum", "sumsq", "dot", "all_finite",
    "relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward",
    "elu_forward", "elu_backward", "absval_forward", "absval_backward", "bnll_forward", "bnll_backward",
    "exp_forward", "exp_backward", "log_forward", "log_backward", "power_forward", "power_backward",
    "threshold_forward", "clip_forward", "clip_backward", "swish_forward", "swish_backward",
    "eltwise_sum", "eltwise_prod", "eltwise_max", "eltwise_prod_backward", "eltwise_max_backward", "scaled_copy",
    "eltwise_sum_relu", "eltwise_sum_relu_backward",
})
# Ops that read arguments' layouts themselves (ops/conv.py) or have a path in channels_last_ops.py.
SELF_AWARE = frozenset({"conv_forward", "conv_backward", "conv_relu_forward"})
DIRECT = frozenset({"copy", "axpy"})  # their channels-last paths take mixed layouts themselves (one pass)
UNWRAPPED = frozenset({"reshape", "download", "upload", "pin_host", "upload_pinned", "upload_async", "conv_algorithm"})

_logged: set = set()
_counts: Counter = Counter()
_buffers: dict[tuple[int, str], Any] = {}  # (slot, dtype) -> device buffer (grown, never shrunk)


def conversions() -> dict[str, int]:
    """Calls per op that converted arguments so far (`superneurons time` shows them)."""
    return dict(_counts)


def _log(name: str, why: str) -> None:
    log_line("I", "layout_conversion.py", f"GPU op {name} converts layouts ({why})")


_views: dict[tuple, Any] = {}  # (slot, shape, dtype, layout) -> the array over that slot's buffer


def _buffer(slot: int, like: Any, layout: str) -> Any:
    """Slot `slot`'s buffer as an array shaped like `like` in `layout`: the same object for the same request
    (kernel launches and flat views are cached per array object; a new header per call costs numba's slow
    launch path, ~0.3 ms)."""
    key = (slot, tuple(like.shape), like.dtype.str, layout)
    view = _views.get(key)
    if view is not None:
        return view
    from numba import cuda

    buf_key = (slot, like.dtype.str)
    buf = _buffers.get(buf_key)
    if buf is None or buf.size < like.nbytes:
        _buffers.pop(buf_key, None)
        for k in [k for k in _views if (k[0], k[2]) == buf_key]:
            del _views[k]  # over the buffer being replaced
        buf = _buffers[buf_key] = cuda.device_array(max(int(like.nbytes), 1), np.uint8)
    view = _views[key] = make(buf.gpu_data, like.shape, like.dtype, layout)
    return view


_BITS = {None: 0, NCHW: 2, NHWC: 1}


def _layout_bits(values) -> int:
    """Bit 1: an NHWC array among `values` (or in a list among them); bit 2: an NCHW one. Every op call of a
    channels-last net asks, so this stays a loop of dictionary lookups (layouts are kept on the arrays)."""
    bits = 0
    for v in values:
        cls = v.__class__
        if cls in _PLAIN:
            continue
        if cls is list or cls is tuple:
            bits |= _layout_bits(v)
            continue
        try:
            bits |= _BITS[v.__dict__["_sn_layout"]]
        except (KeyError, AttributeError):
            bits |= _BITS[layout_of(v)]
    return bits


_PLAIN = frozenset({int, float, bool, str, type(None), np.float32, np.float64, np.int32, np.int64, np.bool_})


# Positional arguments the ops with a channels-last path only read: their converted copies are not written back
# (the first convolution's input batch, forward and backward).
READ_ONLY = {"conv_forward": (0, 1), "conv_relu_forward": (0, 1), "conv_backward": (0, 1, 2), "pool_forward": (0,),
             "pool_backward": (0, 1)}


def on_copies(fn: Callable, args: tuple, kwargs: dict, target: str, read_only: tuple[int, ...] = ()) -> Any:
    """Run `fn` with every 4-D array not stored in `target` layout replaced by a copy in it, then write the
    copies back, but for the positional arguments `read_only` names. Arrays over the same memory share one copy
    (an op given a tensor twice sees one array). In a Net the copies come from the step's planned room
    (copy_room.py: the layer's `use_layout_copies` buffer, or the net's reserve); outside one, from this module's
    buffers."""
    copies: dict[tuple, tuple[Any, Any]] = {}
    written: set[tuple] = set()
    planned = copy_room.in_net()
    start = copy_room.mark()

    def swap(a: Any, reading: bool = False) -> Any:
        if isinstance(a, (list, tuple)) and not hasattr(a, "dtype"):
            return type(a)(swap(x, reading) for x in a)
        layout = layout_of(a)
        if layout is None or layout == target:
            return a
        key = (a.device_ctypes_pointer.value, a.size, a.dtype.str)
        if not reading:
            written.add(key)
        entry = copies.get(key)
        if entry is None:
            copy = (copy_room.take(a.shape, a.dtype, target, getattr(fn, "__name__", "op"), f"{target} copies")
                    if planned else None)
            if copy is None:  # outside a Net, or past its room (copy_room.py)
                copy = _buffer(len(copies), a, target)
            convert(a, copy)
            entry = copies[key] = (a, copy)
        return entry[1]

    try:
        swapped = [swap(a, k in read_only) for k, a in enumerate(args)]
        result = fn(*swapped, **{k: swap(v) for k, v in kwargs.items()})
        for key, (original, copy) in copies.items():
            if key in written:
                convert(copy, original)
    finally:
        copy_room.release(start)
    return result


def layout_converting(name: str, fn: Callable, channels_last_fn: Callable | None) -> Callable:
    elementwise = name in ELEMENTWISE
    path = fn if name in SELF_AWARE else channels_last_fn
    direct = path is not None and name in DIRECT

    @functools.wraps(fn)
    def run(*args, **kwargs):
        bits = _layout_bits(args)
        if kwargs:
            bits |= _layout_bits(kwargs.values())
        if not bits & 1:  # no NHWC array
            return fn(*args, **kwargs)
        if elementwise and bits == 1:
            return fn(*args, **kwargs)
        if direct:
            return path(*args, **kwargs)
        if path is not None:
            try:
                if bits == 1:
                    return path(*args, **kwargs)
                _note(name, "NCHW operands to NHWC copies")
                return on_copies(path, args, kwargs, NHWC, READ_ONLY.get(name, ()))
            except LayoutUnsupported as e:
                _note(name, f"{e}: NHWC operands to NCHW copies")
                return on_copies(fn, args, kwargs, NCHW)
        _note(name, "no NHWC path: NHWC operands to NCHW copies")
        return on_copies(fn, args, kwargs, NCHW)

    return run


def _note(name: str, why: str) -> None:
    _counts[name] += 1
    if (name, why) not in _logged:
        _logged.add((name, why))
        _log(name, why)


def with_layout_conversion(ops: SimpleNamespace, half: bool = True) -> SimpleNamespace:
    """`ops` wrapped (see the module docstring); `half`: the net stores half types, so the channels-last paths
    run on float32 copies where their kernels refuse half arrays, as `ops` do (half_math.py)."""
    def path(name: str):
        if name not in channels_last_ops.NAMES:
            return None
        fn = getattr(channels_last_ops, name)
        return half_fallback(name, fn) if half else fn

    return SimpleNamespace(**{name: fn if name in UNWRAPPED else layout_converting(name, fn, path(name))
                              for name, fn in vars(ops).items()})
