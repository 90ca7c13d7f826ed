"""Half-precision storage on the CPU: every op computes in float32 on its half arrays' values.

The ops are written for one dtype. Wrapped by `float32_math`, an op given float16 or bfloat16 arrays works
on float32 copies of them, and the copies it changed are rounded back (to nearest, ties to even) into the
half arrays: storage in half precision, math in float32, as the GPU's half kernels accumulate in float32.
Ops given no half array run untouched. Ops that return an array viewing their input (`reshape`) or hand
arrays between memories are not wrapped (`UNWRAPPED`).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from superneurons.dtypes import FLOAT32, HALF_TYPES

HALF = frozenset(HALF_TYPES)
UNWRAPPED = frozenset({"reshape", "download", "pin_host", "upload_pinned", "conv_algorithm"})


def _is_half(a: Any) -> bool:
    if type(a) is np.ndarray:
        return a.dtype in HALF
    if isinstance(a, (list, tuple)):
        return any(type(x) is np.ndarray and x.dtype in HALF for x in a)
    return False


def float32_math(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not any(map(_is_half, args)) and not any(map(_is_half, kwargs.values())):
            return fn(*args, **kwargs)
        work: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # id -> (half, float32 copy, as read)

        def widen(a: Any) -> Any:
            if type(a) is np.ndarray and a.dtype in HALF:
                entry = work.get(id(a))  # one copy per array, so an op working in place sees one array
                if entry is None:
                    copy = a.astype(FLOAT32)
                    entry = work[id(a)] = (a, copy, copy.copy())
                return entry[1]
            if isinstance(a, (list, tuple)) and _is_half(a):
                return type(a)(widen(x) for x in a)
            return a

        result = fn(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()})
        for half, copy, before in work.values():
            if not (copy.view(np.uint32) == before.view(np.uint32)).all():  # bits changed: written, round into storage
                with np.errstate(over="ignore"):  # beyond float16's range is Inf, as on the device
                    half[...] = copy
        return result

    return run


def with_float32_math(ops: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{name: fn if name in UNWRAPPED else float32_math(fn) for name, fn in vars(ops).items()})
