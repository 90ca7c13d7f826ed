"""Reductions: a block-wide sum, per-channel sums over (outer, dim, inner) views, and whole-array sums.

Per-channel kernels run one block per channel (grid = dim) and accumulate in float64.
"""
from __future__ import annotations

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK


@cuda.jit(device=True)
def block_sum(value, shared):
    """The sum of `value` over the block's BLOCK threads, returned to every thread."""
    tid = cuda.threadIdx.x
    shared[tid] = value
    cuda.syncthreads()
    step = BLOCK // 2
    while step > 0:
        if tid < step:
            shared[tid] += shared[tid + step]
        cuda.syncthreads()
        step //= 2
    total = shared[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def channel_index(j, c, dim, inner):
    """Flat index of the j-th element of channel c in an (outer, dim, inner) array."""
    return ((j // inner) * dim + c) * inner + j % inner


@cuda.jit
def channel_sum(x, out, outer, dim, inner, accumulate):
    """out[c] (+)= sum over outer and inner of x."""
    shared = cuda.shared.array(BLOCK, float64)
    c = cuda.blockIdx.x
    acc = 0.0
    for j in range(cuda.threadIdx.x, outer * inner, BLOCK):
        acc += x[channel_index(j, c, dim, inner)]
    total = block_sum(acc, shared)
    if cuda.threadIdx.x == 0:
        out[c] = total + out[c] if accumulate else total


@cuda.jit
def channel_dot(x, y, out, outer, dim, inner, accumulate):
    """out[c] (+)= sum over outer and inner of x * y."""
    shared = cuda.shared.array(BLOCK, float64)
    c = cuda.blockIdx.x
    acc = 0.0
    for j in range(cuda.threadIdx.x, outer * inner, BLOCK):
        k = channel_index(j, c, dim, inner)
        acc += x[k] * y[k]
    total = block_sum(acc, shared)
    if cuda.threadIdx.x == 0:
        out[c] = total + out[c] if accumulate else total


@cuda.jit
def array_sum(x, y, out, mode):
    """out[0] += sum of |x| (mode 0), x*x (mode 1) or x*y (mode 2), in float64."""
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = float64(x[i])
        if mode == 0:
            acc += abs(v)
        elif mode == 1:
            acc += v * v
        else:
            acc += v * float64(y[i])
    total = block_sum(acc, shared)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(out, 0, total)

