"""Elementwise combination of equally shaped blobs: weighted sum, product, maximum (the Eltwise layer).

The forward ops allow `top` to be `bottoms[0]` (an in-place Eltwise): bottom 0 is read before
or while it is overwritten, never after.

`eltwise_sum_relu(_backward)` are a SUM fused with the ReLU in place on its top (graph/fuse.py). They repeat
the unfused sequence's arithmetic (sum, then ReLU; ReLU's gradient, then the scaled copies), so a fused net
trains bit-identically to an unfused one; the CUDA twins save the passes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superneurons.backend.cpu.activation import relu_backward, relu_forward

__all__ = ["eltwise_sum", "eltwise_prod", "eltwise_max", "eltwise_prod_backward", "eltwise_max_backward",
           "scaled_copy", "eltwise_sum_relu", "eltwise_sum_relu_backward"]


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


def eltwise_sum_relu(bottoms: Sequence[np.ndarray], coeffs: Sequence[float], top: np.ndarray, slope: float) -> None:
    """top = relu(sum_i coeffs[i] * bottoms[i]), Caffe's leaky ReLU with negative_slope `slope`."""
    eltwise_sum(bottoms, coeffs, top)
    relu_forward(top, top, slope)


def eltwise_sum_relu_backward(top: np.ndarray, top_diff: np.ndarray, coeffs: Sequence[float],
                              bottom_diffs: Sequence[np.ndarray], slope: float) -> None:
    """bottom_diffs[k] = coeffs[k] * (top_diff masked by top > 0, leaky slope), the backward of
    eltwise_sum_relu (slope >= 0: top > 0 exactly where the sum is, so the output suffices).

    Written in order, each from top_diff: an output that is top_diff itself (an in-place Eltwise, or a
    bottom gradient sharing the top gradient's memory) must come last.
    """
    for c, dx in zip(coeffs, bottom_diffs):
        relu_backward(top, top_diff, dx, slope)
        if c != 1.0:
            scaled_copy(c, dx, dx)


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
