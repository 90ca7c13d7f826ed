"""Elementwise and BLAS-like operations (cuBLAS for gemm, numba kernels for the rest)."""
from __future__ import annotations

import numpy as np

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import bits, channels_last, current, flat, reshape, scalar
from superneurons.backend.cuda.pointers import pointer
from superneurons.backend.cuda.kernels import elementwise as ek, reduce as rk
from superneurons.backend.cuda.half_math import Unsupported
from superneurons.backend.cuda.ops._rows import take
from superneurons.backend.cuda.ops import scale
from superneurons.backend.scratch import total
from superneurons.dtypes import FLOAT32, HALF_TYPES

__all__ = ["fill", "copy", "axpy", "axpby", "scal", "gemm", "add_bias", "bias_backward", "reshape", "asum",
           "sumsq", "dot", "all_finite", "upload", "download"]


def fill(dst, value: float) -> None:
    if dst.size:
        K.launch(ek.fill, dst.size)(flat(dst), scalar(dst, value))


def copy(src, dst) -> None:
    if src.size != dst.size:
        raise ValueError(f"copy of {src.shape} into {dst.shape}: sizes differ")
    if not dst.size:
        return
    if src.dtype == dst.dtype:
        src_ptr, dst_ptr = pointer(src), pointer(dst)
        if src_ptr == dst_ptr:
            return  # the same memory (an in-place layer's diff)
        if not K.memcpy_device(dst_ptr, src_ptr, dst.nbytes):
            flat(dst).copy_to_device(flat(src))
    else:
        K.launch(ek.scale_copy, dst.size)(scalar(dst, 1.0), flat(src), flat(dst))


def axpy(alpha: float, x, y) -> None:
    """y += alpha * x"""
    if y.size:
        K.launch(ek.axpy, y.size)(scalar(y, alpha), flat(x), flat(y))


def axpby(alpha: float, x, beta: float, y) -> None:
    """y = alpha * x + beta * y"""
    if y.size:
        K.launch(ek.axpby, y.size)(scalar(y, alpha), flat(x), scalar(y, beta), flat(y))


def scal(alpha: float, x) -> None:
    if x.size:
        K.launch(ek.scale_copy, x.size)(scalar(x, alpha), flat(x), flat(x))


def gemm(trans_a: bool, trans_b: bool, alpha: float, a, b, beta: float, c) -> None:
    """c = alpha * op(a) @ op(b) + beta * c on 2-D row-major arrays (cuBLAS)."""
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if (a.shape[1] if trans_a else a.shape[0]) != m or (b.shape[0] if trans_b else b.shape[1]) != n or \
            (b.shape[1] if trans_b else b.shape[0]) != k:
        raise ValueError(f"gemm shapes do not match: a {a.shape} (T={trans_a}), b {b.shape} (T={trans_b}), "
                         f"c {c.shape}")
    if a.dtype != b.dtype or c.dtype not in (a.dtype, FLOAT32):
        raise Unsupported(f"gemm of {a.dtype} and {b.dtype} into {c.dtype}")  # cuBLAS: one operand type
    current().cublas.gemm(trans_a, trans_b, m, n, k, alpha, pointer(a), a.shape[1], pointer(b), b.shape[1], beta,
                          pointer(c), c.dtype, a.dtype)


def add_bias(y, b, outer: int, dim: int, inner: int) -> None:
    """y viewed as (outer, dim, inner) += b[dim] broadcast."""
    if y.size:
        K.launch(ek.channel_add, y.size)(flat(y), flat(b), dim, inner)


def bias_backward(dy, db, outer: int, dim: int, inner: int, scratch=None) -> None:
    """db[dim] += sum of dy viewed as (outer, dim, inner) over outer and inner."""
    if scale.spread():
        scale.channel_sum(dy, db, outer, dim, inner, True, scratch)
        return
    K.launch(rk.channel_sum, 0, blocks=dim)(flat(dy), flat(db), outer, dim, inner, True)


def _total(scratch):
    """The one float64 entry a whole-array sum adds into (backend/scratch.py: total()), zeroed."""
    out = take(scratch, total())
    K.launch(ek.fill, 1)(out, np.float64(0.0))
    return out


def _sum(x, y, mode: int, scratch) -> float:
    out = _total(scratch)
    if x.size:
        K.launch(rk.array_sum, x.size)(flat(x), flat(y), out, mode)
    return float(out.copy_to_host()[0])


def asum(x, scratch=None) -> float:
    return _sum(x, x, 0, scratch)


def sumsq(x, scratch=None) -> float:
    return _sum(x, x, 1, scratch)


def dot(x, y, scratch=None) -> float:
    return _sum(x, y, 2, scratch)


def all_finite(arrays, scratch=None) -> bool:
    """Whether every value of every array is finite: their squares summed into one float64 on the device (Inf or
    NaN anywhere makes it so; float32's largest value squared is still finite there), read back once."""
    out = _total(scratch)
    for x in arrays:
        if x.size:
            K.launch(rk.array_sum, x.size)(flat(x), flat(x), out, 1)
    return bool(np.isfinite(out.copy_to_host()[0]))


def upload(dst, host: np.ndarray) -> None:
    """Copy a host array into a device array, casting to dst's dtype. The host array is N,C,H,W whatever dst's
    layout: a channels-last dst gets it transposed (graph/layout.py: users see NCHW)."""
    host = np.asarray(host)
    if channels_last(dst) and host.size == dst.size:
        host = host.reshape(dst.shape).transpose(0, 2, 3, 1)
    src = np.ascontiguousarray(host.reshape(-1), dtype=dst.dtype)
    if src.size != dst.size:
        raise ValueError(f"upload of {np.shape(host)} into {dst.shape}: sizes differ")
    if src.size:
        target = bits(flat(dst)) if dst.dtype in HALF_TYPES else flat(dst)
        target.copy_to_device(src.view(target.dtype))


def download(src) -> np.ndarray:
    """A host copy of a device array, N,C,H,W whatever its layout (a channels-last array is transposed)."""
    if not src.size:
        return np.empty(src.shape, src.dtype)
    if src.dtype in HALF_TYPES:
        values = bits(flat(src)).copy_to_host().view(src.dtype)
    else:
        values = flat(src).copy_to_host()
    if channels_last(src):
        n, c, h, w = src.shape
        return np.ascontiguousarray(values.reshape(n, h, w, c).transpose(0, 3, 1, 2))
    return values.reshape(src.shape)
