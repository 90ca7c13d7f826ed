"""Kernels of the fused BatchNorm + Scale (+ ReLU) op (see backend/cpu/fused.py for the math).

Forward: `stats_partials` (sum x, x*x per channel) -> `channel_stats` (mean, var, inv_std, running sums)
-> `forward_apply` (x_hat and y in one pass). Backward: `backward_partials` (sum dy', dy'*x_hat, with dy'
the gradient after the ReLU mask) -> `backward_apply` (dx in one pass, and the Scale's parameter gradients).

The three passes over the activation run one block per (channel, chunk of whole planes) of an
(outer, dim, inner) view, as kernels/reduce.py's channel_partials does: the per-channel constants sit in
registers, and the element walk needs no division per element (`next_position` steps a (plane, offset)
pair by BLOCK instead of dividing the flat index by `inner`). Partial sums are float64, added with atomics.
"""
from __future__ import annotations

import math

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.reduce import block_sum

# channel_stats modes
GLOBAL, BATCH, BATCH_UPDATE = 0, 1, 2


@cuda.jit(device=True, inline=True)
def block_region(outer, chunk):
    """(channel, first plane, number of planes) of this block; blocks are numbered channel-major."""
    nchunks = (outer + chunk - 1) // chunk
    c = cuda.blockIdx.x // nchunks
    n0 = (cuda.blockIdx.x - c * nchunks) * chunk
    return c, n0, min(chunk, outer - n0)


@cuda.jit(device=True, inline=True)
def first_position(inner):
    """This thread's first (plane, offset) and its step (BLOCK // inner, BLOCK % inner)."""
    tid = cuda.threadIdx.x
    return tid // inner, tid % inner, BLOCK // inner, BLOCK % inner


@cuda.jit(device=True, inline=True)
def next_position(q, r, inner, step_q, step_r):
    """(plane, offset) of the element BLOCK further on in a run of planes of `inner` elements."""
    r += step_r
    q += step_q
    if r >= inner:
        r -= inner
        q += 1
    return q, r


@cuda.jit(device=True, inline=True)
def pre_relu_grad(g, v, relu, slope):
    """The gradient through the ReLU at pre-activation v (Caffe's: dy where y > 0, else dy * slope)."""
    if relu and not v > 0:
        return g * slope
    return g


@cuda.jit
def stats_partials(x, sums, outer, dim, inner, chunk):
    """sums[c] += sum of x, sums[dim + c] += sum of x*x over this block's planes of channel c."""
    shared = cuda.shared.array(BLOCK, float64)
    c, n0, planes = block_region(outer, chunk)
    tid = cuda.threadIdx.x
    q, r, step_q, step_r = first_position(inner)
    s0 = 0.0
    s1 = 0.0
    while q < planes:
        v = float64(x[((n0 + q) * dim + c) * inner + r])
        s0 += v
        s1 += v * v
        q, r = next_position(q, r, inner, step_q, step_r)
    t0 = block_sum(s0, shared)
    t1 = block_sum(s1, shared)
    if tid == 0:
        cuda.atomic.add(sums, c, t0)
        cuda.atomic.add(sums, dim + c, t1)


@cuda.jit
def channel_stats(sums, mean_sum, var_sum, scale_factor, mean, var, inv, m, eps, maf, correction, mode):
    """Per channel: mean, biased var and inv_std = 1 / sqrt(var + eps).

    GLOBAL: from the running sums / scale_factor (0 while nothing was accumulated); BATCH: from the sums of
    x and x*x over m values; BATCH_UPDATE: also decay the running sums by maf and add the batch (variance
    times `correction`, m / (m - 1)), as Caffe's BatchNorm does.
    """
    dim = mean.size
    factor = 0.0
    if mode == GLOBAL:
        f = float64(scale_factor[0])
        factor = 0.0 if f == 0 else 1.0 / f
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        if mode == GLOBAL:
            mu = mean_sum[c] * factor
            v = var_sum[c] * factor
        else:
            mu = sums[c] / m
            v = max(sums[dim + c] / m - mu * mu, 0.0)
            if mode == BATCH_UPDATE:
                mean_sum[c] = mean_sum[c] * maf + mu
                var_sum[c] = var_sum[c] * maf + correction * v
        mean[c] = mu
        var[c] = v
        inv[c] = 1.0 / math.sqrt(var[c] + eps)  # from the stored (rounded) var, as the CPU op computes it
    if mode == BATCH_UPDATE and cuda.grid(1) == 0:
        scale_factor[0] = scale_factor[0] * maf + 1


