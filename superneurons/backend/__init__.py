"""Backends: where arrays live and how operations on them run.

`get_backend("cpu")` is the NumPy reference backend; `get_backend("cuda", device=N)` the GPU one.
Both expose the same `Backend` interface and an `ops` namespace with the same functions, so
layers, memory managers and solvers never know which one they run on.
"""
from __future__ import annotations

from superneurons.backend.base import Backend


def get_backend(name: str = "cpu", device: int = 0) -> Backend:
    if name == "cpu":
        from superneurons.backend.cpu import CpuBackend

        return CpuBackend()
    if name in ("cuda", "gpu"):
        from superneurons.backend.cuda import CudaBackend  # noqa: F401  (raises a clear error without a GPU)

        return CudaBackend(device)
    raise ValueError(f"unknown backend {name!r}")
