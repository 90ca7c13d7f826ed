"""Finding cuDNN, cuBLAS and the CUDA runtime wherever the user has them.

Order: cuda-pathfinder (knows the nvidia-*-cu12 and -cu13 wheel layouts, CUDA_PATH and the
system), then the plain system loader. A missing library is a UserError naming it and the fix.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from superneurons.errors import UserError

_SONAMES = {
    "cudnn": ("libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"),
    "cublas": ("libcublas.so.13", "libcublas.so.12", "libcublas.so"),
}


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The loaded shared library `name` ('cudnn' or 'cublas')."""
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        loaded = load_nvidia_dynamic_lib(name)
        if loaded.abs_path:
            return ctypes.CDLL(loaded.abs_path, mode=ctypes.RTLD_GLOBAL)
    except Exception as e:  # pathfinder missing or the library not found through it
        errors.append(f"cuda-pathfinder: {e}")
    for soname in _SONAMES.get(name, ()) + tuple(filter(None, [ctypes.util.find_library(name)])):
        try:
            return ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(str(e))
    raise UserError(f"cannot load lib{name}: it is needed for the GPU backend; install it with `pip install "
                    "'superneurons[cu12]'` (a CUDA 12 driver) or 'superneurons[cu13]' (CUDA 13), or from NVIDIA "
                    f"({'; '.join(errors[:2])})")


def path_of(lib: ctypes.CDLL) -> str:
    return getattr(lib, "_name", "?")