@cuda.jit
def forward_apply(x, mean, inv, gamma, beta, x_hat, y, outer, dim, inner, chunk, keep, relu, slope):
    """x_hat = (x - mean) * inv (stored if `keep`); y = relu(gamma * x_hat + beta). y may be x."""
    c, n0, planes = block_region(outer, chunk)
    mu, s, g, b = mean[c], inv[c], gamma[c], beta[c]
    q, r, step_q, step_r = first_position(inner)
    while q < planes:
        i = ((n0 + q) * dim + c) * inner + r
        h = (x[i] - mu) * s
        if keep:
            x_hat[i] = h
        v = g * h + b
        if relu and not v > 0:
            v = v * slope
        y[i] = v
        q, r = next_position(q, r, inner, step_q, step_r)


@cuda.jit
def backward_partials(x_hat, gamma, beta, dy, sums, outer, dim, inner, chunk, relu, slope):
    """sums[c] += sum of dy', sums[dim + c] += sum of dy' * x_hat (dy' = dy through the ReLU mask)."""
    shared = cuda.shared.array(BLOCK, float64)
    c, n0, planes = block_region(outer, chunk)
    g, b = gamma[c], beta[c]
    tid = cuda.threadIdx.x
    q, r, step_q, step_r = first_position(inner)
    s0 = 0.0
    s1 = 0.0
    while q < planes:
        i = ((n0 + q) * dim + c) * inner + r
        h = x_hat[i]
        d = float64(pre_relu_grad(dy[i], g * h + b, relu, slope))
        s0 += d
        s1 += d * h
        q, r = next_position(q, r, inner, step_q, step_r)
    t0 = block_sum(s0, shared)
    t1 = block_sum(s1, shared)
    if tid == 0:
        cuda.atomic.add(sums, c, t0)
        cuda.atomic.add(sums, dim + c, t1)


@cuda.jit
def backward_apply(x_hat, inv, gamma, beta, sums, dy, dx, dgamma, dbeta, outer, dim, inner, chunk, m, batch,
                   relu, slope, param_grads):
    """dx = gamma * inv * (dy' - sum(dy')/m - x_hat * sum(dy' x_hat)/m) (batch statistics) or
    gamma * inv * dy' (global); dx may be dy. The first block of each channel also adds the Scale's
    parameter gradients (if `param_grads`): dbeta[c] += sum(dy'), dgamma[c] += sum(dy' x_hat)."""
    c, n0, planes = block_region(outer, chunk)
    g, b = gamma[c], beta[c]
    k = g * inv[c]
    avg_dy = 0.0
    avg_dyh = 0.0
    if batch:
        avg_dy = sums[c] / m
        avg_dyh = sums[dim + c] / m
    if param_grads and n0 == 0 and cuda.threadIdx.x == 0:
        dbeta[c] += sums[c]
        dgamma[c] += sums[dim + c]
    q, r, step_q, step_r = first_position(inner)
    while q < planes:
        i = ((n0 + q) * dim + c) * inner + r
        h = x_hat[i]
        d = pre_relu_grad(dy[i], g * h + b, relu, slope)
        dx[i] = k * (d - avg_dy - h * avg_dyh)
        q, r = next_position(q, r, inner, step_q, step_r)


@cuda.jit
def param_grads(sums, dgamma, dbeta):
    """dbeta += sums[:dim], dgamma += sums[dim:] (backward without a bottom gradient)."""
    dim = dgamma.size
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        dbeta[c] += sums[c]
        dgamma[c] += sums[dim + c]
