"""Backends: where arrays live and how operations on them run.

`get_backend("cpu")` is the NumPy reference backend; `get_backend("cuda", device=N)` the GPU one.
Both expose the same `Backend` interface and an `ops` namespace with the same functions, so
layers, memory managers and solvers never know which one they run on.
"""
from __future__ import annotations

from superneurons.backend.base import Backend


def device_report(gpu: str = "all") -> list[str]:
    """Caffe's device_query lines for GPU `gpu` (an id, or 'all'): the GPUs, the driver, cuDNN and cuBLAS.
    A UserError when the machine has no usable GPU."""
    from superneurons.backend.cuda.device_report import device_report as report  # only a GPU machine loads it

    return report(gpu)


def get_backend(name: str = "cpu", device: int = 0) -> Backend:
    if name == "cpu":
        from superneurons.backend.cpu import CpuBackend

        return CpuBackend()
    if name in ("cuda", "gpu"):
        from superneurons.backend.cuda import CudaBackend  # noqa: F401  (raises a clear error without a GPU)

        return CudaBackend(device)
    raise ValueError(f"unknown backend {name!r}")


def device_count() -> int:
    """How many GPUs this machine offers the GPU backend (0 without a usable driver); never raises."""
    from superneurons.backend.cuda.probe import device_count as count

    return count()
