"""Float64 sums over the "rows" of an (outer, dim, inner) view: row c is every element with middle index c.

A contiguous (rows, n) matrix is the view (1, rows, n); per-channel sums of an (N, C, HW) blob are the view
(N, C, HW). Each mode sums one or two terms of x (and y) per row into sums[c] and sums[dim + c]:

    SUM x;  ASUM |x|;  SUMSQ x*x;  MOMENTS x and x*x;  DOT y and x*y;  NEG_DOT min(x, 0)*y;  SQDIFF (x-y)^2

Two kernels share the per-element terms: `partials` splits every row into chunks, one block per
(row, chunk), and adds the block's sums with atomics (sums zeroed first), so a few long rows still fill
the GPU; `serial` walks each short row in one thread, so many short rows do not waste idle blocks.
"""
from __future__ import annotations

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.reduce import block_sum

SUM, ASUM, SUMSQ, MOMENTS, DOT, NEG_DOT, SQDIFF = range(7)


@cuda.jit(device=True)
def element(j, c, dim, inner):
    """Flat index of the j-th element of row c."""
    q = j // inner
    return (q * dim + c) * inner + j - q * inner


@cuda.jit(device=True)
def terms(mode, v, w):
    """The (first, second) summands of one element; v from x, w from y (float64)."""
    if mode == SUM:
        return v, 0.0
    if mode == ASUM:
        return abs(v), 0.0
    if mode == SUMSQ:
        return v * v, 0.0
    if mode == MOMENTS:
        return v, v * v
    if mode == DOT:
        return w, v * w
    if mode == NEG_DOT:
        return min(v, 0.0) * w, 0.0
    d = v - w
    return d * d, 0.0


@cuda.jit
def partials(x, y, sums, outer, dim, inner, chunk, mode):
    shared = cuda.shared.array(BLOCK, float64)
    m = outer * inner
    nchunks = (m + chunk - 1) // chunk
    c = cuda.blockIdx.x // nchunks
    j0 = (cuda.blockIdx.x - c * nchunks) * chunk
    j1 = min(j0 + chunk, m)
    acc0 = 0.0
    acc1 = 0.0
    for j in range(j0 + cuda.threadIdx.x, j1, BLOCK):
        k = element(j, c, dim, inner)
        w = float64(y[k]) if mode >= DOT else 0.0
        a, b = terms(mode, float64(x[k]), w)
        acc0 += a
        acc1 += b
    t0 = block_sum(acc0, shared)
    t1 = block_sum(acc1, shared)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(sums, c, t0)
        cuda.atomic.add(sums, dim + c, t1)


@cuda.jit
def serial(x, y, sums, outer, dim, inner, mode):
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        acc0 = 0.0
        acc1 = 0.0
        for j in range(outer * inner):
            k = element(j, c, dim, inner)
            w = float64(y[k]) if mode >= DOT else 0.0
            a, b = terms(mode, float64(x[k]), w)
            acc0 += a
            acc1 += b
        sums[c] = acc0
        sums[dim + c] = acc1


@cuda.jit
def scaled_rows(sums, out, scale, accumulate):
    """out[c] (+)= scale * sums[c] (cast to out's dtype)."""
    for c in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = sums[c] * scale
        out[c] = out[c] + v if accumulate else v


@cuda.jit
def total_into(sums, out, scale, accumulate):
    """out[0] (+)= scale * (sums[0] + ... + sums[n-1]) with n = sums.size // 2 (one thread: n is small)."""
    if cuda.grid(1) == 0:
        acc = 0.0
        for c in range(sums.size // 2):
            acc += sums[c]
        v = acc * scale
        out[0] = out[0] + v if accumulate else v


def chunking(m: int, dim: int, block: int = BLOCK, target_blocks: int = 4096) -> tuple[int, int]:
    """(elements per block, blocks) for `partials`: about target_blocks blocks, at least `block` per chunk."""
    nchunks = max(1, min(-(-target_blocks // max(dim, 1)), -(-m // block)))
    chunk = max(1, -(-m // nchunks))
    return chunk, dim * (-(-m // chunk))
