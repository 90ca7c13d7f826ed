"""Reduction (SUM, ASUM, SUMSQ, MEAN over the trailing axes) and ArgMax (top-k along one axis)."""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["reduction_forward", "reduction_backward", "argmax_forward"]

REDUCTIONS = ("SUM", "ASUM", "SUMSQ", "MEAN")


def reduction_forward(x: np.ndarray, y: np.ndarray, op: str, coeff: float, outer: int, inner: int,
                      scratch: Any = None) -> None:
    """y[outer] = coeff * reduce(x viewed as (outer, inner)) over inner."""
    need.check(scratch, need.row_sums(outer), "reduction_forward")
    x2 = x.reshape(outer, inner)
    out = y.reshape(outer)
    if op == "SUM":
        np.sum(x2, axis=1, out=out)
    elif op == "ASUM":
        np.sum(np.abs(x2), axis=1, out=out)
    elif op == "SUMSQ":
        np.sum(x2 * x2, axis=1, out=out)
    elif op == "MEAN":
        np.sum(x2, axis=1, out=out)
        out *= out.dtype.type(1.0 / inner)
    else:
        raise ValueError(f"unknown reduction {op!r}; one of {', '.join(REDUCTIONS)}")
    if coeff != 1.0:
        out *= out.dtype.type(coeff)


def reduction_backward(x: np.ndarray | None, dy: np.ndarray, dx: np.ndarray, op: str, coeff: float, outer: int,
                       inner: int) -> None:
    """dx = coeff * dy[outer] * d(reduce)/dx; x is read only by ASUM (sign) and SUMSQ (2x)."""
    g = dy.reshape(outer, 1)
    d2 = dx.reshape(outer, inner)
    if op == "SUM":
        scale = coeff
        d2[...] = g
    elif op == "MEAN":
        scale = coeff / inner
        d2[...] = g
    elif op == "ASUM":
        assert x is not None, "ASUM's backward reads x"
        scale = coeff
        np.multiply(np.sign(x.reshape(outer, inner)), g, out=d2)
    elif op == "SUMSQ":
        assert x is not None, "SUMSQ's backward reads x"
        scale = 2.0 * coeff
        np.multiply(x.reshape(outer, inner), g, out=d2)
    else:
        raise ValueError(f"unknown reduction {op!r}; one of {', '.join(REDUCTIONS)}")
    if scale != 1.0:
        d2 *= d2.dtype.type(scale)


def argmax_forward(x: np.ndarray, y: np.ndarray, top_k: int, out_max_val: bool, by_axis: bool) -> None:
    """Caffe's ArgMax on x viewed as (outer, dim, inner): the top_k largest along dim, ties to the larger index.

    by_axis: y viewed as (outer, top_k, inner) holds the values (out_max_val) or the indices.
    Otherwise (inner == 1): y viewed as (outer, 1 or 2, top_k) holds the indices, then the values.
    """
    outer, dim, inner = x.shape
    # Sort by value, descending, ties by index, descending (std::partial_sort on (value, index) pairs).
    idx = np.broadcast_to(np.arange(dim).reshape(1, dim, 1), x.shape)
    order = np.lexsort((-idx, -x), axis=1) if x.size else np.zeros(x.shape, np.int64)
    top_idx = order[:, :top_k, :]
    top_val = np.take_along_axis(x, top_idx, axis=1)
    if by_axis:
        y.reshape(outer, top_k, inner)[...] = top_val if out_max_val else top_idx
    else:
        y2 = y.reshape(outer, 2 if out_max_val else 1, top_k)
        y2[:, 0, :] = top_idx[:, :, 0]
        if out_max_val:
            y2[:, 1, :] = top_val[:, :, 0]
