"""GPU twins of backend/cpu/shape_ops.py: Crop as an N-D window copy, Tile as a broadcast copy and a sum."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import cuda

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek, shape_ops as sk

__all__ = ["crop_forward", "crop_backward", "tile_forward", "tile_backward"]

_meta: dict = {}


def _window_meta(big_shape, small_shape, offsets: Sequence[int]):
    """The int64 device array window_copy reads, built once per geometry (the launch cache keys arrays by
    identity, so the same object keeps the fast launch path)."""
    key = (tuple(big_shape), tuple(small_shape), tuple(int(o) for o in offsets))
    meta = _meta.get(key)
    if meta is None:
        if len(key[2]) != len(key[0]) or len(key[1]) != len(key[0]):
            raise ValueError(f"crop of {key[0]} to {key[1]} needs one offset per axis, got {key[2]}")
        host = np.array([len(key[0]), *key[0], *key[1], *key[2]], np.int64)
        meta = _meta[key] = cuda.to_device(host)
    return meta


def crop_forward(x, y, offsets: Sequence[int]) -> None:
    """y = the window of x starting at `offsets` (one per axis) with y's shape."""
    if y.size:
        K.launch(sk.window_copy, y.size)(flat(x), flat(y), _window_meta(x.shape, y.shape, offsets), y.size, False)


def crop_backward(dy, dx, offsets: Sequence[int]) -> None:
    """dx = 0 outside the window, dy inside it."""
    if dx.size:
        K.launch(ek.fill, dx.size)(flat(dx), scalar(dx, 0.0))
    if dy.size:
        K.launch(sk.window_copy, dy.size)(flat(dy), flat(dx), _window_meta(dx.shape, dy.shape, offsets), dy.size,
                                          True)


def tile_forward(x, y, outer: int, tiles: int, inner: int) -> None:
    if y.size:
        K.launch(sk.tile_forward, y.size)(flat(x), flat(y), tiles, inner)


def tile_backward(dy, dx, outer: int, tiles: int, inner: int) -> None:
    if dx.size:
        K.launch(sk.tile_backward, dx.size)(flat(dy), flat(dx), tiles, inner)
