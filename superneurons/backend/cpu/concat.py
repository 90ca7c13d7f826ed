"""Concatenation along one axis and its inverse (the diff of each bottom is its slice of the top diff)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["concat_forward", "concat_backward"]


def concat_forward(bottoms: Sequence[np.ndarray], top: np.ndarray, axis: int) -> None:
    """top = the bottoms joined along `axis` (their other dimensions match)."""
    offset = 0
    for b in bottoms:
        width = b.shape[axis]
        _slab(top, axis, offset, width)[...] = b
        offset += width


def concat_backward(top_diff: np.ndarray, bottom_diff: np.ndarray, axis: int, offset: int) -> None:
    """bottom_diff = the slice of `top_diff` along `axis` that starts at `offset`."""
    np.copyto(bottom_diff, _slab(top_diff, axis, offset, bottom_diff.shape[axis]))


def _slab(x: np.ndarray, axis: int, start: int, width: int) -> np.ndarray:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + width)
    return x[tuple(index)]
