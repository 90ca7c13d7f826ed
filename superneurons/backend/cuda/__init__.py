"""The CUDA backend: cuDNN and cuBLAS through ctypes, numba-cuda kernels, cuda-python for memory.

Not complete yet: importing CudaBackend raises a clear error until every CPU op has a GPU twin.
"""
from __future__ import annotations

from superneurons.errors import UserError


class CudaBackend:  # pragma: no cover - replaced by the GPU backend implementation
    name = "cuda"

    def __init__(self, device: int = 0):
        raise UserError("the GPU backend is not available in this build yet; run on the CPU (drop --gpu, "
                        "or set solver_mode: CPU)")
