"""Softmax over the middle axis of an (outer, channels, inner) view.

Layers reshape their blobs to three axes around the softmax axis (`ops.reshape`), so one op serves
any axis; cuDNN's softmax takes the same (N, C, H*W) layout.
"""
from __future__ import annotations

import numpy as np

__all__ = ["softmax_forward", "softmax_backward"]


def softmax_forward(x: np.ndarray, y: np.ndarray) -> None:
    """y = exp(x - max) / sum(exp(x - max)) along axis 1; `y` may be `x`.

    Subtracting the max keeps exp from overflowing.
    """
    peak = x.max(axis=1, keepdims=True)
    np.subtract(x, peak, out=y)
    np.exp(y, out=y)
    y /= y.sum(axis=1, keepdims=True)


def softmax_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = y * (dy - sum(dy * y) along axis 1), from the output alone. `dx` may be `dy`."""
    inner = (dy * y).sum(axis=1, keepdims=True)
    np.subtract(dy, inner, out=dx)
    dx *= y
