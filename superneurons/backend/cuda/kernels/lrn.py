"""Local response normalization, one thread per element, over NCHW arrays (see backend/cpu/lrn.py).

The window is `size` channels (across) or size x size pixels (within), centred: offsets
-half .. size-1-half with half = (size-1)//2, zeros outside.
"""
from __future__ import annotations

import math

from numba import cuda


@cuda.jit(device=True)
def _bounds(i, c, h, w, size, across):
    """(channel, row, col ranges) of element i's window and its plane coordinates."""
    half = (size - 1) // 2
    s = i % w
    r = (i // w) % h
    ch = (i // (w * h)) % c
    n = i // (w * h * c)
    if across:
        return n, ch, r, s, max(ch - half, 0), min(ch - half + size, c), r, r + 1, s, s + 1
    return n, ch, r, s, ch, ch + 1, max(r - half, 0), min(r - half + size, h), max(s - half, 0), min(s - half + size, w)


@cuda.jit
def forward(x, y, scale, c, h, w, size, across, shift, coeff, beta):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        n, ch, r, s, c0, c1, r0, r1, s0, s1 = _bounds(i, c, h, w, size, across)
        acc = 0.0
        for cc in range(c0, c1):
            for rr in range(r0, r1):
                for ss in range(s0, s1):
                    v = x[((n * c + cc) * h + rr) * w + ss]
                    acc += v * v
        sc = shift + coeff * acc
        scale[i] = sc
        y[i] = x[i] * math.pow(sc, -beta)


@cuda.jit
def backward(x, y, scale, dy, dx, c, h, w, size, across, coeff, beta):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        n, ch, r, s, c0, c1, r0, r1, s0, s1 = _bounds(i, c, h, w, size, across)
        acc = 0.0
        for cc in range(c0, c1):
            for rr in range(r0, r1):
                for ss in range(s0, s1):
                    k = ((n * c + cc) * h + rr) * w + ss
                    acc += dy[k] * y[k] / scale[k]
        dx[i] = dy[i] * math.pow(scale[i], -beta) - 2.0 * beta * coeff * x[i] * acc
