"""Reductions: a block-wide sum, per-channel sums over (outer, dim, inner) views, and whole-array sums.

Per-channel kernels run one block per channel (grid = dim) and accumulate in float64.
"""
from __future__ import annotations

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK

PAIR_SCRATCH = 2 * BLOCK  # float64 entries of block_sum2's shared scratch (a shared array's size must be a constant)


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
def block_sum2(a, b, shared):
    """(sum of a, sum of b) over the block's BLOCK threads, to every thread: two sums in one tree, so half
    the barriers of two block_sum calls. `shared` holds PAIR_SCRATCH float64."""
    tid = cuda.threadIdx.x
    shared[tid] = a
    shared[BLOCK + tid] = b
    cuda.syncthreads()
    step = BLOCK // 2
    while step > 0:
        if tid < step:
            shared[tid] += shared[tid + step]
            shared[BLOCK + tid] += shared[BLOCK + tid + step]
        cuda.syncthreads()
        step //= 2
    ta = shared[0]
    tb = shared[BLOCK]
    cuda.syncthreads()
    return ta, tb


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



# -- per-channel reductions spread over the whole GPU --------------------------------------------------
# channel_sum / channel_dot above run one block per channel: 64 channels leave most of a 132-SM GPU idle
# while each block walks a million elements. The kernels below split every channel's (outer, inner) range
# into chunks of whole planes, one block per (channel, chunk), and add the block's float64 partial sums
# into `sums` (2 * dim entries, zeroed first) with atomics; a small kernel then finishes per channel.
# Modes: 0 sum x and x*x; 1 sum x; 2 sum x*y; 3 (BatchNorm backward, y = dy) sum dy and dy*x_hat.

@cuda.jit(device=True, inline=True)
def _partial_add(x, y, i, mode, mu, s, acc0, acc1):
    """Element i's share of channel_partials' two float64 sums under `mode` (y is read only by modes 2, 3)."""
    v = float64(x[i])
    if mode == 0:
        return acc0 + v, acc1 + v * v
    if mode == 1:
        return acc0 + v, acc1
    if mode == 2:
        return acc0 + v * float64(y[i]), acc1
    g = float64(y[i])
    return acc0 + g, acc1 + g * ((v - mu) * s)


@cuda.jit
def channel_partials(x, y, mean, inv, sums, outer, dim, inner, chunk, mode):
    shared = cuda.shared.array(BLOCK, float64)
    nchunks = (outer + chunk - 1) // chunk
    c = cuda.blockIdx.x // nchunks
    n0 = (cuda.blockIdx.x - c * nchunks) * chunk
    n1 = min(n0 + chunk, outer)
    tid = cuda.threadIdx.x
    mu = 0.0
    s = 0.0
    if mode == 3:
        mu = float64(mean[c])
        s = float64(inv[c])
    acc0 = 0.0
    acc1 = 0.0
    if inner >= BLOCK:
        for n in range(n0, n1):
            base = (n * dim + c) * inner
            for i in range(base + tid, base + inner, BLOCK):
                acc0, acc1 = _partial_add(x, y, i, mode, mu, s, acc0, acc1)
    else:
        for j in range(tid, (n1 - n0) * inner, BLOCK):
            q = j // inner
            acc0, acc1 = _partial_add(x, y, ((n0 + q) * dim + c) * inner + j - q * inner, mode, mu, s, acc0, acc1)
    t0 = block_sum(acc0, shared)
    if mode == 0 or mode == 3:
        t1 = block_sum(acc1, shared)
    else:
        t1 = 0.0
    if tid == 0:
        cuda.atomic.add(sums, c, t0)
        if mode == 0 or mode == 3:
            cuda.atomic.add(sums, dim + c, t1)


@cuda.jit
def channel_finish(sums, out, accumulate):
    """out[c] (+)= sums[c]."""
    for c in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[c] = sums[c] + out[c] if accumulate else sums[c]


def chunking(outer: int, dim: int, inner: int = 1, min_elements: int = 0) -> tuple[int, int]:
    """(planes per block, blocks): enough blocks to fill the GPU, whole planes per block, and at least
    `min_elements` elements per block where the planes allow (a block's sum and atomics cost the same
    whatever it covers: on small planes, thousands of blocks with one or two elements per thread spend
    their time reducing)."""
    want = max(1, min(outer, -(-4096 // max(dim, 1))))
    chunk = -(-outer // want)
    if min_elements:
        chunk = min(outer, max(chunk, -(-min_elements // max(inner, 1))))
    return chunk, dim * (-(-outer // chunk))
