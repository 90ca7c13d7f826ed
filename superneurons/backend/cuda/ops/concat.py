"""Concatenation along one axis and its inverse, as slab copies over (outer, axis, inner) views
(kernels/slab.py: which walk runs for which row length, and why), and the backward of a ReLU in place on a
Concat's bottom read straight from its slice of the top gradient (graph/fuse.py): the same slab copy, through
the ReLU's mask."""
from __future__ import annotations

from math import prod
from typing import Sequence

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import slab as sk

# the ops (backend.base.collect_ops); slab_copy is this module's helper
__all__ = ["concat_forward", "concat_backward", "relu_backward_slab"]

TASKS_MIN = 2048  # copy_rows tasks from which rows are not split finer than PART (~2 waves of blocks on an H100)


def row_parts(outer: int, length: int) -> tuple[int, int]:
    """(elements per part, parts per row) of copy_rows for `outer` rows of `length` >= ROWS_MIN elements.

    Parts of at most PART elements, smaller (down to one trip of four loads per thread) while there are fewer
    than TASKS_MIN tasks, so that a small copy (Inception-v4's 8x8 concats) still occupies every SM. Equal
    parts rounded up to whole trips: among many rows, one of 4100 elements is 3072 + 1028, not 4096 + 4.
    """
    trip = K.UNROLL * K.BLOCK
    parts = -(-length // sk.PART)
    if outer * parts < TASKS_MIN:
        parts = max(parts, min(-(-length // trip), -(-TASKS_MIN // outer)))
    part = -(-length // (parts * trip)) * trip
    return part, -(-length // part)


def slab_copy(src, dst, axis: int, src_offset: int, dst_offset: int, width: int,
              max_blocks: int = K.MAX_BLOCKS, relu_output=None, slope: float = 0.0,
              order: Sequence[int] | None = None) -> None:
    """dst[..., dst_offset:dst_offset + width, ...] = src[..., src_offset:src_offset + width, ...] along
    `axis` (src and dst agree on every other dimension), on a grid of at most `max_blocks` blocks; with
    `relu_output` (dst's shape), each value goes through the backward of the ReLU that output came from.
    `order`: the logical axes in the order memory holds them (default: as numbered; channels last stores
    (N, C, H, W) as (0, 2, 3, 1)), which sets the rows a slab is cut from."""
    stored = [src.shape[k] for k in order] if order is not None else list(src.shape)
    at = list(order).index(axis) if order is not None else axis
    outer, inner = prod(stored[:at]), prod(stored[at + 1:])
    length = width * inner
    if not outer or not length:
        return
    relu = relu_output is not None
    args = (flat(src), flat(dst), outer, src.shape[axis] * inner, src_offset * inner, dst.shape[axis] * inner,
            dst_offset * inner, length, flat(relu_output if relu else dst), scalar(dst, slope), relu)
    if length < sk.ROWS_MIN:
        quarter = -(-outer * length // K.UNROLL)  # four elements per thread per trip
        K.launch(sk.copy_short_rows, 0, blocks=min(-(-quarter // K.BLOCK), max_blocks))(*args)
        return
    part, parts = row_parts(outer, length)
    K.launch(sk.copy_rows, 0, blocks=min(outer * parts, max_blocks))(*args, part, parts)


def concat_forward(bottoms: Sequence, top, axis: int) -> None:
    offset = 0
    for b in bottoms:
        slab_copy(b, top, axis, 0, offset, b.shape[axis])
        offset += b.shape[axis]


def concat_backward(top_diff, bottom_diff, axis: int, offset: int) -> None:
    slab_copy(top_diff, bottom_diff, axis, offset, 0, bottom_diff.shape[axis])


def relu_backward_slab(y, top_diff, dx, axis: int, offset: int, slope: float) -> None:
    slab_copy(top_diff, dx, axis, offset, 0, dx.shape[axis], relu_output=y, slope=slope)
