"""Local response normalization over NCHW arrays, across channels or within each channel.

scale = shift + coeff * S(x^2), y = x * scale^-beta, where S sums a centred, zero-padded window of
`size` channels (across) or size x size pixels (within). With y_j = x_j scale_j^-beta the gradient is

    dx_i = dy_i scale_i^-beta - 2 beta coeff x_i * sum_{j : i in window(j)} dy_j y_j / scale_j

and since the window is odd and centred, "i in window(j)" is "j in window(i)": the same S again.
"""
from __future__ import annotations

import numpy as np

from superneurons.backend.geometry import LRNGeometry

__all__ = ["lrn_forward", "lrn_backward"]


def lrn_forward(x: np.ndarray, y: np.ndarray, scale: np.ndarray, geom: LRNGeometry) -> None:
    """y = LRN(x); `scale` (shape of x) receives shift + coeff * S(x^2) for the backward."""
    scale[...] = _window_sum(x * x, geom)
    scale *= geom.coeff
    scale += geom.shift
    np.multiply(x, np.power(scale, -geom.beta), out=y)


def lrn_backward(x: np.ndarray, y: np.ndarray, scale: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                 geom: LRNGeometry) -> None:
    """dx = the gradient of lrn_forward (overwritten), from its input, output and scale."""
    back = _window_sum(dy * y / scale, geom)
    back *= x
    back *= 2.0 * geom.beta * geom.coeff
    np.multiply(dy, np.power(scale, -geom.beta), out=dx)
    dx -= back


def _window_sum(a: np.ndarray, geom: LRNGeometry) -> np.ndarray:
    axes = (1,) if geom.across else (2, 3)
    for axis in axes:  # a square window is a window along H then along W
        a = _box_sum(a, geom.size, axis)
    return a


def _box_sum(a: np.ndarray, size: int, axis: int) -> np.ndarray:
    """out[..., i, ...] = sum of a[..., i - (size-1)/2 .. i + (size-1)/2, ...] along `axis`, zeros outside."""
    half = (size - 1) // 2
    n = a.shape[axis]
    widths = [(0, 0)] * a.ndim
    widths[axis] = (half, size - 1 - half)
    padded = np.pad(a, widths)
    out = np.zeros_like(a)
    index = [slice(None)] * a.ndim
    for s in range(size):
        index[axis] = slice(s, s + n)
        out += padded[tuple(index)]
    return out
