"""GPU twins of backend/cpu/shape_ops.py: Crop as an N-D window copy, Tile as a broadcast copy and a sum."""
from __future__ import annotations

from typing import Sequence

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek, shape_ops as sk

__all__ = ["crop_forward", "crop_backward", "tile_forward", "tile_backward"]


def _window(big_shape, small_shape, offsets: Sequence[int]) -> tuple[int, ...]:
    """window_copy's geometry arguments: the big shape, the small shape and the offsets, over WINDOW_AXES axes.
    An axis the crop keeps whole (same size, offset 0) merges into the axis before it (its index runs over all
    of it, so the pair is one axis of the product's size, the offset scaled by it); the axes left are padded with
    leading axes of size 1. Passed by value, the geometry takes no device memory, so nothing here is allocated
    outside the Net's pool."""
    big, small, off = (tuple(int(d) for d in a) for a in (big_shape, small_shape, offsets))
    if not len(big) == len(small) == len(off):
        raise ValueError(f"crop of {big} to {small} needs one offset per axis, got {off}")
    axes: list[list[int]] = []
    for b, s, o in zip(big, small, off):
        if axes and b == s and o == 0:
            axes[-1] = [axes[-1][0] * b, axes[-1][1] * b, axes[-1][2] * b]
        else:
            axes.append([b, s, o])
    if len(axes) > sk.WINDOW_AXES:
        raise ValueError(f"crop of {big} to {small} at {off}: the GPU crops at most {sk.WINDOW_AXES} axes that "
                         f"are not kept whole")
    axes = [[1, 1, 0]] * (sk.WINDOW_AXES - len(axes)) + axes
    return tuple(b for b, _s, _o in axes) + tuple(s for _b, s, _o in axes) + tuple(o for _b, _s, o in axes)


def crop_forward(x, y, offsets: Sequence[int]) -> None:
    """y = the window of x starting at `offsets` (one per axis) with y's shape."""
    if y.size:
        K.launch(sk.window_copy, y.size)(flat(x), flat(y), y.size, False, *_window(x.shape, y.shape, offsets))


def crop_backward(dy, dx, offsets: Sequence[int]) -> None:
    """dx = 0 outside the window, dy inside it."""
    if dx.size:
        K.launch(ek.fill, dx.size)(flat(dx), scalar(dx, 0.0))
    if dy.size:
        K.launch(sk.window_copy, dy.size)(flat(dy), flat(dx), dy.size, True, *_window(dx.shape, dy.shape, offsets))


def tile_forward(x, y, outer: int, tiles: int, inner: int) -> None:
    if y.size:
        K.launch(sk.tile_forward, y.size)(flat(x), flat(y), tiles, inner)


def tile_backward(dy, dx, outer: int, tiles: int, inner: int) -> None:
    if dx.size:
        K.launch(sk.tile_backward, dx.size)(flat(dy), flat(dx), tiles, inner)
