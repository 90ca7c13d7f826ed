"""The NumPy reference backend: correct and readable; the backend CI tests on.

Operations live in one module per layer family; each module lists its public functions in
`__all__` and they are gathered into one `ops` namespace here.
"""
from __future__ import annotations

import sys

import numpy as np

from superneurons.backend.base import collect_ops

_ALIGN = 256  # bytes; every pool block starts on a 1 KiB boundary, so views are aligned too


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.ops = collect_ops(sys.modules[__name__])

    def arena(self, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        return raw[start:start + nbytes]

    def view(self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = 1
        for d in shape:
            n *= int(d)
        return arena[offset:offset + n * dtype.itemsize].view(dtype).reshape(shape)

    def from_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)

    def to_host(self, src: np.ndarray) -> np.ndarray:
        return np.array(src, copy=True)

    def synchronize(self) -> None:
        pass
