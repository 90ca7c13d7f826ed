"""Kernels of the fused Convolution + ReLU (graph/fuse.py; the math in backend/cpu/conv.py): the passes over the
convolution's output y, viewed as (outer, dim, inner) = (N, C, H*W), that the fusion leaves after cuDNN's calls.

Forward: `bias_relu`, y = relu(y + b[c]) in place (instead of cuDNN's bias add, then the ReLU's pass).
Backward: `relu_mask_sum`, dy = dy masked by y > 0 (Caffe's leaky gradient) in place, and the float64 sum of
the masked dy per channel added into sums[c] (then kernels/reduce.py's channel_finish adds it to the bias
gradient), instead of the ReLU's pass and a bias-gradient pass.

They walk their elements as kernels/fused.py's BatchNorm kernels do (that module says why): one block per
(channel, chunk of whole planes), so the channel's bias sits in a register and no element needs an integer
division; four loads in flight per thread; planes of ROWS_MIN elements or more swept plainly (`*_rows`).
"""
from __future__ import annotations

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.elementwise import leaky, leaky_grad
from superneurons.backend.cuda.kernels.fused import block_region, four_positions, plane_start, walk_start
from superneurons.backend.cuda.kernels.reduce import block_sum

ROWS_MIN = 4 * BLOCK  # elements per plane from which the plain sweep runs (four blocks' worth, as fused BatchNorm)


@cuda.jit
def bias_relu(y, b, outer, dim, inner, chunk, slope):
    """y = leaky(y + b[c], slope) over this block's planes of channel c."""
    c, n0, planes = block_region(outer, chunk)
    bias = b[c]
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        v0, v1, v2, v3 = y[i0], y[i1], y[i2], y[i3]  # all four read before any store (masked ones read i0)
        y[i0] = leaky(v0 + bias, slope)
        if valid > 1:
            y[i1] = leaky(v1 + bias, slope)
        if valid > 2:
            y[i2] = leaky(v2 + bias, slope)
        if valid > 3:
            y[i3] = leaky(v3 + bias, slope)


@cuda.jit
def bias_relu_rows(y, b, outer, dim, inner, chunk, slope):
    """bias_relu for planes swept plainly (ROWS_MIN elements or more)."""
    c, n0, planes = block_region(outer, chunk)
    bias = b[c]
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            v0, v1, v2, v3 = y[i], y[i + BLOCK], y[i + 2 * BLOCK], y[i + 3 * BLOCK]
            y[i] = leaky(v0 + bias, slope)
            y[i + BLOCK] = leaky(v1 + bias, slope)
            y[i + 2 * BLOCK] = leaky(v2 + bias, slope)
            y[i + 3 * BLOCK] = leaky(v3 + bias, slope)
            i += 4 * BLOCK
        while i < end:
            y[i] = leaky(y[i] + bias, slope)
            i += BLOCK


@cuda.jit(device=True, inline=True)
def add_channel_sum(s, shared, sums, c):
    """sums[c] += the block's total of s (one atomic per block)."""
    total = block_sum(s, shared)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(sums, c, total)


@cuda.jit
def relu_mask_sum(y, dy, sums, outer, dim, inner, chunk, slope):
    """dy = leaky_grad(dy, y, slope) in place; sums[c] += the float64 sum of the new dy over this block's planes
    of channel c."""
    shared = cuda.shared.array(BLOCK, float64)
    c, n0, planes = block_region(outer, chunk)
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    s = 0.0
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        v0, v1, v2, v3 = y[i0], y[i1], y[i2], y[i3]
        g0, g1, g2, g3 = dy[i0], dy[i1], dy[i2], dy[i3]  # all read before any store
        d0 = leaky_grad(g0, v0, slope)
        d1 = leaky_grad(g1, v1, slope)
        d2 = leaky_grad(g2, v2, slope)
        d3 = leaky_grad(g3, v3, slope)
        dy[i0] = d0
        if valid > 1:
            dy[i1] = d1
        if valid > 2:
            dy[i2] = d2
        if valid > 3:
            dy[i3] = d3
        s += (float64(d0) + (float64(d1) if valid > 1 else 0.0)) \
            + ((float64(d2) if valid > 2 else 0.0) + (float64(d3) if valid > 3 else 0.0))
    add_channel_sum(s, shared, sums, c)


@cuda.jit
def relu_mask_sum_rows(y, dy, sums, outer, dim, inner, chunk, slope):
    """relu_mask_sum for planes swept plainly (ROWS_MIN elements or more)."""
    shared = cuda.shared.array(BLOCK, float64)
    c, n0, planes = block_region(outer, chunk)
    s = 0.0
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            v0, v1, v2, v3 = y[i], y[i + BLOCK], y[i + 2 * BLOCK], y[i + 3 * BLOCK]
            g0, g1, g2, g3 = dy[i], dy[i + BLOCK], dy[i + 2 * BLOCK], dy[i + 3 * BLOCK]
            d0 = leaky_grad(g0, v0, slope)
            d1 = leaky_grad(g1, v1, slope)
            d2 = leaky_grad(g2, v2, slope)
            d3 = leaky_grad(g3, v3, slope)
            dy[i] = d0
            dy[i + BLOCK] = d1
            dy[i + 2 * BLOCK] = d2
            dy[i + 3 * BLOCK] = d3
            s += (float64(d0) + float64(d1)) + (float64(d2) + float64(d3))
            i += 4 * BLOCK
        while i < end:
            d0 = leaky_grad(dy[i], y[i], slope)
            dy[i] = d0
            s += float64(d0)
            i += BLOCK
    add_channel_sum(s, shared, sums, c)
