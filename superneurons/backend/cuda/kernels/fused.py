"""Kernels of the fused BatchNorm + Scale (+ ReLU) op (see backend/cpu/fused.py for the math).

Forward: `stats_partials` (sum x, x*x per channel) -> `channel_stats` (mean, var, inv_std, running sums)
-> `forward_apply` (y, and x_hat if the layer keeps it, in one pass). Backward: `backward_partials` (sum dy',
dy'*x_hat, with dy' the gradient after the ReLU mask) -> `backward_apply` (dx in one pass, and the Scale's
parameter gradients); backward reads the kept x_hat, or the kept x and normalizes it again (`normalized`).

The three passes over the activation run one block per (channel, chunk of whole planes) of an
(outer, dim, inner) view, as kernels/reduce.py's channel_partials does: the per-channel constants sit in
registers, and the element walk needs no division per element (`next_position` steps a (plane, offset,
flat index) triple by BLOCK with additions instead of dividing the flat index by `inner`).

Each thread handles four elements per loop trip (`four_positions`: positions BLOCK apart, loads issued
before any is used), so four loads per thread are in flight: with one, these passes ran at ~40% of the
memory bandwidth (a thread's single outstanding load cannot cover the memory latency at the occupancy these
register-heavy kernels get). Positions past the block's planes load the first (always valid) element and
are masked out, so the loads need no branches. Partial sums are float64, added with atomics (two per block).

Long planes (SUPERNEURONS_BN_ROWS_MIN, 1024 elements by default: ResNet's 56x56 and 112x112 stages)
take the `*_rows` kernels instead: the block sweeps each of its planes with one flat index per thread stepping by BLOCK (four
loads per trip, then a tail), one 64-bit add per element, where the (plane, offset, index) walk above
spends about ten integer operations per element on 64-bit index arithmetic.
"""
from __future__ import annotations

import math

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.reduce import PAIR_SCRATCH, block_sum2

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
def walk_start(n0, c, dim, inner):
    """This thread's first position (plane, offset, flat index) in its block's run of planes of channel c,
    and the constants `next_position` steps by: BLOCK elements on is step_q planes and step_r offsets
    further, i.e. `jump` flat elements, plus `wrap` more when the offset wraps into the next plane."""
    tid = cuda.threadIdx.x
    q = tid // inner
    r = tid - q * inner
    step_q = BLOCK // inner
    step_r = BLOCK - step_q * inner
    stride = dim * inner  # from one plane of channel c to the next
    return q, r, ((n0 + q) * dim + c) * inner + r, step_q, step_r, step_q * stride + step_r, stride - inner


@cuda.jit(device=True, inline=True)
def next_position(q, r, p, inner, step_q, step_r, jump, wrap):
    """The position BLOCK elements further on (step_r < inner, so at most one wrap)."""
    r += step_r
    q += step_q
    p += jump
    if r >= inner:
        r -= inner
        q += 1
        p += wrap
    return q, r, p


@cuda.jit(device=True, inline=True)
def four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap):
    """From the valid position (q, r, p): the flat indices of it and the three positions BLOCK, 2 BLOCK and
    3 BLOCK on (those past `planes` replaced by p, so every index may be read), how many of the four are
    valid, and the position 4 BLOCK on."""
    q1, r1, p1 = next_position(q, r, p, inner, step_q, step_r, jump, wrap)
    q2, r2, p2 = next_position(q1, r1, p1, inner, step_q, step_r, jump, wrap)
    q3, r3, p3 = next_position(q2, r2, p2, inner, step_q, step_r, jump, wrap)
    qn, rn, pn = next_position(q3, r3, p3, inner, step_q, step_r, jump, wrap)
    valid = 1 + (q1 < planes) + (q2 < planes) + (q3 < planes)
    return (p, p1 if q1 < planes else p, p2 if q2 < planes else p, p3 if q3 < planes else p, valid,
            qn, rn, pn)


@cuda.jit(device=True, inline=True)
def normalized(v, mu, s, from_x):
    """x_hat from what forward kept for backward: x_hat itself, or x (`from_x`), normalized with the same
    float32 arithmetic as normalize_store, so both give the same bits."""
    if from_x:
        return (v - mu) * s
    return v


