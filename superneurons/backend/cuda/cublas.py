"""cuBLAS through ctypes: a handle on the default stream and row-major GEMMs: sgemm / dgemm, and GemmEx for
float16 and bfloat16 operands (output in their type or in float32), which accumulates in float32 on tensor
cores (CUBLAS_COMPUTE_32F), as AMP's half GEMMs do."""
from __future__ import annotations

import ctypes

import numpy as np

from superneurons.backend.cuda import libs
from superneurons.dtypes import BFLOAT16, FLOAT16, FLOAT32

_c = ctypes
_OP_N, _OP_T = 0, 1
_CUDA_TYPES = {FLOAT32: 0, FLOAT16: 2, BFLOAT16: 14}  # cudaDataType_t: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1  # cublasGemmAlgo_t: cuBLAS's heuristics (tensor cores for half operands)


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
        self.set_stream(stream)

    def set_stream(self, stream: int) -> None:
        """Queue this handle's work on `stream` from now on (0: the legacy default stream; graphs.py)."""
        call("cublasSetStream_v2", self.value, _c.c_void_p(stream))

    def gemm(self, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: float, a: int, lda: int,
             b: int, ldb: int, beta: float, c: int, dtype, operand_dtype=None) -> None:
        """Row-major C (m x n) = alpha op(A) op(B) + beta C, computed as column-major C^T = op(B)^T op(A)^T.
        `dtype` is C's type, `operand_dtype` A's and B's (default: C's); half operands go through GemmEx."""
        operand = np.dtype(dtype if operand_dtype is None else operand_dtype)
        if operand in (FLOAT16, BFLOAT16):
            if np.dtype(dtype) not in (operand, FLOAT32):
                raise TypeError(f"gemm of {operand} operands into {np.dtype(dtype)} is not supported")
            al, be = _c.c_float(alpha), _c.c_float(beta)
            call("cublasGemmEx", self.value, _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, n, m, k,
                 _c.byref(al), _c.c_void_p(b), _CUDA_TYPES[operand], ldb, _c.c_void_p(a), _CUDA_TYPES[operand], lda,
                 _c.byref(be), _c.c_void_p(c), _CUDA_TYPES[np.dtype(dtype)], n, _COMPUTE_32F, _GEMM_DEFAULT)
            return
        if operand != np.dtype(dtype):
            raise TypeError(f"gemm of {operand} operands into {np.dtype(dtype)} is not supported")
        if np.dtype(dtype) == np.float32:
            fn, scalar = "cublasSgemm_v2", _c.c_float
        elif np.dtype(dtype) == np.float64:
            fn, scalar = "cublasDgemm_v2", _c.c_double
        else:
            raise TypeError(f"gemm on {np.dtype(dtype)} arrays is not supported (float32 or float64)")
        al, be = scalar(alpha), scalar(beta)
        call(fn, self.value, _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, n, m, k,
             _c.byref(al), _c.c_void_p(b), ldb, _c.c_void_p(a), lda, _c.byref(be), _c.c_void_p(c), n)
