"""Embedding lookup and its scatter-add gradient; indices are float values that must be integers in range."""
from __future__ import annotations

from numba import cuda


@cuda.jit(device=True)
def row_of(v, input_dim):
    """The table row of index value v, or -1 when v is not an integer in [0, input_dim) (NaN included)."""
    if not (v >= 0 and v < input_dim):
        return -1
    k = int(v)
    return k if k == v else -1


@cuda.jit
def embed_forward(idx, w, b, y, input_dim, num_output, has_bias, bad):
    """y[p, j] = w[idx[p], j] (+ b[j]); a bad index writes zeros and counts once in bad[0]."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        p = i // num_output
        j = i - p * num_output
        k = row_of(idx[p], input_dim)
        if k < 0:
            y[i] = 0.0
            if j == 0:
                cuda.atomic.add(bad, 0, 1.0)
        elif has_bias:
            y[i] = w[k * num_output + j] + b[j]
        else:
            y[i] = w[k * num_output + j]


@cuda.jit
def embed_backward(idx, dy, dw, input_dim, num_output):
    """dw[idx[p], j] += dy[p, j]; atomics, since repeated indices add into the same row (bad ones skipped)."""
    for i in range(cuda.grid(1), dy.size, cuda.gridsize(1)):
        p = i // num_output
        k = row_of(idx[p], input_dim)
        if k >= 0:
            cuda.atomic.add(dw, k * num_output + i - p * num_output, dy[i])
