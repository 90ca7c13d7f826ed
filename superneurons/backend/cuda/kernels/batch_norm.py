"""BatchNorm kernels over (outer, channels, inner) views: one block per channel for the statistics and the
backward (which reduces, then applies, inside the same block); per-channel vector updates; the normalization."""
from __future__ import annotations

import math

from numba import cuda, float32, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.reduce import block_sum, channel_index


@cuda.jit
def batch_stats(x, mean, var, outer, dim, inner):
    """mean[c], var[c] = mean and biased variance over outer and inner (two passes, float64)."""
    shared = cuda.shared.array(BLOCK, float64)
    c = cuda.blockIdx.x
    m = outer * inner
    acc = 0.0
    for j in range(cuda.threadIdx.x, m, BLOCK):
        acc += x[channel_index(j, c, dim, inner)]
    mu = block_sum(acc, shared) / m
    acc = 0.0
    for j in range(cuda.threadIdx.x, m, BLOCK):
        d = x[channel_index(j, c, dim, inner)] - mu
        acc += d * d
    v = block_sum(acc, shared) / m
    if cuda.threadIdx.x == 0:
        mean[c] = mu
        var[c] = v


@cuda.jit
def running_update(mean_sum, var_sum, scale_factor, mean, var, maf, var_correction):
    """Caffe's running sums: decay by maf, add this batch (variance made unbiased)."""
    for c in range(cuda.grid(1), mean_sum.size, cuda.gridsize(1)):
        mean_sum[c] = mean_sum[c] * maf + mean[c]
        var_sum[c] = var_sum[c] * maf + var_correction * var[c]
    if cuda.grid(1) == 0:
        scale_factor[0] = scale_factor[0] * maf + 1


@cuda.jit
def global_stats(mean_sum, var_sum, scale_factor, mean, var):
    """mean, var = running sums / scale_factor (0 while nothing was accumulated)."""
    f = scale_factor[0]
    inv = 0.0 if f == 0 else 1.0 / f
    for c in range(cuda.grid(1), mean.size, cuda.gridsize(1)):
        mean[c] = mean_sum[c] * inv
        var[c] = var_sum[c] * inv


@cuda.jit
def inv_std(var, eps, out):
    for c in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[c] = 1.0 / math.sqrt(var[c] + eps)


@cuda.jit
def normalize(x, mean, inv, y, dim, inner):
    """y = (x - mean[c]) * inv[c]; y may be x."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        c = (i // inner) % dim
        y[i] = (x[i] - mean[c]) * inv[c]


@cuda.jit
def backward(x, mean, inv, dy, dx, outer, dim, inner):
    """dx = inv * (dy - avg(dy) - x_hat * avg(dy * x_hat)) per channel; dx may be dy (every thread reads
    its elements for both sums before any element of the channel is written)."""
    shared = cuda.shared.array(BLOCK, float64)
    c = cuda.blockIdx.x
    m = outer * inner
    mu = mean[c]
    s = inv[c]
    acc_dy = 0.0
    acc_dyx = 0.0
    for j in range(cuda.threadIdx.x, m, BLOCK):
        k = channel_index(j, c, dim, inner)
        g = dy[k]
        acc_dy += g
        acc_dyx += g * ((x[k] - mu) * s)
    avg_dy = block_sum(acc_dy, shared) / m
    avg_dyx = block_sum(acc_dyx, shared) / m
    for j in range(cuda.threadIdx.x, m, BLOCK):
        k = channel_index(j, c, dim, inner)
        x_hat = (x[k] - mu) * s
        dx[k] = (dy[k] - avg_dy - x_hat * avg_dyx) * s


@cuda.jit
def stats_finish(sums, mean, var, m):
    """mean, biased var from the float64 sums of x and x*x over m values per channel."""
    dim = mean.size
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        mu = sums[c] / m
        mean[c] = mu
        var[c] = max(sums[dim + c] / m - mu * mu, 0.0)


@cuda.jit
def normalize_inv(x, mean, var, eps, inv, y, dim, inner):
    """y = (x - mean[c]) / sqrt(var[c] + eps), and inv[c] = that 1/sqrt (written by the first plane's threads)."""
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        c = (i // inner) % dim
        s = float32(1.0 / math.sqrt(var[c] + eps))
        if i < dim * inner and i % inner == 0:
            inv[c] = s
        y[i] = (x[i] - mean[c]) * s


@cuda.jit
def backward_apply(x, mean, inv, sums, dy, dx, dim, inner, m):
    """dx = inv * (dy - avg(dy) - x_hat * avg(dy * x_hat)), the averages from `sums`; dx may be dy."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        c = (i // inner) % dim
        s = inv[c]
        x_hat = (x[i] - mean[c]) * s
        dx[i] = (dy[i] - sums[c] / m - x_hat * (sums[dim + c] / m)) * s
