"""Elementwise combination of equally shaped blobs: weighted sum, product, maximum (the Eltwise layer).

The forward ops allow `top` to be `bottoms[0]` (an in-place Eltwise): bottom 0 is read before
or while it is overwritten, never after.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["eltwise_sum", "eltwise_prod", "eltwise_max", "eltwise_prod_backward", "eltwise_max_backward",
           "scaled_copy"]


def scaled_copy(alpha: float, x: np.ndarray, y: np.ndarray) -> None:
    """y = alpha * x, in y's dtype (alpha is not rounded to float32 for float64 arrays)."""
    if alpha == 1.0:
        np.copyto(y, x)
    else:
        np.multiply(x, y.dtype.type(alpha), out=y)


def eltwise_sum(bottoms: Sequence[np.ndarray], coeffs: Sequence[float], top: np.ndarray) -> None:
    """top = sum_i coeffs[i] * bottoms[i]."""
    scaled_copy(coeffs[0], bottoms[0], top)
    for b, c in zip(bottoms[1:], coeffs[1:]):
        if c == 1.0:
            top += b
        else:
            top += top.dtype.type(c) * b


def eltwise_prod(bottoms: Sequence[np.ndarray], top: np.ndarray) -> None:
    """top = prod_i bottoms[i]."""
    np.multiply(bottoms[0], bottoms[1], out=top)
    for b in bottoms[2:]:
        top *= b


def eltwise_max(bottoms: Sequence[np.ndarray], top: np.ndarray, argmax: np.ndarray) -> None:
    """top = max_i bottoms[i]; argmax = the index of the first bottom holding the maximum."""
    argmax.fill(0)
    np.copyto(top, bottoms[0])
    for i, b in enumerate(bottoms[1:], start=1):
        # Strictly greater: on ties the earlier bottom keeps the gradient, as in Caffe.
        wins = b > top
        np.copyto(top, b, where=wins)
        argmax[wins] = i


def eltwise_prod_backward(bottoms: Sequence[np.ndarray], i: int, top: np.ndarray | None, top_diff: np.ndarray,
                          bottom_diff: np.ndarray, stable: bool) -> None:
    """bottom_diff = top_diff * d(prod)/d(bottoms[i]).

    stable: the product of the other bottoms (exact even where bottoms[i] is 0);
    otherwise top / bottoms[i] (one division instead of n - 2 products; needs `top`).
    """
    if stable:
        others = [b for j, b in enumerate(bottoms) if j != i]
        grad = others[0].copy()
        for b in others[1:]:
            grad *= b
    else:
        grad = top / bottoms[i]
    np.multiply(top_diff, grad, out=bottom_diff)


def eltwise_max_backward(top_diff: np.ndarray, argmax: np.ndarray, i: int, bottom_diff: np.ndarray) -> None:
    """bottom_diff = top_diff where bottom i was the maximum, else 0."""
    np.multiply(top_diff, argmax == i, out=bottom_diff)
