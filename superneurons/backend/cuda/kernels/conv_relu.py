"""The kernel of the fused Convolution + ReLU forward (graph/fuse.py; the math in backend/cpu/conv.py): the pass
over the convolution's output y, viewed as (outer, dim, inner) = (N, C, H*W), that the fusion leaves after
cuDNN's call: `bias_relu`, y = relu(y + b[c]) in place (instead of cuDNN's bias add, then the ReLU's pass).

It walks its elements as kernels/fused.py's BatchNorm kernels do (that module says why): one block per
(channel, chunk of whole planes), so the channel's bias sits in a register and no element needs an integer
division; four loads in flight per thread; planes of ROWS_MIN elements or more swept plainly (`bias_relu_rows`).
"""
from __future__ import annotations

from numba import cuda

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.elementwise import leaky
from superneurons.backend.cuda.kernels.fused import block_region, four_positions, plane_start, walk_start

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
