"""Dropout's counter-based mask, bit-identical to backend/cpu/dropout.py (see its docstring for the formula).

All hash arithmetic is on uint64 values masked to 32 bits, so it wraps mod 2**32 exactly as the NumPy
uint32 code does, whatever integer width numba picks.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x85EBCA6B)
_C2 = np.uint64(0xC2B2AE35)
_S8 = np.uint64(8)
_S13 = np.uint64(13)
_S16 = np.uint64(16)
_GOLDEN = np.uint64(0x9E3779B9)


@cuda.jit(device=True)
def fmix32(h):
    h ^= h >> _S16
    h = (h * _C1) & _M32
    h ^= h >> _S13
    h = (h * _C2) & _M32
    h ^= h >> _S16
    return h


@cuda.jit
def dropout_apply(src, dst, pass_key, layer_index, threshold, scale):
    """dst = src * scale where the element's 24-bit hash is >= threshold, else 0. `pass_key`: a one-word device
    array holding the pass's key (backend/cpu/dropout.py pass_key), so a graph replays the kernel for another pass
    once the word is rewritten; the layer's two keys are derived here, as layer_keys does on the host."""
    k1 = fmix32(((np.uint64(pass_key[0]) ^ layer_index) + _GOLDEN) & _M32)
    k2 = fmix32((k1 + _GOLDEN) & _M32)
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        h = fmix32(np.uint64(i) ^ k1)
        h = fmix32((h + k2) & _M32)
        dst[i] = src[i] * scale if (h >> _S8) >= threshold else 0.0
