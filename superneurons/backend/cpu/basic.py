"""Elementwise and BLAS-like operations every layer and solver builds on."""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["fill", "copy", "axpy", "axpby", "scal", "gemm", "add_bias", "bias_backward", "reshape", "asum",
           "sumsq", "dot", "all_finite", "upload", "download"]


def fill(dst: np.ndarray, value: float) -> None:
    dst.fill(value)


def copy(src: np.ndarray, dst: np.ndarray) -> None:
    np.copyto(dst, src.reshape(dst.shape))


def axpy(alpha: float, x: np.ndarray, y: np.ndarray) -> None:
    """y += alpha * x"""
    if alpha == 1.0:
        y += x.reshape(y.shape)
    else:
        y += y.dtype.type(alpha) * x.reshape(y.shape)


def axpby(alpha: float, x: np.ndarray, beta: float, y: np.ndarray) -> None:
    """y = alpha * x + beta * y"""
    y *= y.dtype.type(beta)
    axpy(alpha, x, y)


def scal(alpha: float, x: np.ndarray) -> None:
    x *= x.dtype.type(alpha)


def gemm(trans_a: bool, trans_b: bool, alpha: float, a: np.ndarray, b: np.ndarray, beta: float, c: np.ndarray) -> None:
    """c = alpha * op(a) @ op(b) + beta * c, on 2-D arrays (cuBLAS's sgemm, row-major)."""
    a2 = a.T if trans_a else a
    b2 = b.T if trans_b else b
    if beta == 0.0:
        np.matmul(a2, b2, out=c)
        if alpha != 1.0:
            c *= c.dtype.type(alpha)
    else:
        prod = a2 @ b2
        if alpha != 1.0:
            prod *= c.dtype.type(alpha)
        if beta != 1.0:
            c *= c.dtype.type(beta)
        c += prod


def add_bias(y: np.ndarray, b: np.ndarray, outer: int, dim: int, inner: int) -> None:
    """y viewed as (outer, dim, inner) += b[dim] broadcast."""
    y.reshape(outer, dim, inner)[...] += b.reshape(1, dim, 1)


def bias_backward(dy: np.ndarray, db: np.ndarray, outer: int, dim: int, inner: int, scratch: Any = None) -> None:
    """db[dim] += sum of dy viewed as (outer, dim, inner) over outer and inner."""
    need.check(scratch, need.row_sums(dim), "bias_backward")
    db += dy.reshape(outer, dim, inner).sum(axis=(0, 2), dtype=db.dtype).reshape(db.shape)


def reshape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A view of `x` with a new shape (same number of elements)."""
    return x.reshape(shape)


def asum(x: np.ndarray, scratch: Any = None) -> float:
    need.check(scratch, need.total(), "asum")
    return float(np.abs(x, dtype=np.float64).sum())


def sumsq(x: np.ndarray, scratch: Any = None) -> float:
    need.check(scratch, need.total(), "sumsq")
    return float(np.dot(x.ravel().astype(np.float64), x.ravel().astype(np.float64)))


def all_finite(arrays: list, scratch: Any = None) -> bool:
    """Whether every value of every array is finite (the loss scaler's overflow check, one call per iteration)."""
    need.check(scratch, need.total(), "all_finite")
    return all(bool(np.isfinite(a).all()) for a in arrays)


def dot(x: np.ndarray, y: np.ndarray, scratch: Any = None) -> float:
    need.check(scratch, need.total(), "dot")
    return float(np.dot(x.ravel().astype(np.float64), y.ravel().astype(np.float64)))


def upload(dst: np.ndarray, host: np.ndarray) -> None:
    """Copy a host array into a device array (here both live in host memory), casting to dst's dtype."""
    np.copyto(dst, np.asarray(host).reshape(dst.shape), casting="unsafe")


def download(src: np.ndarray) -> np.ndarray:
    """A host copy of a device array, safe to keep after the device memory is reused."""
    return np.array(src, copy=True)
