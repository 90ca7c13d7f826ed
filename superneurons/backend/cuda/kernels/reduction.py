"""Reduction's backward: the top diff of each row spread over the row, times the reduction's derivative."""
from __future__ import annotations

from numba import cuda

CONSTANT, SIGN, LINEAR = range(3)  # d(reduce)/dx: 1 (SUM, MEAN), sign(x) (ASUM), x (SUMSQ; the 2 is in scale)


@cuda.jit
def reduction_backward(x, dy, dx, inner, kind, scale):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        g = dy[i // inner] * scale
        if kind == SIGN:
            v = x[i]
            dx[i] = g if v > 0 else (-g if v < 0 else 0.0 * g)
        elif kind == LINEAR:
            dx[i] = g * x[i]
        else:
            dx[i] = g
