"""Concatenation along one axis and its inverse, as slab copies over (outer, axis, inner) views."""
from __future__ import annotations

from math import prod
from typing import Sequence

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import elementwise as ek

__all__ = ["concat_forward", "concat_backward"]


def _slab(src, dst, axis: int, src_offset: int, dst_offset: int, width: int) -> None:
    big = src if src.shape[axis] >= dst.shape[axis] else dst
    outer, inner = prod(big.shape[:axis]), prod(big.shape[axis + 1:])
    n = outer * width * inner
    if n:
        K.launch(ek.slab_copy, n)(flat(src), flat(dst), outer, src.shape[axis], src_offset, dst.shape[axis],
                                  dst_offset, width, inner)


def concat_forward(bottoms: Sequence, top, axis: int) -> None:
    offset = 0
    for b in bottoms:
        _slab(b, top, axis, 0, offset, b.shape[axis])
        offset += b.shape[axis]


def concat_backward(top_diff, bottom_diff, axis: int, offset: int) -> None:
    _slab(top_diff, bottom_diff, axis, offset, 0, bottom_diff.shape[axis])
