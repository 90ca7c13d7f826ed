"""Pooling kernels with Caffe's window rules (the same windows as backend/cpu/pooling.py).

Forward: one thread per output. Backward: one thread per input pixel, gathering from the outputs whose
windows hold it (no atomics). Shapes arrive as ints: n*c planes of (h, w) in, (oh, ow) out.
"""
from __future__ import annotations

import math

from numba import cuda

FLT_MIN = 1.1754943508222875e-38


@cuda.jit
def max_forward(x, y, mask, h, w, oh, ow, kh, kw, sh, sw, ph, pw):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        qw = i % ow
        qh = (i // ow) % oh
        plane = i // (ow * oh)
        h0 = qh * sh - ph
        w0 = qw * sw - pw
        h1 = min(h0 + kh, h)
        w1 = min(w0 + kw, w)
        best = -math.inf
        arg = -1
        for r in range(max(h0, 0), h1):
            for s in range(max(w0, 0), w1):
                v = x[(plane * h + r) * w + s]
                if v > best:
                    best = v
                    arg = r * w + s
        y[i] = best
        mask[i] = arg


@cuda.jit
def ave_forward(x, y, h, w, oh, ow, kh, kw, sh, sw, ph, pw, stochastic):
    """Average (divisor: the window clipped to the padded input) or Caffe's TEST stochastic
    sum(x^2) / (FLT_MIN + sum(x))."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        qw = i % ow
        qh = (i // ow) % oh
        plane = i // (ow * oh)
        h0 = qh * sh - ph
        w0 = qw * sw - pw
        h1 = min(h0 + kh, h + ph)
        w1 = min(w0 + kw, w + pw)
        size = (h1 - h0) * (w1 - w0)
        total = 0.0
        squares = 0.0
        for r in range(max(h0, 0), min(h1, h)):
            for s in range(max(w0, 0), min(w1, w)):
                v = x[(plane * h + r) * w + s]
                total += v
                squares += v * v
        y[i] = squares / (FLT_MIN + total) if stochastic else total / size


@cuda.jit(device=True)
def _out_range(p, pad, k, stride, n_out):
    """The outputs [lo, hi) along one axis whose windows contain input p."""
    lo = 0 if p + pad < k else (p + pad - k) // stride + 1
    hi = min((p + pad) // stride + 1, n_out)
    return lo, hi


@cuda.jit
def max_backward(dy, mask, dx, h, w, oh, ow, kh, kw, sh, sw, ph, pw):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        s = i % w
        r = (i // w) % h
        plane = i // (w * h)
        lo_h, hi_h = _out_range(r, ph, kh, sh, oh)
        lo_w, hi_w = _out_range(s, pw, kw, sw, ow)
        me = r * w + s
        grad = 0.0
        for qh in range(lo_h, hi_h):
            for qw in range(lo_w, hi_w):
                o = (plane * oh + qh) * ow + qw
                if mask[o] == me:
                    grad += dy[o]
        dx[i] = grad


@cuda.jit
def ave_backward(dy, dx, h, w, oh, ow, kh, kw, sh, sw, ph, pw):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        s = i % w
        r = (i // w) % h
        plane = i // (w * h)
        lo_h, hi_h = _out_range(r, ph, kh, sh, oh)
        lo_w, hi_w = _out_range(s, pw, kw, sw, ow)
        grad = 0.0
        for qh in range(lo_h, hi_h):
            h0 = qh * sh - ph
            rows = min(h0 + kh, h + ph) - h0
            for qw in range(lo_w, hi_w):
                w0 = qw * sw - pw
                cols = min(w0 + kw, w + pw) - w0
                grad += dy[(plane * oh + qh) * ow + qw] / (rows * cols)
        dx[i] = grad
