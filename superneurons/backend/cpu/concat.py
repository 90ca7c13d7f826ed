"""Concatenation along one axis and its inverse (the diff of each bottom is its slice of the top diff), and the
backward of a ReLU in place on a Concat's bottom read straight from that slice (graph/fuse.py)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superneurons.backend.cpu.activation import relu_backward

__all__ = ["concat_forward", "concat_backward", "relu_backward_slab"]


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


def relu_backward_slab(y: np.ndarray, top_diff: np.ndarray, dx: np.ndarray, axis: int, offset: int,
                       slope: float) -> None:
    """dx = the ReLU's backward of the slice of `top_diff` along `axis` starting at `offset` (y: the ReLU's
    output, dx's shape): the same bits as concat_backward into dx, then relu_backward in place."""
    relu_backward(y, _slab(top_diff, axis, offset, dx.shape[axis]), dx, slope)


def _slab(x: np.ndarray, axis: int, start: int, width: int) -> np.ndarray:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + width)
    return x[tuple(index)]
