"""Local response normalization over NCHW arrays (see backend/cpu/lrn.py).

The window is `size` channels (across) or size x size pixels (within), centred: offsets
-half .. size-1-half with half = (size-1)//2, zeros outside.

Across channels (AlexNet's, GoogLeNet's LRN) one thread takes one pixel of one image and slides the window
down the channels with a running float64 sum: one add and one subtract per channel, where the general
kernels below (one thread per element) recompute each window and spend four 64-bit divisions per element
finding it. On an H200 those took 12.4 ms of AlexNet's 37 ms batch-256 iteration. A warp's threads take
neighbouring pixels, so every channel step reads one contiguous row.
"""
from __future__ import annotations

import math

from numba import cuda, float64


@cuda.jit
def across_forward(x, y, scale, images, c, hw, size, shift, coeff, beta):
    """scale = shift + coeff * (window sum of x^2 across channels); y = x * scale^-beta."""
    half = (size - 1) // 2
    ahead = size - 1 - half  # channels of the window past the centre
    for p in range(cuda.grid(1), images * hw, cuda.gridsize(1)):
        n = p // hw
        base = n * c * hw + (p - n * hw)  # element (n, 0, pixel)
        acc = float64(0.0)
        for cc in range(min(ahead, c)):
            v = float64(x[base + cc * hw])
            acc += v * v
        k = base
        for ch in range(c):
            if ch + ahead < c:
                v = float64(x[k + ahead * hw])
                acc += v * v
            if ch - half - 1 >= 0:
                v = float64(x[k - (half + 1) * hw])
                acc -= v * v
            sc = shift + coeff * acc
            scale[k] = sc
            y[k] = x[k] * math.pow(scale[k], -beta)
            k += hw


@cuda.jit
def across_backward(x, y, scale, dy, dx, images, c, hw, size, coeff, beta):
    """dx = dy * scale^-beta - 2 beta coeff x * (window sum of dy y / scale across channels)."""
    half = (size - 1) // 2
    ahead = size - 1 - half
    for p in range(cuda.grid(1), images * hw, cuda.gridsize(1)):
        n = p // hw
        base = n * c * hw + (p - n * hw)
        acc = float64(0.0)
        for cc in range(min(ahead, c)):
            j = base + cc * hw
            acc += float64(dy[j] * y[j] / scale[j])
        k = base
        for ch in range(c):
            if ch + ahead < c:
                j = k + ahead * hw
                acc += float64(dy[j] * y[j] / scale[j])
            if ch - half - 1 >= 0:
                j = k - (half + 1) * hw
                acc -= float64(dy[j] * y[j] / scale[j])
            dx[k] = dy[k] * math.pow(scale[k], -beta) - 2.0 * beta * coeff * x[k] * acc
            k += hw


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
