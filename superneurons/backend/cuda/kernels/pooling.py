"""Pooling kernels with Caffe's window rules (the same windows as backend/cpu/pooling.py).

The ops launch one thread per (plane, column) walking down it (`*_columns`): forward per output column,
backward per input column, where each input pixel gathers from the outputs whose windows hold it (no atomics,
so the sums are deterministic). 64-bit integer division is a software routine on the GPU, and per-pixel index
arithmetic made the per-pixel versions compute-bound (~1.5 ms for ResNet-50's pool1 max backward at batch 64 on
an H200; average pooling took 27 of Inception-v4's 133 ms step on an H100, twice PyTorch's). Average pooling
sums and divides in float32, as Caffe's Dtype arithmetic does (float64 division is slower still). The
per-pixel `max_forward`, `max_backward`, `ave_forward`, `ave_backward` remain as the plain statements of the
rules the column walkers implement (the simulator tests check each pair against the CPU op). Where the
windows tile the planes (kernel == stride, no padding), max backward runs one thread per output instead
(`max_backward_tiles`). The backward walker loads the mask entries and gradients of the up to 2x2 windows
holding a pixel together: in loops of runtime length each load waited for the previous one, and latency,
not bandwidth, was its time (SqueezeNet's three poolings: 1.98 -> 1.40 ms at batch 64 on an H100). The
forward is bound by its instructions instead (grouping its loads the same way made it slower, 0.88 ->
0.95 ms, with a comparison more per element); it saves work where windows overlap by a row, carrying a
window's last row maximum into the next window (3x3 stride 2: 0.88 -> 0.79 ms). A signed mask (`signed`,
`relu`: the pooling runs the backward of the ReLU it reads, graph/fuse.py) holds -1 - argmax where the
window's maximum is not above 0.
Shapes arrive as ints: n*c planes of (h, w) in, (oh, ow) out.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from superneurons.backend.cuda.kernels.slab import at  # unsigned indexes: no wrap-around of negative ones

FLT_MIN = 1.1754943508222875e-38
FLT_MIN32 = np.float32(FLT_MIN)


@cuda.jit(device=True, inline=True)
def _mask_entry(arg, best, signed):
    """The argmax as the mask keeps it: ~arg (-1 - arg) where `signed` and the maximum is not above 0."""
    if signed and not best > 0:
        return -1 - arg
    return arg


@cuda.jit
def max_forward(x, y, mask, h, w, oh, ow, kh, kw, sh, sw, ph, pw, signed):
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
        mask[i] = _mask_entry(arg, best, signed)


@cuda.jit(device=True, inline=True)
def _row_max(x, row, s0, s1):
    """(max, column of its first occurrence, -1 if none is above -inf) of x[row + s] over columns [s0, s1)."""
    best = -math.inf
    col = -1
    for s in range(s0, s1):
        v = x[at(row + s)]
        if v > best:
            best = v
            col = s
    return best, col


@cuda.jit
def max_forward_columns(x, y, mask, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, signed):
    """max_forward with one thread per (plane, output column) walking down the column: the column's window
    columns and the plane offsets are computed once (one division per thread instead of three per output),
    and each output row's window starts sh rows further down. A window's maximum is the first of its rows'
    maxima to exceed the ones above it (the first in row-major order, as the plain scan chooses), and the
    last row's is carried to the next window, which starts on it where windows overlap by one row (3x3
    stride 2: a third fewer loads and comparisons)."""
    for t in range(cuda.grid(1), planes * ow, cuda.gridsize(1)):
        plane = t // ow
        qw = t - plane * ow
        w0 = qw * sw - pw
        s0 = max(w0, 0)
        s1 = min(w0 + kw, w)
        src = plane * h * w
        dst = plane * oh * ow + qw
        h0 = -ph
        carried = -1  # the row whose maximum (carried_best, carried_col) the last window ended on
        carried_best = -math.inf
        carried_col = -1
        for qh in range(oh):
            best = -math.inf
            arg = -1
            r1 = min(h0 + kh, h)
            for r in range(max(h0, 0), r1):
                if r == carried:
                    rb, col = carried_best, carried_col
                else:
                    rb, col = _row_max(x, src + r * w, s0, s1)
                if rb > best:
                    best = rb
                    arg = r * w + col
                if r == r1 - 1:
                    carried, carried_best, carried_col = r, rb, col
            y[at(dst)] = best
            mask[at(dst)] = _mask_entry(arg, best, signed)
            dst += ow
            h0 += sh


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


@cuda.jit
def ave_forward_columns(x, y, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, stochastic):
    """ave_forward with one thread per (plane, output column) walking down the column, in float32."""
    for t in range(cuda.grid(1), planes * ow, cuda.gridsize(1)):
        plane = t // ow
        qw = t - plane * ow
        w0 = qw * sw - pw
        w1 = min(w0 + kw, w + pw)
        cols = w1 - w0  # the divisor counts padding inside the padded image, as Caffe's does
        s0 = max(w0, 0)
        s1 = min(w1, w)
        src = plane * h * w
        dst = plane * oh * ow + qw
        h0 = -ph
        for qh in range(oh):
            h1 = min(h0 + kh, h + ph)
            total = np.float32(0.0)
            squares = np.float32(0.0)
            for r in range(max(h0, 0), min(h1, h)):
                row = src + r * w
                for s in range(s0, s1):
                    v = x[row + s]
                    total += v
                    squares += v * v
            if stochastic:
                y[dst] = squares / (FLT_MIN32 + total)
            else:
                y[dst] = total / np.float32((h1 - h0) * cols)
            dst += ow
            h0 += sh


@cuda.jit
def ave_backward_columns(dy, dx, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw):
    """ave_backward with one thread per (plane, input column) walking down the column (the window bookkeeping
    of max_backward_columns), in float32."""
    for t in range(cuda.grid(1), planes * w, cuda.gridsize(1)):
        s, src, out_plane, lo_w, hi_w = _input_column(t, h, w, oh, ow, kw, sw, pw)
        lo = 0
        hi = 0
        for r in range(h):
            lo, hi = _rows_holding(r, lo, hi, oh, kh, sh, ph)
            grad = np.float32(0.0)
            for qh in range(lo, hi):
                h0 = qh * sh - ph
                rows = min(h0 + kh, h + ph) - h0
                row = (out_plane + qh) * ow
                for qw in range(lo_w, hi_w):
                    w0 = qw * sw - pw
                    grad += dy[row + qw] / np.float32(rows * (min(w0 + kw, w + pw) - w0))
            dx[src + r * w] = grad


@cuda.jit(device=True)
def _input_column(t, h, w, oh, ow, kw, sw, pw):
    """Backward walker t's column: (column s, flat index of its top pixel, first output row of its plane,
    the output columns [lo_w, hi_w) whose windows hold it)."""
    plane = t // w
    s = t - plane * w
    lo_w, hi_w = _out_range(s, pw, kw, sw, ow)
    return s, plane * h * w + s, plane * oh, lo_w, hi_w


@cuda.jit(device=True)
def _rows_holding(r, lo, hi, oh, kh, sh, ph):
    """The output rows [lo, hi) whose windows hold input row r, moved on from those of row r - 1: lo is the
    first window whose rows [q*sh - ph, q*sh - ph + kh) reach row r, hi the first starting below it (capped at
    oh). Both only move forward as r grows, so comparisons replace divisions."""
    while lo < oh and lo * sh - ph + kh <= r:
        lo += 1
    while hi < oh and hi * sh - ph <= r:
        hi += 1
    return lo, hi


@cuda.jit(device=True)
def _out_range(p, pad, k, stride, n_out):
    """The outputs [lo, hi) along one axis whose windows contain input p."""
    lo = 0 if p + pad < k else (p + pad - k) // stride + 1
    hi = min((p + pad) // stride + 1, n_out)
    return lo, hi


@cuda.jit(device=True, inline=True)
def _chosen(entry, signed):
    """(the pixel a mask entry names, whether the window's maximum was above 0) (see _mask_entry)."""
    if signed and entry < 0:
        return -1 - entry, False
    return entry, True


@cuda.jit(device=True, inline=True)
def _through_relu(grad, positive, relu, slope):
    """The pixel's gradient, rounded to float32 (where a separate ReLU step would read it), and with `relu`
    through the ReLU whose output the pooling read: `positive` is the sign of a choosing window's maximum,
    False where no window chose the pixel (the gradient is 0 then, either way)."""
    g = float32(grad)
    if relu and not positive:
        return g * slope
    return g


@cuda.jit
def max_backward(dy, mask, dx, h, w, oh, ow, kh, kw, sh, sw, ph, pw, relu, slope):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        s = i % w
        r = (i // w) % h
        plane = i // (w * h)
        lo_h, hi_h = _out_range(r, ph, kh, sh, oh)
        lo_w, hi_w = _out_range(s, pw, kw, sw, ow)
        me = r * w + s
        grad = 0.0
        positive = False
        for qh in range(lo_h, hi_h):
            for qw in range(lo_w, hi_w):
                o = (plane * oh + qh) * ow + qw
                pixel, above = _chosen(mask[o], relu)
                if pixel == me:
                    grad += dy[o]
                    positive = above
        dx[i] = _through_relu(grad, positive, relu, slope)


@cuda.jit(device=True, inline=True)
def _gathered(entry, d, me, relu, grad, positive):
    """Add the gradient d of a window whose mask entry is `entry` if it chose pixel `me`."""
    pixel, above = _chosen(entry, relu)
    if pixel == me:
        return grad + d, above
    return grad, positive


@cuda.jit
def max_backward_columns(dy, mask, dx, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, relu, slope):
    """max_backward with one thread per (plane, input column) walking down the column: the column's output
    range is computed once, and the row range [lo, hi) of the windows holding row r only moves forward as r
    grows, so it advances by comparisons instead of divisions. With `relu` (the mask signed by the forward),
    the gradient goes on through the ReLU in place on the pooling's bottom.

    Where at most two windows hold a pixel along each axis (3x3 stride 2, 2x2 stride 2), the up to four
    windows' mask entries and gradients are loaded together, then added in row-major order, as the plain
    loop adds them (which wider overlaps take)."""
    for t in range(cuda.grid(1), planes * w, cuda.gridsize(1)):
        s, src, out_plane, lo_w, hi_w = _input_column(t, h, w, oh, ow, kw, sw, pw)
        pair_w = hi_w - lo_w <= 2
        qw1 = min(lo_w + 1, hi_w - 1)  # the second window column (clamped: one column, or none, is valid)
        lo = 0
        hi = 0
        for r in range(h):
            lo, hi = _rows_holding(r, lo, hi, oh, kh, sh, ph)
            me = r * w + s
            grad = 0.0
            positive = False
            if pair_w and hi - lo <= 2:
                if lo < hi and lo_w < hi_w:
                    a = (out_plane + lo) * ow
                    b = (out_plane + min(lo + 1, hi - 1)) * ow
                    m0, m1, m2, m3 = mask[at(a + lo_w)], mask[at(a + qw1)], mask[at(b + lo_w)], mask[at(b + qw1)]
                    d0, d1, d2, d3 = dy[at(a + lo_w)], dy[at(a + qw1)], dy[at(b + lo_w)], dy[at(b + qw1)]
                    two_w = hi_w - lo_w == 2
                    two_h = hi - lo == 2
                    grad, positive = _gathered(m0, d0, me, relu, grad, positive)
                    if two_w:
                        grad, positive = _gathered(m1, d1, me, relu, grad, positive)
                    if two_h:
                        grad, positive = _gathered(m2, d2, me, relu, grad, positive)
                        if two_w:
                            grad, positive = _gathered(m3, d3, me, relu, grad, positive)
            else:
                for qh in range(lo, hi):
                    row = (out_plane + qh) * ow
                    for qw in range(lo_w, hi_w):
                        grad, positive = _gathered(mask[at(row + qw)], dy[at(row + qw)], me, relu, grad, positive)
            dx[at(src + r * w)] = _through_relu(grad, positive, relu, slope)


@cuda.jit
def max_backward_tiles(dy, mask, dx, h, w, oh, ow, kh, kw, relu, slope):
    """max_backward where the windows tile the planes exactly (kernel == stride, no padding, h == oh * kh and
    w == ow * kw: VGG's 2x2 stride-2 poolings): every pixel lies in one window, so one thread per output
    writes its window, the gradient at the chosen pixel and 0 elsewhere. dy and the mask are read once
    (the column walker reads them per pixel of the window) and one division per output replaces the walk."""
    for o in range(cuda.grid(1), dy.size, cuda.gridsize(1)):
        row = o // ow  # plane * oh + window row
        qw = o - row * ow
        base = row * kh * w + qw * kw  # flat index of the window's top-left pixel
        plane_start = (row // oh) * h * w
        pixel, positive = _chosen(mask[o], relu)
        chosen = plane_start + pixel
        g = _through_relu(dy[o], positive, relu, slope)
        for i in range(kh):
            for j in range(kw):
                k = base + i * w + j
                dx[k] = g if k == chosen else float32(0.0)


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
