"""Crop (an N-D window copy), Tile and ArgMax kernels; see backend/cpu/shape_ops.py and reduction.py."""
from __future__ import annotations

from numba import cuda, float64


@cuda.jit(device=True, inline=True)
def _window_axis(rem, big, stride, b, s, o):
    """One axis of window_copy's index walk (last axis first): the small array's index `rem` loses this axis's
    coordinate, which (shifted by the offset o) adds into the big array's index at the current stride."""
    q = rem // s
    return q, big + (rem - q * s + o) * stride, stride * b


@cuda.jit
def window_copy(src, dst, n, into_window, b0, b1, b2, b3, b4, b5, s0, s1, s2, s3, s4, s5, o0, o1, o2, o3, o4, o5):
    """Copy between the window of the big array and the small one, n = the small array's size.

    The geometry is in the arguments, so it needs no device memory: the big array's shape b0..b5, the small
    one's s0..s5 and the window's offsets o0..o5, over WINDOW_AXES axes (ops/shape_ops.py merges the axes a crop
    keeps whole and pads the rest with leading axes of size 1). into_window: dst is the big array (crop
    backward), else src is (crop forward).
    """
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        rem, big, stride = i, 0, 1
        rem, big, stride = _window_axis(rem, big, stride, b5, s5, o5)
        rem, big, stride = _window_axis(rem, big, stride, b4, s4, o4)
        rem, big, stride = _window_axis(rem, big, stride, b3, s3, o3)
        rem, big, stride = _window_axis(rem, big, stride, b2, s2, o2)
        rem, big, stride = _window_axis(rem, big, stride, b1, s1, o1)
        rem, big, stride = _window_axis(rem, big, stride, b0, s0, o0)
        if into_window:
            dst[big] = src[i]
        else:
            dst[i] = src[big]


WINDOW_AXES = 6  # the axes window_copy's arguments describe


@cuda.jit
def tile_forward(x, y, tiles, inner):
    """y viewed as (outer, tiles, inner) = x viewed as (outer, 1, inner)."""
    block = tiles * inner
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        o = i // block
        y[i] = x[o * inner + i % inner]


@cuda.jit
def tile_backward(dy, dx, tiles, inner):
    """dx viewed as (outer, inner) = the sum over the tiles of dy viewed as (outer, tiles, inner)."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        o = i // inner
        base = o * tiles * inner + i - o * inner
        acc = float64(0.0)
        for t in range(tiles):
            acc += dy[base + t * inner]
        dx[i] = acc


@cuda.jit
def argmax(x, y, outer, dim, inner, top_k, out_max_val, by_axis):
    """Caffe's ArgMax, one thread per (outer, inner) column of x viewed as (outer, dim, inner).

    Pick k is the largest (value, index) pair, ordered by value then index (ties to the larger index),
    that is smaller than pick k - 1: a selection in top_k passes, no sorting scratch needed.
    """
    for p in range(cuda.grid(1), outer * inner, cuda.gridsize(1)):
        o = p // inner
        r = p - o * inner
        base = o * dim * inner + r
        prev_v = x[base]
        prev_i = dim
        for k in range(top_k):
            best_v = x[base]
            best_i = -1
            for c in range(dim):
                v = x[base + c * inner]
                if k > 0 and not (v < prev_v or (v == prev_v and c < prev_i)):
                    continue
                if best_i < 0 or v > best_v or (v == best_v and c > best_i):
                    best_v = v
                    best_i = c
            prev_v = best_v
            prev_i = best_i
            if by_axis:
                y[(o * top_k + k) * inner + r] = best_v if out_max_val else best_i
            else:
                width = 2 if out_max_val else 1
                y[o * width * top_k + k] = best_i
                if out_max_val:
                    y[(o * width + 1) * top_k + k] = best_v
