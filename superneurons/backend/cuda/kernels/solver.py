"""One fused kernel per solver rule, mirroring backend/cpu/solver_ops.py: each leaves the update in dw
(as Caffe does) and applies w -= dw."""
from __future__ import annotations

import math

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
