"""Host memory carved as the pool carves device memory: the CPU backend's pool arena and the host arena of
its transfers (`transfer.py`) are the same kind of array, so both share these two functions."""
from __future__ import annotations

import numpy as np

from superneurons.dtypes import tensor_bytes

_ALIGN = 256  # bytes; every pool block starts on a 1 KiB boundary, so views are aligned too


def host_arena(nbytes: int) -> np.ndarray:
    """`nbytes` of host memory starting on an _ALIGN boundary."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes]


def host_view(arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """The array of `shape` and `dtype` at byte `offset` of `arena`."""
    dtype = np.dtype(dtype)
    return arena[offset:offset + tensor_bytes(shape, dtype)].view(dtype).reshape(shape)
