"""MVN over the rows of a (rows, n) view, from the float64 row sums of kernels/rows.py (sums[r], sums[rows + r])."""
from __future__ import annotations

import math

from numba import cuda


@cuda.jit
def sigma(sums, out, n, eps):
    """out[r] = sqrt(E[x^2] - E[x]^2) + eps, from MOMENTS sums (Caffe's formula, variance clamped at 0)."""
    rows = out.size
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        mean = sums[r] / n
        out[r] = math.sqrt(max(sums[rows + r] / n - mean * mean, 0.0)) + eps


@cuda.jit
def forward(x, y, sums, sig, n, normalize):
    """y = (x - mean) (/ sigma); y may be x."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        r = i // n
        v = x[i] - sums[r] / n
        y[i] = v / sig[r] if normalize else v


@cuda.jit
def backward(y, dy, dx, sums, sig, n, normalize):
    """dx = dy - mean(dy), or (dy - mean(dy) - y mean(dy y)) / sigma from DOT sums of (y, dy); dx may be dy."""
    rows = sums.size // 2
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        r = i // n
        g = dy[i] - sums[r] / n
        if normalize:
            g = (g - y[i] * (sums[rows + r] / n)) / sig[r]
        dx[i] = g
