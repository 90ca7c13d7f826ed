"""One fused kernel per solver rule, mirroring backend/cpu/solver_ops.py: each leaves the update in dw
(as Caffe does) and applies w -= dw. At the end, the multi-tensor kernels that update (SGD) or clear the
gradients of every parameter in one launch."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda


@cuda.jit
def regularize(w, dw, decay, l1):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        if l1:
            v = w[i]
            dw[i] += decay * (1.0 if v > 0 else (-1.0 if v < 0 else 0.0))
        else:
            dw[i] += decay * w[i]


@cuda.jit
def sgd(w, dw, hist, lr, momentum):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        h = hist[i] * momentum + lr * dw[i]
        hist[i] = h
        dw[i] = h
        w[i] -= h


@cuda.jit
def nesterov(w, dw, hist, lr, momentum):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        old = hist[i]
        h = old * momentum + lr * dw[i]
        hist[i] = h
        u = h * (1.0 + momentum) - momentum * old
        dw[i] = u
        w[i] -= u


@cuda.jit
def adagrad(w, dw, hist, lr, delta):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        g = dw[i]
        h = hist[i] + g * g
        hist[i] = h
        u = g / (math.sqrt(h) + delta) * lr
        dw[i] = u
        w[i] -= u


@cuda.jit
def rmsprop(w, dw, hist, lr, rms_decay, delta):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        g = dw[i]
        h = hist[i] * rms_decay + (1.0 - rms_decay) * (g * g)
        hist[i] = h
        u = g / (math.sqrt(h) + delta) * lr
        dw[i] = u
        w[i] -= u


@cuda.jit
def adadelta(w, dw, hist_g, hist_dx, lr, momentum, delta):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        g = dw[i]
        hg = hist_g[i] * momentum + (1.0 - momentum) * (g * g)
        hist_g[i] = hg
        d = g * math.sqrt((hist_dx[i] + delta) / (hg + delta))
        hist_dx[i] = hist_dx[i] * momentum + (1.0 - momentum) * (d * d)
        u = d * lr
        dw[i] = u
        w[i] -= u


@cuda.jit
def adam(w, dw, m, v, lr_corrected, beta1, beta2, eps):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        g = dw[i]
        mi = m[i] * beta1 + (1.0 - beta1) * g
        vi = v[i] * beta2 + (1.0 - beta2) * (g * g)
        m[i] = mi
        v[i] = vi
        u = mi / (math.sqrt(vi) + eps) * lr_corrected
        dw[i] = u
        w[i] -= u


# Multi-tensor kernels: every learnable parameter in one launch. They index `arena`, one flat float32 view of
# the pool's arena (numba cannot follow a table of pointers, but it can index one array at per-parameter
# offsets). `segments` has a row per parameter: the element offsets of its data, gradient and history, and
# its length; `factors` its lr_mult and weight decay (float64: the local rate is formed as rate * lr_mult in
# float64 and then rounded, as the host does for the per-parameter op). `blocks` has a row per thread block:
# (segment, first element, end element), so a large tensor gets many blocks and a small one a block of its own.
_ONE, _ZERO = np.float32(1.0), np.float32(0.0)  # float32 constants keep the arithmetic in float32


@cuda.jit
def multi_sgd(arena, segments, factors, blocks, rate, momentum, clip_scale, iter_scale, l1):
    """Caffe's ApplyUpdate with SGD, per element in the order of the per-parameter ops: clip scale, 1/iter_size,
    weight decay (L1 or L2, none when 0), then h = momentum * h + lr * g; the update stays in the gradient."""
    b = cuda.blockIdx.x
    s = blocks[b, 0]
    w0, g0, h0 = segments[s, 0], segments[s, 1], segments[s, 2]
    lr = np.float32(rate * factors[s, 0])
    decay = np.float32(factors[s, 1])
    for i in range(blocks[b, 1] + cuda.threadIdx.x, blocks[b, 2], cuda.blockDim.x):
        g = arena[g0 + i] * clip_scale * iter_scale
        if decay != _ZERO:
            w = arena[w0 + i]
            if l1:
                g += decay * (_ONE if w > _ZERO else (-_ONE if w < _ZERO else _ZERO))
            else:
                g += decay * w
        h = arena[h0 + i] * momentum + lr * g
        arena[h0 + i] = h
        arena[g0 + i] = h
        arena[w0 + i] -= h


@cuda.jit
def multi_zero_grads(arena, segments, blocks):
    """Zero every segment's gradient."""
    b = cuda.blockIdx.x
    g0 = segments[blocks[b, 0], 1]
    for i in range(blocks[b, 1] + cuda.threadIdx.x, blocks[b, 2], cuda.blockDim.x):
        arena[g0 + i] = _ZERO
