"""float16 and bfloat16 storage on the GPU: which ops compute on half arrays themselves, and float32 copies for
the rest.

Most ops take half arrays as they are: the numba kernels load a half value, compute in float32 (`device.scalar`
makes their scalars float32) and round once when they store; cuDNN runs HALF and BFLOAT16 descriptors with
float32 compute; cuBLAS's GemmEx takes half operands and accumulates in float32. An op that cannot take the
types it is given says so before doing any work (`Unsupported`: cuDNN wants one type for its operands, cuBLAS
two equal operand types), and a numba kernel that does not compile for a half type fails before it runs. Either
way the op then runs once more on float32 copies of its half arrays, and the copies are rounded back into them
(as the CPU backend runs every op, backend/cpu/half_storage.py); the first such call of each op logs one line.

In a Net the copies come from the pool (copy_room.py): a step's planned room for them, else the net's reserve
(SUPERNEURONS_COPY_RESERVE bytes, none by default); a call that needs more uses this module's per-argument
device buffers, outside the plan, with one warning naming the bytes to reserve: which op refuses is known only
when it refuses, so no layer can declare the bytes. Outside a Net those buffers serve too. A float32 layer reading a half bottom (a loss reading the last InnerProduct's output), the case the zoo nets have,
never comes here: the Net casts its half bottoms and their gradients into float32 buffers the plan holds
(`Layer.use_float32_copies`), so its ops see one type. What is left is an op refusing the types a layer stores
on purpose, which the log line names.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from superneurons.backend.cuda import copy_room, kernels as K
from superneurons.backend.cuda.device import channels_last, flat, make, pointer, scalar
from superneurons.backend.cuda.kernels import elementwise as ek
from superneurons.backend.log_line import log_line
from superneurons.dtypes import FLOAT32, HALF_TYPES, dtype_name

HALF = frozenset(HALF_TYPES)
# Ops that move arrays between memories or return views: never wrapped.
UNWRAPPED = frozenset({"reshape", "download", "upload", "pin_host", "upload_pinned", "conv_algorithm"})


class Unsupported(TypeError):
    """Raised by an op, before it has done any work, for argument types it has no path for."""


def require_one_type(*arrays: Any) -> None:
    """An op whose library call takes operands of one type: refuse a mix (None entries are skipped)."""
    types = {a.dtype for a in arrays if a is not None}
    if len(types) > 1:
        raise Unsupported(f"operands of {', '.join(sorted(dtype_name(t) for t in types))}")


def _is_half(a: Any) -> bool:
    dtype = getattr(a, "dtype", None)
    if dtype is not None:
        return dtype in HALF and hasattr(a, "shape")
    if isinstance(a, (list, tuple)):
        return any(_is_half(x) for x in a)
    return False


def _compile_errors() -> tuple[type, ...]:
    try:
        from numba.core.errors import LoweringError, TypingError, UnsupportedError

        return (Unsupported, TypingError, LoweringError, UnsupportedError)
    except ImportError:  # pragma: no cover - numba without its core errors module
        return (Unsupported,)


_ERRORS = _compile_errors()  # what an op that has no path for its argument types raises before any work
_refused: dict[tuple[str, tuple], str] = {}  # (op, half dtypes of its arguments) -> why it runs on copies
_refusing: set[str] = set()  # the ops in _refused
_buffers: dict[int, Any] = {}  # argument slot -> float32 device buffer (grown, never shrunk)


def refused() -> dict[tuple[str, tuple], str]:
    """The ops that ran on float32 copies so far, and why (what the log line said, for tests)."""
    return dict(_refused)


def _signature(args, kwargs) -> tuple:
    return tuple(dtype_name(a.dtype) if hasattr(a, "dtype") and _is_half(a) else "" for a in (*args, *kwargs.values()))


def _log(name: str, signature: tuple, why: str) -> None:
    kinds = sorted({s for s in signature if s})
    log_line("W", "half_math.py", f"GPU op {name} has no {'/'.join(kinds)} path for these arguments ({why}): it "
             f"runs on float32 copies")


def _float32_buffer(slot: int, size: int) -> Any:
    buf = _buffers.get(slot)
    if buf is None or buf.size < size:
        from numba import cuda

        _buffers.pop(slot, None)
        buf = _buffers[slot] = cuda.device_array(max(size, 1), np.float32)
    return buf


def _address(a: Any) -> int:
    try:
        return pointer(a)
    except AttributeError:  # the simulator's arrays are NumPy arrays
        return int(a.__array_interface__["data"][0])


def _cast(src: Any, dst: Any) -> None:
    if dst.size:
        K.launch(ek.scale_copy, dst.size)(scalar(dst, 1.0), flat(src), flat(dst))


def on_float32_copies(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Run `fn` with each half array replaced by a float32 copy, then round every copy back into its array.
    Arrays over the same memory share one copy, so an op given a tensor twice (in place) sees one array."""
    copies: dict[tuple[int, int], tuple[Any, Any]] = {}  # (address, size) -> (half array, float32 copy)
    planned = copy_room.in_net()
    start = copy_room.mark()

    def widen(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and not hasattr(a, "dtype"):
            return type(a)(widen(x) for x in a)
        if not _is_half(a):
            return a
        key = (_address(a) if a.size else id(a), a.size)
        entry = copies.get(key)
        if entry is None:
            layout = "NHWC" if channels_last(a) else "NCHW"
            copy = copy_room.take(a.shape, FLOAT32, layout, getattr(fn, "__name__", "op"),
                                  f"float32 copies of {dtype_name(a.dtype)} arguments") if planned else None
            if copy is None:  # outside a Net, or past its room (copy_room.py)
                buf = _float32_buffer(len(copies), a.size)
                copy = (make(buf.gpu_data, a.shape, FLOAT32, layout)  # its layout
                        if hasattr(buf, "gpu_data") else buf[:a.size].reshape(a.shape))
            _cast(a, copy)
            entry = copies[key] = (a, copy)
        return entry[1]

    try:
        result = fn(*(widen(a) for a in args), **{k: widen(v) for k, v in kwargs.items()})
        for half, copy in copies.values():  # unchanged values round back to themselves exactly
            _cast(copy, half)
    finally:
        copy_room.release(start)
    return result


def half_fallback(name: str, fn: Callable) -> Callable:
    """`fn` that runs on float32 copies (`on_float32_copies`) the argument types it refuses, remembered per
    op and types. Every op call of a net goes through here, so the common case costs one set lookup: the types
    of the arguments are looked at only for an op that has refused some before, or when `fn` refuses now."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if name in _refusing and (name, _signature(args, kwargs)) in _refused:
            return on_float32_copies(fn, args, kwargs)
        try:
            return fn(*args, **kwargs)
        except _ERRORS as e:
            if not any(map(_is_half, args)) and not any(map(_is_half, kwargs.values())):
                raise  # not a half path missing: the op's own error
            signature = _signature(args, kwargs)
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            _refused[(name, signature)] = why
            _refusing.add(name)
            _log(name, signature, why)
        return on_float32_copies(fn, args, kwargs)

    return run


def with_half_fallback(ops: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{name: fn if name in UNWRAPPED else half_fallback(name, fn)
                              for name, fn in vars(ops).items()})
