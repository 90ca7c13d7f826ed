"""A convolution's column buffer (Caffe's Im2col layer) and its adjoint, over NCHW arrays.

Entry (n, (c * kh + i) * kw + j, oh, ow) of the column buffer is the pixel that kernel tap (i, j) of output
(oh, ow) reads in channel c, or 0 in the padding. The adjoint gathers: each pixel sums the entries that read
it, so no two threads write one element and no atomics are needed.
"""
from __future__ import annotations

from numba import cuda


@cuda.jit
def im2col(x, col, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw):
    taps = kh * kw
    for e in range(cuda.grid(1), col.size, cuda.gridsize(1)):
        q = e % ow
        r = e // ow
        p = r % oh
        r = r // oh
        row = r % (c * taps)
        n = r // (c * taps)
        ch = row // taps
        tap = row - ch * taps
        i = tap // kw
        j = tap - i * kw
        y = p * sh - ph + i * dh
        xx = q * sw - pw + j * dw
        if 0 <= y < h and 0 <= xx < w:
            col[e] = x[((n * c + ch) * h + y) * w + xx]
        else:
            col[e] = 0.0


@cuda.jit
def col2im(dcol, dx, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw):
    taps = kh * kw
    for e in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        xx = e % w
        r = e // w
        y = r % h
        r = r // h
        ch = r % c
        n = r // c
        total = 0.0
        for i in range(kh):
            span_y = y + ph - i * dh
            if span_y < 0 or span_y % sh != 0 or span_y // sh >= oh:
                continue
            p = span_y // sh
            for j in range(kw):
                span_x = xx + pw - j * dw
                if span_x < 0 or span_x % sw != 0 or span_x // sw >= ow:
                    continue
                row = (n * c + ch) * taps + i * kw + j
                total += dcol[(row * oh + p) * ow + span_x // sw]
        dx[e] = total
