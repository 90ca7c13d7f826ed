"""cuBLAS through ctypes: a handle on the default stream and row-major sgemm / dgemm."""
from __future__ import annotations

import ctypes

import numpy as np

from superneurons.backend.cuda import libs

_c = ctypes
_OP_N, _OP_T = 0, 1


def _lib() -> ctypes.CDLL:
    lib = libs.load("cublas")
    if not getattr(lib, "_sn_typed", False):
        lib.cublasGetStatusString.restype = _c.c_char_p
        lib._sn_typed = True
    return lib


def check(status: int, fn: str) -> None:
    if status != 0:
        try:
            text = _lib().cublasGetStatusString(status).decode()
        except Exception:
            text = "?"
        raise RuntimeError(f"{fn} failed: cuBLAS status {status} ({text})")


def call(fn: str, *args) -> None:
    check(getattr(_lib(), fn)(*args), fn)


class Handle:
    def __init__(self, stream: int = 0):
        self.value = _c.c_void_p()
        call("cublasCreate_v2", _c.byref(self.value))
        call("cublasSetStream_v2", self.value, _c.c_void_p(stream))

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: float, a: int, lda: int,
             b: int, ldb: int, beta: float, c: int, dtype) -> None:
        """Row-major C (m x n) = alpha op(A) op(B) + beta C, computed as column-major C^T = op(B)^T op(A)^T."""
        if np.dtype(dtype) == np.float32:
            fn, scalar = "cublasSgemm_v2", _c.c_float
        elif np.dtype(dtype) == np.float64:
            fn, scalar = "cublasDgemm_v2", _c.c_double
        else:
            raise TypeError(f"gemm on {np.dtype(dtype)} arrays is not supported (float32 or float64)")
        al, be = scalar(alpha), scalar(beta)
        call(fn, self.value, _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, n, m, k,
             _c.byref(al), _c.c_void_p(b), ldb, _c.c_void_p(a), lda, _c.byref(be), _c.c_void_p(c), n)
