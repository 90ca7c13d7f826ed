"""The counter-based random fill of backend/cpu/random_fill.py (see its docstring for the formulas): the same
32-bit words (uint64 values masked to 32 bits, as kernels/dropout.py does) and the same float64 formulas."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from superneurons.backend.cuda.kernels.dropout import fmix32

_M32 = np.uint64(0xFFFFFFFF)
_S8 = np.uint64(8)
_FULL = np.uint64(1 << 24)
TWO_POW_M32 = 2.0 ** -32
TWO_PI = 2.0 * math.pi


@cuda.jit
def random_fill(dst, k0, ka, kb, kc, gaussian, a, b, keep_threshold):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        base = fmix32(np.uint64(i) ^ k0)
        wa = float64(fmix32((base + ka) & _M32))
        if gaussian:
            wb = float64(fmix32((base + kb) & _M32))
            z = math.sqrt(-2.0 * math.log((wa + 1.0) * TWO_POW_M32)) * math.cos(TWO_PI * (wb * TWO_POW_M32))
            v = a + b * z
            if keep_threshold < _FULL and (fmix32((base + kc) & _M32) >> _S8) >= keep_threshold:
                v = 0.0
        else:
            v = a + (b - a) * (wa * TWO_POW_M32)
        dst[i] = v
