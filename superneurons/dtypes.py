"""Element types of tensors, and the one function that turns a shape and a type into bytes.

Every byte count of a tensor (the planner's, the Net's, the pool's, the managers', the backends' views,
the data workers' slots) is `tensor_bytes(shape, dtype)`: storage in half precision halves them all at
once. The module sits below every package (beside `errors`), so the backends read it too.

Storage types: float32 (Caffe's), float16 (NumPy's IEEE half) and bfloat16 (`ml_dtypes`, the same
8-bit exponent as float32 with 8 bits of mantissa). float64 is what the reference tests compute in.
"""
from __future__ import annotations

from typing import Iterable

import ml_dtypes
import numpy as np

FLOAT64 = np.dtype(np.float64)
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# `--precision` and the Python API's `precision=`: the short names users type, and the storage type each means.
PRECISIONS: dict[str, np.dtype] = {"fp32": FLOAT32, "fp16": FLOAT16, "bf16": BFLOAT16}
# What `superneurons memory --json` and the logs call a storage type.
DTYPE_NAMES: dict[np.dtype, str] = {FLOAT64: "float64", FLOAT32: "float32", FLOAT16: "float16",
                                    BFLOAT16: "bfloat16"}
HALF_TYPES = (FLOAT16, BFLOAT16)


def element_count(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of `shape` (1 for a scalar), in Python integers (no overflow)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def tensor_bytes(shape: Iterable[int], dtype=FLOAT32) -> int:
    """Bytes of a tensor of `shape` stored as `dtype`: elements x element size. The only place a byte count
    is derived from a shape."""
    return element_count(shape) * np.dtype(dtype).itemsize


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return DTYPE_NAMES.get(dtype, dtype.name)


def is_half(dtype) -> bool:
    return np.dtype(dtype) in HALF_TYPES
