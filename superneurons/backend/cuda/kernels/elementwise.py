"""Elementwise kernels over flat arrays: fills, scaled copies, BLAS-1, ReLU, eltwise, per-channel ops.

The kernels on ResNet-sized activations (ReLU, two-input sums) take four elements per thread per trip
(`four_indices`, launched through kernels.launch_unrolled): with one load in flight per thread a streaming
kernel reaches only part of the memory bandwidth. Indices past the end read element i (always valid) and
their results are dropped, so the four loads need no branches and are issued together.
"""
from __future__ import annotations

from numba import cuda, float32


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


@cuda.jit(device=True, inline=True)
def four_indices(i, n, stride):
    """i and the indices stride, 2 stride, 3 stride on (those >= n replaced by i), and how many are < n."""
    i1 = i + stride
    i2 = i1 + stride
    i3 = i2 + stride
    valid = 1 + (i1 < n) + (i2 < n) + (i3 < n)
    return i1 if i1 < n else i, i2 if i2 < n else i, i3 if i3 < n else i, valid


@cuda.jit(device=True, inline=True)
def leaky_sum2(alpha, a, beta, b, y, slope):
    """y = leaky(alpha * a + beta * b, slope), four elements per thread per trip; the body of the two kernels
    below. Slope 1 makes leaky the identity (v * 1.0 == v exactly), which the compiler folds away."""
    n = y.size
    stride = cuda.gridsize(1)
    for i in range(cuda.grid(1), n, 4 * stride):
        i1, i2, i3, valid = four_indices(i, n, stride)
        a0, a1, a2, a3 = a[i], a[i1], a[i2], a[i3]
        b0, b1, b2, b3 = b[i], b[i1], b[i2], b[i3]
        y[i] = leaky(alpha * a0 + beta * b0, slope)
        if valid > 1:
            y[i1] = leaky(alpha * a1 + beta * b1, slope)
        if valid > 2:
            y[i2] = leaky(alpha * a2 + beta * b2, slope)
        if valid > 3:
            y[i3] = leaky(alpha * a3 + beta * b3, slope)


@cuda.jit
def weighted_sum2(alpha, a, beta, b, y):
    """y = alpha * a + beta * b (y may be a or b): a two-input Eltwise SUM or Split backward in one pass.
    Four elements per thread per trip (launch_unrolled)."""
    leaky_sum2(alpha, a, beta, b, y, 1.0)


@cuda.jit
def weighted_sum2_relu(alpha, a, beta, b, y, slope):
    """y = relu(alpha * a + beta * b) with a leaky slope (y may be a or b): an Eltwise SUM and the ReLU in
    place on its top (graph/fuse.py) in one pass. Four elements per thread per trip (launch_unrolled)."""
    leaky_sum2(alpha, a, beta, b, y, slope)


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


@cuda.jit(device=True, inline=True)
def leaky(v, slope):
    v = v * float32(1.0)  # a half value computes in float32; float32 and float64 keep their type, exactly
    return v if v > 0 else v * slope


@cuda.jit(device=True, inline=True)
def leaky_grad(g, v, slope):
    g = g * float32(1.0)
    return g if v > 0 else g * slope


@cuda.jit
def relu_forward(x, y, slope):
    """Four elements per thread per trip (launch_unrolled); y may be x."""
    n = y.size
    stride = cuda.gridsize(1)
    for i in range(cuda.grid(1), n, 4 * stride):
        i1, i2, i3, valid = four_indices(i, n, stride)
        v0, v1, v2, v3 = x[i], x[i1], x[i2], x[i3]
        y[i] = leaky(v0, slope)
        if valid > 1:
            y[i1] = leaky(v1, slope)
        if valid > 2:
            y[i2] = leaky(v2, slope)
        if valid > 3:
            y[i3] = leaky(v3, slope)


@cuda.jit
def relu_backward(y, dy, dx, slope):
    """Four elements per thread per trip (launch_unrolled); dx may be dy."""
    n = dx.size
    stride = cuda.gridsize(1)
    for i in range(cuda.grid(1), n, 4 * stride):
        i1, i2, i3, valid = four_indices(i, n, stride)
        v0, v1, v2, v3 = y[i], y[i1], y[i2], y[i3]
        g0, g1, g2, g3 = dy[i], dy[i1], dy[i2], dy[i3]
        dx[i] = leaky_grad(g0, v0, slope)
        if valid > 1:
            dx[i1] = leaky_grad(g1, v1, slope)
        if valid > 2:
            dx[i2] = leaky_grad(g2, v2, slope)
        if valid > 3:
            dx[i3] = leaky_grad(g3, v3, slope)


@cuda.jit
def relu_backward_scaled2(y, dy, slope, alpha, dx_a, beta, dx_b):
    """dx_a = alpha * g and dx_b = beta * g, g = dy masked by y > 0 (leaky slope): the backward of a fused
    Eltwise SUM + ReLU writes two bottom gradients in one pass over y and dy. Either output may be dy (a
    thread reads its elements before writing them); with one output the op passes it twice. Four elements
    per thread per trip (launch_unrolled)."""
    n = dy.size
    stride = cuda.gridsize(1)
    for i in range(cuda.grid(1), n, 4 * stride):
        i1, i2, i3, valid = four_indices(i, n, stride)
        g0 = leaky_grad(dy[i], y[i], slope)
        g1 = leaky_grad(dy[i1], y[i1], slope)
        g2 = leaky_grad(dy[i2], y[i2], slope)
        g3 = leaky_grad(dy[i3], y[i3], slope)
        dx_a[i] = alpha * g0
        dx_b[i] = beta * g0
        if valid > 1:
            dx_a[i1] = alpha * g1
            dx_b[i1] = beta * g1
        if valid > 2:
            dx_a[i2] = alpha * g2
            dx_b[i2] = beta * g2
        if valid > 3:
            dx_a[i3] = alpha * g3
            dx_b[i3] = beta * g3


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
