"""Elementwise kernels over flat arrays: fills, scaled copies, BLAS-1, activations, eltwise, per-channel ops."""
from __future__ import annotations

import math

from numba import cuda


@cuda.jit
def fill(y, value):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = value


@cuda.jit
def scale_copy(alpha, x, y):
    """y = alpha * x (also a dtype cast when alpha is 1)."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = alpha * x[i]


@cuda.jit
def axpby(alpha, x, beta, y):
    """y = alpha * x + beta * y."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = beta * y[i] + alpha * x[i]


@cuda.jit
def weighted_sum2(alpha, a, beta, b, y):
    """y = alpha * a + beta * b (y may be a or b): a two-input Eltwise SUM or Split backward in one pass."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = alpha * a[i] + beta * b[i]


@cuda.jit
def axpy(alpha, x, y):
    """y += alpha * x."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] += alpha * x[i]


@cuda.jit
def multiply(a, b, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] * b[i]


@cuda.jit
def divide(a, b, out):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] / b[i]


@cuda.jit
def mul_div(a, b, c, out):
    """out = a * (b / c)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i] * (b[i] / c[i])


@cuda.jit
def max_into(b, index, top, argmax):
    """Where b > top (strictly: ties keep the earlier bottom): top = b, argmax = index."""
    for i in range(cuda.grid(1), top.size, cuda.gridsize(1)):
        if b[i] > top[i]:
            top[i] = b[i]
            argmax[i] = index


@cuda.jit
def select_eq(dy, argmax, index, dx):
    """dx = dy where argmax == index, else 0."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        dx[i] = dy[i] if argmax[i] == index else 0.0


@cuda.jit
def relu_forward(x, y, slope):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        y[i] = v if v > 0 else v * slope


@cuda.jit
def relu_backward(y, dy, dx, slope):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        dx[i] = dy[i] if y[i] > 0 else dy[i] * slope


@cuda.jit
def sigmoid_forward(x, y):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = 0.5 * math.tanh(0.5 * x[i]) + 0.5


@cuda.jit
def sigmoid_backward(y, dy, dx):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        v = y[i]
        dx[i] = dy[i] * (v * (1 - v))


@cuda.jit
def tanh_forward(x, y):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = math.tanh(x[i])


@cuda.jit
def tanh_backward(y, dy, dx):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        v = y[i]
        dx[i] = dy[i] * (1 - v * v)


@cuda.jit
def channel_add(y, b, dim, inner):
    """y viewed as (outer, dim, inner) += b[dim]."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] += b[(i // inner) % dim]


@cuda.jit
def channel_mul(x, s, y, dim, inner):
    """y = x * s[dim] over an (outer, dim, inner) view."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = x[i] * s[(i // inner) % dim]


@cuda.jit
def slab_copy(src, dst, outer, src_width, src_offset, dst_width, dst_offset, width, inner):
    """Copy `width` planes along the middle axis of (outer, *, inner) views: concat and its backward."""
    block = width * inner
    for i in range(cuda.grid(1), outer * block, cuda.gridsize(1)):
        o = i // block
        r = i - o * block
        dst[(o * dst_width + dst_offset) * inner + r] = src[(o * src_width + src_offset) * inner + r]
