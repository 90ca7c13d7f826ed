"""Concatenation along one axis and its inverse, as slab copies over (outer, axis, inner) views
(kernels/slab.py: which walk runs for which row length, and why)."""
from __future__ import annotations

from math import prod
from typing import Sequence

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import slab as sk

__all__ = ["concat_forward", "concat_backward", "slab_copy"]


def slab_copy(src, dst, axis: int, src_offset: int, dst_offset: int, width: int,
              max_blocks: int = K.MAX_BLOCKS) -> None:
    """dst[..., dst_offset:dst_offset + width, ...] = src[..., src_offset:src_offset + width, ...] along
    `axis` (src and dst agree on every other dimension), on a grid of at most `max_blocks` blocks."""
    outer, inner = prod(src.shape[:axis]), prod(src.shape[axis + 1:])
    length = width * inner
    if not outer or not length:
        return
    args = (flat(src), flat(dst), outer, src.shape[axis] * inner, src_offset * inner, dst.shape[axis] * inner,
            dst_offset * inner, length)
    if length < sk.ROWS_MIN:
        quarter = -(-outer * length // K.UNROLL)  # four elements per thread per trip
        K.launch(sk.copy_short_rows, 0, blocks=min(-(-quarter // K.BLOCK), max_blocks))(*args)
        return
    parts = -(-length // sk.PART)
    # equal parts rounded up to whole four-load trips (a row of 4100: 3072 + 1028 elements, not 4096 + 4)
    part = -(-length // (parts * K.UNROLL * K.BLOCK)) * K.UNROLL * K.BLOCK
    parts = -(-length // part)
    K.launch(sk.copy_rows, 0, blocks=min(outer * parts, max_blocks))(*args, part, parts)


def concat_forward(bottoms: Sequence, top, axis: int) -> None:
    offset = 0
    for b in bottoms:
        slab_copy(b, top, axis, 0, offset, b.shape[axis])
        offset += b.shape[axis]


def concat_backward(top_diff, bottom_diff, axis: int, offset: int) -> None:
    slab_copy(top_diff, bottom_diff, axis, offset, 0, bottom_diff.shape[axis])
