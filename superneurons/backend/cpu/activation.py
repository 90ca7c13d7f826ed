"""Elementwise activations.

Every backward here reads the output `y`, never the input: the layers declare NEEDS_TOP, which lets
them run in place (then `x is y` in forward and `dx is dy` in backward) and lets liveness free the input.
"""
from __future__ import annotations

import numpy as np

__all__ = ["relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward"]


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


def sigmoid_forward(x: np.ndarray, y: np.ndarray) -> None:
    """y = 1 / (1 + exp(-x)), computed as 0.5 * tanh(x / 2) + 0.5, which cannot overflow for large |x|."""
    np.multiply(x, 0.5, out=y)
    np.tanh(y, out=y)
    y *= 0.5
    y += 0.5


def sigmoid_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = dy * y * (1 - y)."""
    np.multiply(dy, y * (1 - y), out=dx)


def tanh_forward(x: np.ndarray, y: np.ndarray) -> None:
    np.tanh(x, out=y)


def tanh_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = dy * (1 - y^2)."""
    np.multiply(dy, 1 - y * y, out=dx)
