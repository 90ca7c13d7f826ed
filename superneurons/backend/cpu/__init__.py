"""The NumPy reference backend: correct and readable; the backend CI tests on.

Operations live in one module per layer family; each module lists its public functions in
`__all__` and they are gathered into one `ops` namespace here.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace

import numpy as np

_ALIGN = 256  # bytes; every pool block starts on a 1 KiB boundary, so views are aligned too


def _collect_ops() -> SimpleNamespace:
    ns = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for fn_name in getattr(module, "__all__", ()):
            if fn_name in ns:
                raise RuntimeError(f"cpu op {fn_name} defined twice ({info.name})")
            ns[fn_name] = getattr(module, fn_name)
    return SimpleNamespace(**ns)


class CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.ops = _collect_ops()

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
