"""Mean-variance normalization over rows of a (rows, n) view (per channel, or per sample across channels)."""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["mvn_forward", "mvn_backward"]


def mvn_forward(x: np.ndarray, y: np.ndarray, sigma: np.ndarray | None, rows: int, n: int, eps: float,
                scratch: Any = None) -> None:
    """y = x - mean(x); with `sigma` given (normalize_variance), sigma = sqrt(E[x^2] - E[x]^2) + eps per row
    (Caffe's formula) and y is divided by it. `y` may be `x`."""
    need.check(scratch, need.row_sums(rows), "mvn_forward")
    x2 = x.reshape(rows, n)
    y2 = y.reshape(rows, n)
    mean = x2.mean(axis=1, keepdims=True)
    if sigma is not None:
        var = np.maximum((x2 * x2).mean(axis=1, keepdims=True) - mean * mean, 0)
        s = np.sqrt(var) + x.dtype.type(eps)
        sigma.reshape(rows)[...] = s[:, 0]
        np.subtract(x2, mean, out=y2)
        y2 /= s
    else:
        np.subtract(x2, mean, out=y2)


def mvn_backward(y: np.ndarray | None, dy: np.ndarray, dx: np.ndarray, sigma: np.ndarray | None, rows: int,
                 n: int, scratch: Any = None) -> None:
    """dx = dy - mean(dy); normalized: dx = (dy - mean(dy) - y * mean(dy * y)) / sigma (reads y, not x)."""
    need.check(scratch, need.row_sums(rows), "mvn_backward")
    dy2 = dy.reshape(rows, n)
    dx2 = dx.reshape(rows, n)
    if sigma is not None:
        assert y is not None, "the normalized backward reads y"
        y2 = y.reshape(rows, n)
        proj = (dy2 * y2).mean(axis=1, keepdims=True)
        res = (dy2 - dy2.mean(axis=1, keepdims=True) - y2 * proj) / sigma.reshape(rows, 1)
        np.copyto(dx2, res)
    else:
        np.copyto(dx2, dy2 - dy2.mean(axis=1, keepdims=True))
