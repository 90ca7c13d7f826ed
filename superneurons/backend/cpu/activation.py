"""Elementwise activations."""
from __future__ import annotations

import numpy as np

__all__ = ["relu_forward", "relu_backward"]


def relu_forward(x: np.ndarray, y: np.ndarray, slope: float) -> None:
    if slope == 0.0:
        np.maximum(x, 0, out=y)
    else:
        y[...] = np.where(x > 0, x, x * slope).astype(y.dtype, copy=False)


def relu_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray, slope: float) -> None:
    """Uses the output: y > 0 iff x > 0 for slope >= 0 (in-place safe)."""
    if slope == 0.0:
        np.multiply(dy, y > 0, out=dx)
    else:
        np.multiply(dy, np.where(y > 0, 1.0, slope).astype(dy.dtype, copy=False), out=dx)
