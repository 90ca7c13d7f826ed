"""Crop and Tile: copies between a blob and a window or repetition of it (Slice reuses the concat ops)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["crop_forward", "crop_backward", "tile_forward", "tile_backward"]


def _window(x: np.ndarray, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    return x[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]


def crop_forward(x: np.ndarray, y: np.ndarray, offsets: Sequence[int]) -> None:
    """y = the window of x starting at `offsets` (one per axis) with y's shape."""
    np.copyto(y, _window(x, offsets, y.shape))


def crop_backward(dy: np.ndarray, dx: np.ndarray, offsets: Sequence[int]) -> None:
    """dx = 0 outside the window, dy inside it."""
    dx.fill(0)
    _window(dx, offsets, dy.shape)[...] = dy


def tile_forward(x: np.ndarray, y: np.ndarray, outer: int, tiles: int, inner: int) -> None:
    """x viewed as (outer, inner) is repeated `tiles` times into y viewed as (outer, tiles, inner)."""
    y.reshape(outer, tiles, inner)[...] = x.reshape(outer, 1, inner)


def tile_backward(dy: np.ndarray, dx: np.ndarray, outer: int, tiles: int, inner: int) -> None:
    """dx = the sum of dy's `tiles` copies."""
    np.sum(dy.reshape(outer, tiles, inner), axis=1, out=dx.reshape(outer, inner))