@cuda.jit(device=True, inline=True)
def pre_relu_grad(g, v, relu, slope):
    """The gradient through the ReLU at pre-activation v (Caffe's: dy where y > 0, else dy * slope)."""
    if relu and not v > 0:
        return g * slope
    return g


@cuda.jit(device=True, inline=True)
def add_channel_sums(s0, s1, shared, sums, c, dim):
    """sums[c] += the block's total of s0, sums[dim + c] += its total of s1 (one atomic each per block)."""
    t0, t1 = block_sum2(s0, s1, shared)
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(sums, c, t0)
        cuda.atomic.add(sums, dim + c, t1)


@cuda.jit(device=True, inline=True)
def stats_walk(x, q, r, p, planes, inner, step_q, step_r, jump, wrap):
    """This thread's (sum of x, sum of x*x) over its positions from (q, r, p) in the block's planes."""
    s0 = 0.0
    s1 = 0.0
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        v0 = float64(x[i0])
        v1 = float64(x[i1]) if valid > 1 else 0.0
        v2 = float64(x[i2]) if valid > 2 else 0.0
        v3 = float64(x[i3]) if valid > 3 else 0.0
        s0 += (v0 + v1) + (v2 + v3)
        s1 += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)
    return s0, s1


@cuda.jit
def stats_partials(x, sums, outer, dim, inner, chunk):
    """sums[c] += sum of x, sums[dim + c] += sum of x*x over this block's planes of channel c."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c, n0, planes = block_region(outer, chunk)
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    s0, s1 = stats_walk(x, q, r, p, planes, inner, step_q, step_r, jump, wrap)
    add_channel_sums(s0, s1, shared, sums, c, dim)


@cuda.jit
def channel_stats(sums, mean_sum, var_sum, scale_factor, mean, var, inv, m, eps, maf, correction, mode):
    """Per channel: mean, biased var and inv_std = 1 / sqrt(var + eps).

    GLOBAL: from the running sums / scale_factor (0 while nothing was accumulated); BATCH: from the sums of
    x and x*x over m values; BATCH_UPDATE: also decay the running sums by maf and add the batch (variance
    times `correction`, m / (m - 1)), as Caffe's BatchNorm does.
    """
    dim = mean.size
    factor = global_factor(scale_factor, mode)
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        sum_x = 0.0
        sum_xx = 0.0
        if mode != GLOBAL:  # under GLOBAL statistics `sums` is any array (the op passes mean_sum)
            sum_x = sums[c]
            sum_xx = sums[dim + c]
        store_channel_stats(c, sum_x, sum_xx, factor, mean_sum, var_sum, mean, var, inv, m, eps, maf, correction,
                            mode)
    if mode == BATCH_UPDATE and cuda.grid(1) == 0:
        scale_factor[0] = scale_factor[0] * maf + 1


@cuda.jit(device=True, inline=True)
def global_factor(scale_factor, mode):
    """1 / scale_factor under GLOBAL statistics (0 while nothing was accumulated); unused otherwise."""
    if mode != GLOBAL:
        return 0.0
    f = float64(scale_factor[0])
    return 0.0 if f == 0 else 1.0 / f


@cuda.jit(device=True, inline=True)
def store_channel_stats(c, sum_x, sum_xx, factor, mean_sum, var_sum, mean, var, inv, m, eps, maf, correction,
                        mode):
    """channel_stats for channel c, given its sums of x and x*x (unused under GLOBAL statistics)."""
    if mode == GLOBAL:
        mu = mean_sum[c] * factor
        v = var_sum[c] * factor
    else:
        mu = sum_x / m
        v = max(sum_xx / m - mu * mu, 0.0)
        if mode == BATCH_UPDATE:
            mean_sum[c] = mean_sum[c] * maf + mu
            var_sum[c] = var_sum[c] * maf + correction * v
    mean[c] = mu
    var[c] = v
    inv[c] = 1.0 / math.sqrt(var[c] + eps)  # from the stored (rounded) var, as the CPU op computes it


@cuda.jit(device=True, inline=True)
def normalize_store(v, i, mu, s, g, b, x_hat, y, keep, relu, slope):
    """x_hat[i] = (v - mu) * s (if keep); y[i] = relu(g * x_hat + b)."""
    h = (v - mu) * s
    if keep:
        x_hat[i] = h
    out = g * h + b
    if relu and not out > 0:
        out = out * slope
    y[i] = out


@cuda.jit
def forward_apply(x, mean, inv, gamma, beta, x_hat, y, outer, dim, inner, chunk, keep, relu, slope):
    """x_hat = (x - mean) * inv (stored if `keep`); y = relu(gamma * x_hat + beta). y may be x."""
    c, n0, planes = block_region(outer, chunk)
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    apply_walk(x, mean[c], inv[c], gamma[c], beta[c], x_hat, y, keep, relu, slope, q, r, p, planes, inner, step_q,
               step_r, jump, wrap)


@cuda.jit(device=True, inline=True)
def apply_walk(x, mu, s, g, b, x_hat, y, keep, relu, slope, q, r, p, planes, inner, step_q, step_r, jump, wrap):
    """normalize_store over this thread's positions from (q, r, p) in the block's planes."""
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        # all four loaded before any store: y may be x, and masked positions read element i0
        v0, v1, v2, v3 = x[i0], x[i1], x[i2], x[i3]
        normalize_store(v0, i0, mu, s, g, b, x_hat, y, keep, relu, slope)
        if valid > 1:
            normalize_store(v1, i1, mu, s, g, b, x_hat, y, keep, relu, slope)
        if valid > 2:
            normalize_store(v2, i2, mu, s, g, b, x_hat, y, keep, relu, slope)
        if valid > 3:
            normalize_store(v3, i3, mu, s, g, b, x_hat, y, keep, relu, slope)


@cuda.jit
def backward_partials(kept, mean, inv, from_x, gamma, beta, dy, sums, outer, dim, inner, chunk, relu, slope):
    """sums[c] += sum of dy', sums[dim + c] += sum of dy' * x_hat (dy' = dy through the ReLU mask); x_hat is
    `kept`, or normalized from it (`from_x`)."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c, n0, planes = block_region(outer, chunk)
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    s0, s1 = grad_sums_walk(kept, mean[c], inv[c], from_x, gamma[c], beta[c], dy, relu, slope, q, r, p, planes,
                            inner, step_q, step_r, jump, wrap)
    add_channel_sums(s0, s1, shared, sums, c, dim)


@cuda.jit(device=True, inline=True)
def grad_sums_walk(kept, mu, s, from_x, g, b, dy, relu, slope, q, r, p, planes, inner, step_q, step_r, jump, wrap):
    """This thread's (sum of dy', sum of dy' * x_hat) over its positions from (q, r, p) in the block's planes."""
    s0 = 0.0
    s1 = 0.0
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        h0, h1 = normalized(kept[i0], mu, s, from_x), normalized(kept[i1], mu, s, from_x)
        h2, h3 = normalized(kept[i2], mu, s, from_x), normalized(kept[i3], mu, s, from_x)
        g0, g1, g2, g3 = dy[i0], dy[i1], dy[i2], dy[i3]
        d0 = float64(pre_relu_grad(g0, g * h0 + b, relu, slope))
        d1 = float64(pre_relu_grad(g1, g * h1 + b, relu, slope)) if valid > 1 else 0.0
        d2 = float64(pre_relu_grad(g2, g * h2 + b, relu, slope)) if valid > 2 else 0.0
        d3 = float64(pre_relu_grad(g3, g * h3 + b, relu, slope)) if valid > 3 else 0.0
        s0 += (d0 + d1) + (d2 + d3)
        s1 += (d0 * h0 + d1 * h1) + (d2 * h2 + d3 * h3)
    return s0, s1


@cuda.jit(device=True, inline=True)
def input_grad(h, gy, g, b, k, avg_dy, avg_dyh, relu, slope):
    return k * (pre_relu_grad(gy, g * h + b, relu, slope) - avg_dy - h * avg_dyh)


@cuda.jit(device=True, inline=True)
def apply_constants(c, n0, inv, gamma, beta, sum_dy, sum_dyh, dgamma, dbeta, m, batch, param_grads):
    """Channel c's constants for the dx pass: gamma, beta, gamma * inv_std and the means of its backward
    sums (0 under global statistics); the channel's first block also adds the Scale's parameter
    gradients (if `param_grads`)."""
    g, b = gamma[c], beta[c]
    avg_dy = 0.0
    avg_dyh = 0.0
    if batch:
        avg_dy = sum_dy / m
        avg_dyh = sum_dyh / m
    if param_grads and n0 == 0 and cuda.threadIdx.x == 0:
        dbeta[c] += sum_dy
        dgamma[c] += sum_dyh
    return g, b, g * inv[c], avg_dy, avg_dyh


@cuda.jit
def backward_apply(kept, mean, inv, from_x, gamma, beta, sums, dy, dx, dgamma, dbeta, outer, dim, inner, chunk, m,
                   batch, relu, slope, param_grads):
    """dx = gamma * inv * (dy' - sum(dy')/m - x_hat * sum(dy' x_hat)/m) (batch statistics) or
    gamma * inv * dy' (global); dx may be dy. The first block of each channel also adds the Scale's
    parameter gradients (if `param_grads`): dbeta[c] += sum(dy'), dgamma[c] += sum(dy' x_hat)."""
    c, n0, planes = block_region(outer, chunk)
    g, b, k, avg_dy, avg_dyh = apply_constants(c, n0, inv, gamma, beta, sums[c], sums[dim + c], dgamma, dbeta, m,
                                               batch, param_grads)
    q, r, p, step_q, step_r, jump, wrap = walk_start(n0, c, dim, inner)
    grad_apply_walk(kept, mean[c], inv[c], from_x, dy, dx, g, b, k, avg_dy, avg_dyh, relu, slope, q, r, p, planes,
                    inner, step_q, step_r, jump, wrap)


@cuda.jit(device=True, inline=True)
def grad_apply_walk(kept, mu, s, from_x, dy, dx, g, b, k, avg_dy, avg_dyh, relu, slope, q, r, p, planes, inner,
                    step_q, step_r, jump, wrap):
    """dx = input_grad(...) over this thread's positions from (q, r, p) in the block's planes."""
    while q < planes:
        i0, i1, i2, i3, valid, q, r, p = four_positions(q, r, p, planes, inner, step_q, step_r, jump, wrap)
        # all four loaded before any store: dx may be dy, and masked positions read element i0
        h0, h1 = normalized(kept[i0], mu, s, from_x), normalized(kept[i1], mu, s, from_x)
        h2, h3 = normalized(kept[i2], mu, s, from_x), normalized(kept[i3], mu, s, from_x)
        g0, g1, g2, g3 = dy[i0], dy[i1], dy[i2], dy[i3]
        dx[i0] = input_grad(h0, g0, g, b, k, avg_dy, avg_dyh, relu, slope)
        if valid > 1:
            dx[i1] = input_grad(h1, g1, g, b, k, avg_dy, avg_dyh, relu, slope)
        if valid > 2:
            dx[i2] = input_grad(h2, g2, g, b, k, avg_dy, avg_dyh, relu, slope)
        if valid > 3:
            dx[i3] = input_grad(h3, g3, g, b, k, avg_dy, avg_dyh, relu, slope)


@cuda.jit
def param_grads(sums, dgamma, dbeta):
    """dbeta += sums[:dim], dgamma += sums[dim:] (backward without a bottom gradient)."""
    dim = dgamma.size
    for c in range(cuda.grid(1), dim, cuda.gridsize(1)):
        dbeta[c] += sums[c]
        dgamma[c] += sums[dim + c]


# ---- long planes (SUPERNEURONS_BN_ROWS_MIN and more): a plain sweep of each plane ------------------
@cuda.jit(device=True, inline=True)
def plane_start(n, c, dim, inner):
    """Flat index of this thread's first element of plane n of channel c, and one past the plane's end."""
    base = (n * dim + c) * inner
    return base + cuda.threadIdx.x, base + inner


@cuda.jit
def stats_partials_rows(x, sums, outer, dim, inner, chunk):
    """stats_partials for planes swept plainly (SUPERNEURONS_BN_ROWS_MIN elements or more)."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c, n0, planes = block_region(outer, chunk)
    s0 = 0.0
    s1 = 0.0
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            v0, v1, v2, v3 = float64(x[i]), float64(x[i + BLOCK]), float64(x[i + 2 * BLOCK]), float64(x[i + 3 * BLOCK])
            s0 += (v0 + v1) + (v2 + v3)
            s1 += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)
            i += 4 * BLOCK
        while i < end:
            v0 = float64(x[i])
            s0 += v0
            s1 += v0 * v0
            i += BLOCK
    add_channel_sums(s0, s1, shared, sums, c, dim)


@cuda.jit
def forward_apply_rows(x, mean, inv, gamma, beta, x_hat, y, outer, dim, inner, chunk, keep, relu, slope):
    """forward_apply for planes swept plainly (SUPERNEURONS_BN_ROWS_MIN elements or more)."""
    c, n0, planes = block_region(outer, chunk)
    mu, s, g, b = mean[c], inv[c], gamma[c], beta[c]
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            v0, v1, v2, v3 = x[i], x[i + BLOCK], x[i + 2 * BLOCK], x[i + 3 * BLOCK]  # all read before y (may be x)
            normalize_store(v0, i, mu, s, g, b, x_hat, y, keep, relu, slope)
            normalize_store(v1, i + BLOCK, mu, s, g, b, x_hat, y, keep, relu, slope)
            normalize_store(v2, i + 2 * BLOCK, mu, s, g, b, x_hat, y, keep, relu, slope)
            normalize_store(v3, i + 3 * BLOCK, mu, s, g, b, x_hat, y, keep, relu, slope)
            i += 4 * BLOCK
        while i < end:
            normalize_store(x[i], i, mu, s, g, b, x_hat, y, keep, relu, slope)
            i += BLOCK


@cuda.jit
def backward_partials_rows(kept, mean, inv, from_x, gamma, beta, dy, sums, outer, dim, inner, chunk, relu, slope):
    """backward_partials for planes swept plainly (SUPERNEURONS_BN_ROWS_MIN elements or more)."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c, n0, planes = block_region(outer, chunk)
    g, b, mu, s = gamma[c], beta[c], mean[c], inv[c]
    s0 = 0.0
    s1 = 0.0
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            h0, h1 = normalized(kept[i], mu, s, from_x), normalized(kept[i + BLOCK], mu, s, from_x)
            h2, h3 = normalized(kept[i + 2 * BLOCK], mu, s, from_x), normalized(kept[i + 3 * BLOCK], mu, s, from_x)
            g0, g1, g2, g3 = dy[i], dy[i + BLOCK], dy[i + 2 * BLOCK], dy[i + 3 * BLOCK]
            d0 = float64(pre_relu_grad(g0, g * h0 + b, relu, slope))
            d1 = float64(pre_relu_grad(g1, g * h1 + b, relu, slope))
            d2 = float64(pre_relu_grad(g2, g * h2 + b, relu, slope))
            d3 = float64(pre_relu_grad(g3, g * h3 + b, relu, slope))
            s0 += (d0 + d1) + (d2 + d3)
            s1 += (d0 * h0 + d1 * h1) + (d2 * h2 + d3 * h3)
            i += 4 * BLOCK
        while i < end:
            h0 = normalized(kept[i], mu, s, from_x)
            d0 = float64(pre_relu_grad(dy[i], g * h0 + b, relu, slope))
            s0 += d0
            s1 += d0 * h0
            i += BLOCK
    add_channel_sums(s0, s1, shared, sums, c, dim)


@cuda.jit
def backward_apply_rows(kept, mean, inv, from_x, gamma, beta, sums, dy, dx, dgamma, dbeta, outer, dim, inner, chunk,
                        m, batch, relu, slope, param_grads):
    """backward_apply for planes swept plainly (SUPERNEURONS_BN_ROWS_MIN elements or more)."""
    c, n0, planes = block_region(outer, chunk)
    g, b, k, avg_dy, avg_dyh = apply_constants(c, n0, inv, gamma, beta, sums[c], sums[dim + c], dgamma, dbeta, m,
                                               batch, param_grads)
    mu, s = mean[c], inv[c]
    for n in range(n0, n0 + planes):
        i, end = plane_start(n, c, dim, inner)
        while i + 3 * BLOCK < end:
            h0, h1 = normalized(kept[i], mu, s, from_x), normalized(kept[i + BLOCK], mu, s, from_x)
            h2, h3 = normalized(kept[i + 2 * BLOCK], mu, s, from_x), normalized(kept[i + 3 * BLOCK], mu, s, from_x)
            g0, g1, g2, g3 = dy[i], dy[i + BLOCK], dy[i + 2 * BLOCK], dy[i + 3 * BLOCK]  # all read before dx (may be dy)
            dx[i] = input_grad(h0, g0, g, b, k, avg_dy, avg_dyh, relu, slope)
            dx[i + BLOCK] = input_grad(h1, g1, g, b, k, avg_dy, avg_dyh, relu, slope)
            dx[i + 2 * BLOCK] = input_grad(h2, g2, g, b, k, avg_dy, avg_dyh, relu, slope)
            dx[i + 3 * BLOCK] = input_grad(h3, g3, g, b, k, avg_dy, avg_dyh, relu, slope)
            i += 4 * BLOCK
        while i < end:
            dx[i] = input_grad(normalized(kept[i], mu, s, from_x), dy[i], g, b, k, avg_dy, avg_dyh, relu, slope)
            i += BLOCK


# ---- one block per channel (SUPERNEURONS_BN_CHANNEL_MIN channels or more, short planes) ------------
# Forward and backward each in one launch: the block sums its channel, reduces within itself, and runs the
# apply pass over the same elements, which its first pass has just brought into L2. The multi-block path
# needs four launches forward (zero the sums, partial sums, channel_stats, apply) and three backward, and
# its float64 atomics; on ResNet's 14x14 and 7x7 layers (a few MB each) those launches, not the bytes,
# were the time (tools/bench/bn_kernels.py).
@cuda.jit
def forward_channel(x, mean_sum, var_sum, scale_factor, mean, var, inv, gamma, beta, x_hat, y, outer, dim, inner,
                    m, eps, maf, correction, mode, keep, relu, slope):
    """stats_partials + channel_stats + forward_apply for channel blockIdx.x. y may be x."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c = cuda.blockIdx.x
    q, r, p, step_q, step_r, jump, wrap = walk_start(0, c, dim, inner)
    t0 = 0.0
    t1 = 0.0
    if mode != GLOBAL:  # the same for every thread: all of them reach block_sum2's barriers
        s0, s1 = stats_walk(x, q, r, p, outer, inner, step_q, step_r, jump, wrap)
        t0, t1 = block_sum2(s0, s1, shared)
    if cuda.threadIdx.x == 0:
        store_channel_stats(c, t0, t1, global_factor(scale_factor, mode), mean_sum, var_sum, mean, var, inv, m,
                            eps, maf, correction, mode)
        if mode == BATCH_UPDATE and c == 0:
            scale_factor[0] = scale_factor[0] * maf + 1
    cuda.syncthreads()  # mean[c], inv[c] stored: read back as float32, as forward_apply reads them
    apply_walk(x, mean[c], inv[c], gamma[c], beta[c], x_hat, y, keep, relu, slope, q, r, p, outer, inner, step_q,
               step_r, jump, wrap)


@cuda.jit
def backward_channel(kept, mean, inv, from_x, gamma, beta, dy, dx, dgamma, dbeta, outer, dim, inner, m, batch, relu,
                     slope, param_grads):
    """backward_partials + backward_apply for channel blockIdx.x. dx may be dy."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c = cuda.blockIdx.x
    mu, s = mean[c], inv[c]
    q, r, p, step_q, step_r, jump, wrap = walk_start(0, c, dim, inner)
    s0, s1 = grad_sums_walk(kept, mu, s, from_x, gamma[c], beta[c], dy, relu, slope, q, r, p, outer, inner, step_q,
                            step_r, jump, wrap)
    t0, t1 = block_sum2(s0, s1, shared)
    g, b, k, avg_dy, avg_dyh = apply_constants(c, 0, inv, gamma, beta, t0, t1, dgamma, dbeta, m, batch, param_grads)
    grad_apply_walk(kept, mu, s, from_x, dy, dx, g, b, k, avg_dy, avg_dyh, relu, slope, q, r, p, outer, inner, step_q,
                    step_r, jump, wrap)
