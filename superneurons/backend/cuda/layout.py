"""Channels-last (NHWC) tensors on the GPU: which layout an array has, and the conversion between layouts.

A net whose graph/layout.py decision stores some 4-D blobs NHWC runs its ops through layout_conversion.py's
`with_layout_conversion`. Its arrays keep the logical shape (N, C, H, W); an NHWC one has strides (H*W*C, 1, W*C, C) (device.make), and
`flat` gives its memory in (N, H, W, C) order. For each call the wrapper looks at the 4-D arrays:
- none stored channels last: the op runs as it is;
- an elementwise op (`ELEMENTWISE`) whose 4-D arrays share one layout: as it is (flat views line up);
- an op with a channels-last path (ops/conv.py's, and channels_last_ops.py's for pooling, bias, Scale and
  BatchNorm) runs it; a 4-D array of the other layout among its arguments is converted to an NHWC copy first
  (the first convolution reads the data layer's NCHW batch) and, unless the op only reads it, written back;
- copy and axpy across layouts (a weight master and its KRSC working copy) convert in their one pass;
- any other op, or a path that refuses its arguments (`LayoutUnsupported`, raised before any work: a Scale over
  other axes): on NCHW copies of its NHWC arrays, written back afterwards.
Copies live in buffers of layout_conversion.py, beside the pool (like half_math's). The first conversion of each
op and reason logs one line, and `conversions()` counts them per op for the profiler.

A 4-D array whose layouts coincide in memory (one channel, or 1x1 planes) counts as either.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import bits, channels_last, flat, scalar
from superneurons.backend.cuda.kernels import channels_last as lk
from superneurons.dtypes import HALF_TYPES

NCHW, NHWC = "NCHW", "NHWC"


class LayoutUnsupported(TypeError):
    """Raised by a channels-last path, before any work, for arguments it cannot take in that layout."""


def layout_of(a: Any) -> str | None:
    """NHWC, NCHW, or None where the two coincide (not 4-D, one channel, 1x1 planes). Kept on the array
    object (the pool hands out the same view objects every iteration; every op call of a channels-last net asks)."""
    try:
        return a.__dict__["_sn_layout"]
    except (KeyError, AttributeError):
        pass
    layout = _layout(a)
    try:
        a._sn_layout = layout
    except AttributeError:
        pass
    return layout


def _layout(a: Any) -> str | None:
    if getattr(a, "ndim", 0) != 4 or not hasattr(a, "strides"):
        return None
    _n, c, h, w = a.shape
    if c <= 1 or h * w <= 1:
        return None
    return NHWC if channels_last(a) else NCHW


# Element types `transpose` moves exactly through its float32 tile (int32 masks take the element kernels).
TRANSPOSABLE = frozenset({np.dtype(np.float32), np.dtype(np.uint16), *HALF_TYPES})


def transpose(alpha: Any, src: Any, dst: Any, shape: tuple[int, ...], src_nhwc: bool, mode: int) -> None:
    """Between layouts (src_nhwc: src is NHWC, dst NCHW; else the reverse), flat arrays of the (N, C, H, W)
    `shape`: dst = src, alpha * src or dst + alpha * src (kernels/channels_last.transpose's modes)."""
    n, c, h, w = shape
    rows, cols = (h * w, c) if src_nhwc else (c, h * w)
    K.launch(lk.transpose, 0, blocks=lk.transpose_blocks(n, rows, cols))(alpha, src, dst, n, rows, cols, mode)


def convert(src: Any, dst: Any) -> None:
    """dst = src, two (N, C, H, W) arrays of any layouts and element types (a cast where they differ)."""
    if not dst.size:
        return
    if src.shape != dst.shape:
        raise ValueError(f"layout conversion of {src.shape} into {dst.shape}")
    _n, c, h, w = dst.shape
    s_nhwc, d_nhwc = layout_of(src) == NHWC, layout_of(dst) == NHWC
    fs, fd = flat(src), flat(dst)
    if src.dtype == dst.dtype and src.dtype in HALF_TYPES:
        fs, fd = bits(fs), bits(fd)
    if s_nhwc != d_nhwc and src.dtype in TRANSPOSABLE and dst.dtype in TRANSPOSABLE:
        same = src.dtype == dst.dtype
        transpose(np.float32(1.0), fs, fd, dst.shape, s_nhwc, lk.COPY if same else lk.SCALE)
    elif src.dtype == dst.dtype:
        K.launch(lk.convert, dst.size)(fs, fd, c, h * w, s_nhwc, d_nhwc)
    else:
        K.launch(lk.convert_cast, dst.size)(scalar(dst, 1.0), fs, fd, c, h * w, s_nhwc, d_nhwc)
