"""Shared host helpers of the extra GPU ops: float64 sums in the run's scratch region and the row sums of
kernels/rows.py.

No `__all__`: collect_ops gathers nothing from here.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import BLOCK, elementwise as ek, rows as rk
from superneurons.backend.scratch import row_sums as row_sums_entries


def take(scratch, n: int, at: int = 0):
    """float64 entries [at, at + n) of the run's scratch region (`scratch`: the Net's planned `#scratch` tensor,
    backend/scratch.py), as a view built once per region and kept on it (the kernels' launch cache keys arrays
    by identity). Without a region (an op called outside a Net: tests, benchmarks) a private array."""
    n = max(int(n), 1)
    if scratch is None:
        return cuda.device_array(n, np.float64)
    region = flat(scratch)
    if region.dtype != np.float64 or at + n > region.size:
        raise RuntimeError(f"scratch entries [{at}, {at + n}) asked for, the net planned {region.size} "
                           f"{region.dtype} entries: the calling layer's scratch_entries() declares too few")
    if at == 0 and n == region.size:
        return region
    key = ("_sn_take", at, n)
    try:
        return region.__dict__[key]
    except (KeyError, AttributeError):
        pass
    view = region[at:at + n]
    try:
        region.__dict__[key] = view
    except AttributeError:
        pass
    return view


def zero(buf) -> None:
    K.launch(ek.fill, buf.size)(buf, np.float64(0.0))


def row_sums(x, y, outer: int, dim: int, inner: int, mode: int, scratch, at: int = 0):
    """float64 sums[2 * dim] of kernels/rows.py `mode` over the rows of x (and y) viewed as (outer, dim, inner),
    in the scratch region's entries from `at` (backend/scratch.py: row_sums(dim) of them)."""
    sums = take(scratch, row_sums_entries(dim), at)
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
