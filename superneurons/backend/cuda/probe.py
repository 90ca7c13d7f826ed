"""Is there a usable NVIDIA GPU? Cheap to ask; never raises (the Makefile uses it to pick --gpu)."""
from __future__ import annotations


def device_count() -> int:
    try:
        from cuda.bindings import driver
    except ImportError:
        return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, n = driver.cuDeviceGetCount()
        return int(n) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def gpu_available() -> bool:
    """A GPU is present and the CUDA backend can load its libraries."""
    if device_count() == 0:
        return False
    try:
        from superneurons.backend.cuda import libs

        libs.load("cudnn")
        libs.load("cublas")
        import numba.cuda  # noqa: F401  (importing it is the check)
    except Exception:
        return False
    return True
