"""Crop (an N-D window copy), Tile and ArgMax kernels; see backend/cpu/shape_ops.py and reduction.py."""
from __future__ import annotations

from numba import cuda, float64


@cuda.jit
def window_copy(src, dst, meta, n, into_window):
    """Copy between the window of the big array and the small one, n = the small array's size.

    meta (int64) = [ndim, big shape..., small shape..., window offsets...]. into_window: dst is the big
    array (crop backward), else src is (crop forward).
    """
    nd = meta[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        rem = i
        big = 0
        stride = 1
        for a in range(nd - 1, -1, -1):
            d = meta[1 + nd + a]
            q = rem // d
            big += (rem - q * d + meta[1 + 2 * nd + a]) * stride
            rem = q
            stride *= meta[1 + a]
        if into_window:
            dst[big] = src[i]
        else:
            dst[i] = src[big]


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
