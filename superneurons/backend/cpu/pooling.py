"""2-D max / average / stochastic(TEST) pooling over NCHW arrays, with Caffe's window rules.

Window (oh, ow) covers rows [oh*sh - ph, oh*sh - ph + kh) and the matching columns. Max pooling
looks at the part inside the image. Average pooling sums that same part but divides by the window
clipped to the *padded* image (padding counts, the ceil-mode overhang past the padding does not).

The max mask holds, per output, the flat index h * W + w of the chosen pixel in its plane (Caffe's
layout); on ties the first pixel in row-major window order wins, as in Caffe. Setup guarantees every
window holds at least one image pixel, so every mask entry is a real index.

The loops are serial numba kernels, one (image, channel) plane at a time (planes share nothing, so
a GPU kernel can take one plane or one output per thread; on 2 CPU cores numba's thread start-up
cost more than it saved).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from superneurons.backend.cpu.activation import relu_backward
from superneurons.backend.geometry import PoolGeometry, check_signed_mask

__all__ = ["pool_forward", "pool_backward"]

NO_MASK = np.zeros((0, 0, 0, 0), np.int32)  # what the average methods pass for the mask they do not use


def pool_forward(x: np.ndarray, y: np.ndarray, mask: np.ndarray | None, geom: PoolGeometry,
                 top_mask: np.ndarray | None = None, signed_mask: bool = False) -> None:
    """y = pool(x). For "max", `mask` (int32, shape of y) receives the argmax and `top_mask`, if given,
    the same indices as floats (Caffe's optional second top). `signed_mask`: where a window's maximum is not
    above 0, the mask holds ~argmax (-1 - argmax) instead, which tells backward the ReLU's mask there (see
    pool_backward)."""
    window = geom.kernel + geom.stride + geom.pad
    if geom.method == "max":
        assert mask is not None, "max pooling writes its mask"
        check_signed_mask(signed_mask, top_mask)
        _window_forward(x, y, mask, MAX, 0.0, *window)
        if top_mask is not None:
            np.copyto(top_mask, mask, casting="unsafe")
        if signed_mask:
            np.copyto(mask, ~mask, where=~(y > 0))
    elif geom.method == "ave":
        _window_forward(x, y, NO_MASK, AVE, 0.0, *window)
    elif geom.method == "stochastic":
        _window_forward(x, y, NO_MASK, STOCHASTIC, float(np.finfo(y.dtype).tiny), *window)
    else:
        raise ValueError(f"unknown pooling method {geom.method!r}")


def pool_backward(dy: np.ndarray, mask: np.ndarray | None, dx: np.ndarray, geom: PoolGeometry,
                  relu_slope: float | None = None) -> None:
    """dx = the gradient of pool_forward (overwritten); "max" routes each dy to its mask pixel.

    `relu_slope` (max only; the mask then signed by pool_forward): the ReLU in place on the pooling's bottom
    leaves its backward to the pooling (graph/fuse.py), so dx goes on through that ReLU too, as relu_backward
    would apply it. A pixel that a window chose holds that window's maximum, whose sign the mask keeps; the
    pixels no window chose get no gradient either way."""
    window = geom.kernel + geom.stride + geom.pad
    if geom.method == "max":
        assert mask is not None, "max pooling's backward reads its mask"
        if relu_slope is None:
            _window_backward(dy, mask, dx, MAX, *window)
            return
        chosen = np.where(mask >= 0, mask, ~mask)
        _window_backward(dy, chosen, dx, MAX, *window)
        positive = np.zeros(dx.shape, bool)
        planes = positive.reshape(dx.shape[0] * dx.shape[1], -1)
        np.put_along_axis(planes, chosen.reshape(planes.shape[0], -1), (mask >= 0).reshape(planes.shape[0], -1),
                          axis=1)
        relu_backward(positive, dx, dx, relu_slope)
    elif geom.method == "ave":
        _window_backward(dy, NO_MASK, dx, AVE, *window)
    else:
        raise ValueError(f"pooling method {geom.method!r} has no backward")


@njit(cache=True, inline="always")
def _span(o, k, s, p, n):
    """Window o along one axis: (first, end) inside the image, and its length clipped at n + p."""
    start = o * s - p
    end = min(start + k, n + p)
    return max(start, 0), min(end, n), end - start


# The forward methods, one kernel: `_window_forward`'s `method`.
MAX, AVE, STOCHASTIC = 0, 1, 2


@njit(cache=True)
def _window_forward(x, y, mask, method, tiny, kh, kw, sh, sw, ph, pw):
    """Every output's window: MAX (the first largest pixel inside the image, its flat index into `mask`), AVE
    (the pixels inside the image summed, over the window clipped at the padding) or STOCHASTIC, Caffe's TEST
    rule (the activation-weighted mean sum(x^2) / sum(x), the sum started at `tiny` = FLT_MIN so that an
    all-zero window gives 0, not NaN)."""
    n_img, ch, h, w = x.shape
    oh, ow = y.shape[2], y.shape[3]
    for plane in range(n_img * ch):
        n, c = plane // ch, plane % ch
        for r in range(oh):
            h0, h1, size_h = _span(r, kh, sh, ph, h)
            for q in range(ow):
                w0, w1, size_w = _span(q, kw, sw, pw, w)
                if method == MAX:
                    best = x[n, c, h0, w0]
                    arg = h0 * w + w0
                    for i in range(h0, h1):
                        for j in range(w0, w1):
                            if x[n, c, i, j] > best:
                                best = x[n, c, i, j]
                                arg = i * w + j
                    y[n, c, r, q] = best
                    mask[n, c, r, q] = arg
                    continue
                total = 0.0 if method == AVE else tiny
                weighted = 0.0
                for i in range(h0, h1):
                    for j in range(w0, w1):
                        v = x[n, c, i, j]
                        total += v
                        weighted += v * v
                y[n, c, r, q] = total / (size_h * size_w) if method == AVE else weighted / total


@njit(cache=True)
def _window_backward(dy, mask, dx, method, kh, kw, sh, sw, ph, pw):
    """dx, overwritten: MAX routes each output's gradient to its mask pixel; AVE spreads it evenly over the
    window's pixels inside the image, each share over the window clipped at the padding (as forward divides)."""
    n_img, ch, h, w = dx.shape
    oh, ow = dy.shape[2], dy.shape[3]
    for plane in range(n_img * ch):
        n, c = plane // ch, plane % ch
        dx[n, c] = 0
        for r in range(oh):
            h0, h1, size_h = _span(r, kh, sh, ph, h)
            for q in range(ow):
                if method == MAX:
                    a = mask[n, c, r, q]
                    dx[n, c, a // w, a % w] += dy[n, c, r, q]
                    continue
                w0, w1, size_w = _span(q, kw, sw, pw, w)
                share = dy[n, c, r, q] / (size_h * size_w)
                for i in range(h0, h1):
                    for j in range(w0, w1):
                        dx[n, c, i, j] += share
