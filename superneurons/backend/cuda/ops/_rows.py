"""Shared host helpers of the extra GPU ops: float64 scratch buffers and the row sums of kernels/rows.py.

No `__all__`: collect_ops gathers nothing from here.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import BLOCK, elementwise as ek, rows as rk

_scratch: dict = {}


def scratch(tag: str, n: int):
    """A float64 device array of `n` entries for one purpose (`tag`), allocated once and reused: all work runs
    on one stream, so the next op using it starts after the last one finished with it."""
    key = (tag, n)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = cuda.device_array(max(n, 1), np.float64)
    return buf


def zero(buf) -> None:
    K.launch(ek.fill, buf.size)(buf, np.float64(0.0))


def row_sums(x, y, outer: int, dim: int, inner: int, mode: int, tag: str):
    """float64 sums[2 * dim] of kernels/rows.py `mode` over the rows of x (and y) viewed as (outer, dim, inner)."""
    sums = scratch(tag, 2 * dim)
    m = outer * inner
    fx = flat(x)
    fy = flat(y) if y is not None else fx
    if m < BLOCK:
        K.launch(rk.serial, dim)(fx, fy, sums, outer, dim, inner, mode)
    else:
        zero(sums)
        chunk, blocks = rk.chunking(m, dim)
        K.launch(rk.partials, 0, blocks=blocks)(fx, fy, sums, outer, dim, inner, chunk, mode)
    return sums


def device_float(value) -> float:
    """A host float of a 0-d or 1-element device array (for error paths and host-side normalizers)."""
    return float(flat(value).copy_to_host()[0])
