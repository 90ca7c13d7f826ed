"""Kernels for 4-D tensors stored channels last (NHWC; graph/layout.py): the layout conversion, pooling, and the
per-channel sums and passes of bias, Scale and the fused BatchNorm.

An NHWC tensor is (rows, channels) in memory, rows = N*H*W: channel c of row r is element r * C + c. Per-channel
elementwise passes need no kernel of their own (the NCHW kernels over an (outer, dim, inner) view take
(rows, C, 1)), but the passes here run without a division per element; per-channel sums do, since the NCHW
kernels walk one channel's plane per block, which in NHWC would read one element per row. Here consecutive
threads take consecutive channels of a row (loads coalesce) and sum in float64: `channel_sums` a block per
(channel tile, group of rows), its partial sums added in shared memory before one atomic per channel;
`bn_backward_sums` a thread per (channel, run of rows), one atomic per thread. Pooling runs a block per image
row, its threads over the row's elements, the channel fastest, so a warp's window loads are contiguous; its max
mask holds the same plane index (row * W + column) as the NCHW kernels' (kernels/pooling.py), so a mask means
the same in either layout.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64

from superneurons.backend.cuda.kernels import BLOCK, MAX_BLOCKS, UNROLL
from superneurons.backend.cuda.kernels.elementwise import leaky
from superneurons.backend.cuda.kernels.fused import input_grad, normalize_store, normalized, pre_relu_grad
from superneurons.backend.cuda.kernels.reduce import PAIR_SCRATCH
from superneurons.backend.cuda.kernels.pooling import _chosen, _mask_entry, _out_range, _rows_holding, _through_relu

FLT_MIN32 = np.float32(1.1754943508222875e-38)


@cuda.jit(device=True, inline=True)
def _source(i, c, hw, src_nhwc, dst_nhwc):
    """The index in the source of element i of the destination (N, C, H*W planes, each side's layout)."""
    if dst_nhwc:
        ch = i % c
        rest = i // c
        p = rest % hw
        n = rest // hw
    else:
        p = i % hw
        rest = i // hw
        ch = rest % c
        n = rest // c
    if src_nhwc:
        return (n * hw + p) * c + ch
    return (n * c + ch) * hw + p


@cuda.jit
def convert(src, dst, c, hw, src_nhwc, dst_nhwc):
    """dst = src, each an (N, C, H, W) tensor in its own layout (same element type: half types as uint16)."""
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[_source(i, c, hw, src_nhwc, dst_nhwc)]


@cuda.jit
def convert_cast(alpha, src, dst, c, hw, src_nhwc, dst_nhwc):
    """dst = alpha * src across layouts and element types (alpha 1: a cast, as elementwise.scale_copy)."""
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = alpha * src[_source(i, c, hw, src_nhwc, dst_nhwc)]


@cuda.jit
def convert_axpy(alpha, src, dst, c, hw, src_nhwc, dst_nhwc):
    """dst += alpha * src across layouts."""
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] += alpha * src[_source(i, c, hw, src_nhwc, dst_nhwc)]


# ---- per-channel sums over (rows, dim), tiled: a block per (tile of LANES channels, group of rows) --------------
SUM, SUM_SQUARES, DOT = 0, 1, 2  # sums[c] (and sums[dim + c]) of x / x and x*x / x*y
# Thread (ry, lane) of a block sums channel tile * LANES + lane over rows ry, ry + step, ... of its group's share
# (step = ROW_LANES * groups), four rows per trip with their loads issued first; the block then adds its
# ROW_LANES partial sums per channel in shared memory, and one thread per channel adds the total into the float64
# sums with one atomic per sum. A warp reads LANES consecutive channels of one row (coalesced). Against a thread
# per (channel, run of rows) with one load in flight and an atomic per thread, this took ResNet-50's bfloat16
# forward statistics from 2.6 to 1.05 ms per iteration on an H200.
# Between layouts, a batch of matrices transposed through shared memory: NCHW to NHWC takes each image's
# (C, H*W) matrix to (H*W, C), the reverse (H*W, C) to (C, H*W). A block moves a TILE x TILE tile, reading rows
# of the source and writing rows of the destination, both coalesced, and works out its tile's place once; the
# element kernels above index each element through three 64-bit divisions and read (or write) one side with a
# stride of a plane, which made ResNet-50's float32 filter and batch conversions 0.75 ms of an H200 iteration.
TILE = 32
TILE_ROWS = BLOCK // TILE  # the rows of a tile a block moves at once
TILE_SHAPE = (TILE, TILE + 1)  # + 1: a tile column's reads hit 32 different banks (a module constant: numba
# sizes shared arrays at compile time)
COPY, SCALE, AXPY = 0, 1, 2  # dst = src; dst = alpha * src; dst += alpha * src


def transpose_blocks(n: int, rows: int, cols: int) -> int:
    """The grid of `transpose`: a block per tile, at most MAX_BLOCKS (then each takes several)."""
    return max(1, min(n * -(-rows // TILE) * -(-cols // TILE), MAX_BLOCKS))


@cuda.jit
def transpose(alpha, src, dst, n, rows, cols, mode):
    """dst's n matrices (cols x rows) = src's (rows x cols) transposed, as `mode` says (COPY, SCALE, AXPY); the
    values pass through float32, exact for the float types and for the uint16 bits of half ones."""
    tile = cuda.shared.array(TILE_SHAPE, float32)
    tx = cuda.threadIdx.x % TILE
    ty = cuda.threadIdx.x // TILE
    row_tiles = (rows + TILE - 1) // TILE
    col_tiles = (cols + TILE - 1) // TILE
    per = row_tiles * col_tiles
    for b in range(cuda.blockIdx.x, n * per, cuda.gridDim.x):
        m = b // per
        rest = b - m * per
        r0 = (rest // col_tiles) * TILE
        c0 = (rest - (rest // col_tiles) * col_tiles) * TILE
        base = m * rows * cols
        for k in range(ty, TILE, TILE_ROWS):
            if r0 + k < rows and c0 + tx < cols:
                tile[k, tx] = src[base + (r0 + k) * cols + c0 + tx]
        cuda.syncthreads()
        for k in range(ty, TILE, TILE_ROWS):
            if c0 + k < cols and r0 + tx < rows:
                i = base + (c0 + k) * rows + r0 + tx
                v = tile[tx, k]
                if mode == COPY:
                    dst[i] = v
                elif mode == SCALE:
                    dst[i] = alpha * v
                else:
                    dst[i] += alpha * v
        cuda.syncthreads()  # the tile is rewritten by the block's next one


LANES = 32
ROW_LANES = BLOCK // LANES
TILE_RUN = 32  # rows a thread sums, about (the grid: groups = rows / (ROW_LANES * TILE_RUN))


def tiled_blocks(rows: int, dim: int) -> int:
    """The tiled sums' grid: (channel tiles) x (row groups), tiles the fastest."""
    tiles = -(-dim // LANES)
    return tiles * max(1, min(-(-rows // (ROW_LANES * TILE_RUN)), MAX_BLOCKS * 4 // tiles))


@cuda.jit(device=True, inline=True)
def tile_lane(dim):
    """(channel, first row, row step) of this thread in the tiled sums' grid."""
    tiles = (dim + LANES - 1) // LANES
    g = cuda.blockIdx.x // tiles
    ry = cuda.threadIdx.x // LANES
    c = (cuda.blockIdx.x - g * tiles) * LANES + cuda.threadIdx.x - ry * LANES
    return c, g * ROW_LANES + ry, (cuda.gridDim.x // tiles) * ROW_LANES


@cuda.jit(device=True, inline=True)
def tile_total(s0, s1, shared, sums, c, dim, second):
    """sums[c] += the block's total of s0 for channel c (and sums[dim + c] of s1 if `second`)."""
    t = cuda.threadIdx.x
    shared[t] = s0
    shared[BLOCK + t] = s1
    cuda.syncthreads()
    if t < LANES and c < dim:
        a = float64(0.0)
        b = float64(0.0)
        for k in range(ROW_LANES):
            a += shared[k * LANES + t]
            b += shared[BLOCK + k * LANES + t]
        cuda.atomic.add(sums, c, a)
        if second:
            cuda.atomic.add(sums, dim + c, b)


@cuda.jit
def channel_sums(x, y, sums, rows, dim, mode):
    """sums[c] += sum over rows of x (SUM, SUM_SQUARES) or x*y (DOT); SUM_SQUARES: sums[dim + c] += x*x. The
    grid is tiled_blocks(rows, dim)."""
    shared = cuda.shared.array(PAIR_SCRATCH, float64)
    c, r, step = tile_lane(dim)
    a0 = a1 = a2 = a3 = float64(0.0)
    q0 = q1 = q2 = q3 = float64(0.0)
    if c < dim:
        s = step * dim
        i = r * dim + c
        while r + 3 * step < rows:
            v0, v1, v2, v3 = float64(x[i]), float64(x[i + s]), float64(x[i + 2 * s]), float64(x[i + 3 * s])
            if mode == DOT:
                a0 += v0 * float64(y[i])
                a1 += v1 * float64(y[i + s])
                a2 += v2 * float64(y[i + 2 * s])
                a3 += v3 * float64(y[i + 3 * s])
            else:
                a0 += v0
                a1 += v1
                a2 += v2
                a3 += v3
                q0 += v0 * v0
                q1 += v1 * v1
                q2 += v2 * v2
                q3 += v3 * v3
            i += 4 * s
            r += 4 * step
        while r < rows:
            v = float64(x[i])
            if mode == DOT:
                a0 += v * float64(y[i])
            else:
                a0 += v
                q0 += v * v
            i += s
            r += step
    tile_total(a0 + a1 + a2 + a3, q0 + q1 + q2 + q3, shared, sums, c, dim, mode == SUM_SQUARES)


@cuda.jit
def sums_finish(sums, out, accumulate):
    """out[c] (+)= sums[c]."""
    for c in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        if accumulate:
            out[c] += sums[c]
        else:
            out[c] = sums[c]


# ---- per-channel elementwise passes over (rows, dim): no division per element ----------------------------
# A block takes BLOCK // dim rows at a time, thread t channel t % dim of row t // dim (both computed once per
# thread), so a thread keeps its channel's constants in registers and steps rows by additions; channels past
# BLOCK take several trips. The NCHW kernels' (i // inner) % dim costs two 64-bit divisions per element, which a
# bandwidth-bound pass cannot afford. Each trip loads four rows before it stores any (UNROLL): one 2-byte load in
# flight per thread left a half-precision pass waiting on memory latency (the GPU needs megabytes in flight).
# The grid stops at ROW_BLOCKS blocks, so a thread takes several trips and its channel constants serve them all:
# on ResNet-50's BatchNorm shapes (H200, both precisions) 2048 blocks beat 4096 and the 16384 of one trip each.
ROW_BLOCKS = 2048


@cuda.jit(device=True, inline=True)
def lane(dim):
    """(first row offset, channel, row step within the block's rows, whether the thread has a lane)."""
    t = cuda.threadIdx.x
    if dim > BLOCK:
        return 0, t, 1, True
    per = BLOCK // dim
    sub = t // dim
    return sub, t - sub * dim, per, sub < per


def blocks_for(rows: int, dim: int, unroll: int = UNROLL) -> int:
    """The grid of the row-block kernels: enough blocks for every row at `unroll` rows per thread, at most
    ROW_BLOCKS."""
    per = max(1, BLOCK // dim) if dim <= BLOCK else 1
    return max(1, min(-(-rows // (per * unroll)), ROW_BLOCKS))


@cuda.jit(device=True, inline=True)
def biased(v, bias, relu, slope):
    v = v + bias
    return leaky(v, slope) if relu else v


@cuda.jit
def bias_relu(y, b, rows, dim, relu, slope):
    """y = y + b[c] (relu: leaky(., slope)) in place: the conv bias and the fused Convolution + ReLU's pass."""
    sub, c0, per, active = lane(dim)
    if active:
        step = cuda.gridDim.x * per
        s = step * dim
        for c in range(c0, dim, BLOCK):
            bias = b[c]
            r = cuda.blockIdx.x * per + sub
            while r + 3 * step < rows:
                i = r * dim + c
                v0, v1, v2, v3 = y[i], y[i + s], y[i + 2 * s], y[i + 3 * s]
                y[i] = biased(v0, bias, relu, slope)
                y[i + s] = biased(v1, bias, relu, slope)
                y[i + 2 * s] = biased(v2, bias, relu, slope)
                y[i + 3 * s] = biased(v3, bias, relu, slope)
                r += 4 * step
            while r < rows:
                i = r * dim + c
                y[i] = biased(y[i], bias, relu, slope)
                r += step


# ---- the fused BatchNorm + Scale (+ ReLU) (kernels/fused.py has the math) -------------------------
@cuda.jit
def bn_forward_apply(x, mean, inv, gamma, beta, x_hat, y, rows, dim, keep, relu, slope):
    """x_hat = (x - mean) * inv (stored if `keep`); y = relu(gamma * x_hat + beta); y may be x."""
    sub, c0, per, active = lane(dim)
    if active:
        step = cuda.gridDim.x * per
        d = step * dim
        for c in range(c0, dim, BLOCK):
            mu, s, g, b = mean[c], inv[c], gamma[c], beta[c]
            r = cuda.blockIdx.x * per + sub
            while r + 3 * step < rows:  # loads first: y may be x
                i = r * dim + c
                v0, v1, v2, v3 = x[i], x[i + d], x[i + 2 * d], x[i + 3 * d]
                normalize_store(v0, i, mu, s, g, b, x_hat, y, keep, relu, slope)
                normalize_store(v1, i + d, mu, s, g, b, x_hat, y, keep, relu, slope)
                normalize_store(v2, i + 2 * d, mu, s, g, b, x_hat, y, keep, relu, slope)
                normalize_store(v3, i + 3 * d, mu, s, g, b, x_hat, y, keep, relu, slope)
                r += 4 * step
            while r < rows:
                i = r * dim + c
                normalize_store(x[i], i, mu, s, g, b, x_hat, y, keep, relu, slope)
                r += step


# (The tiled grid of channel_sums, tried here with four rows per trip, was slower in ResNet-50's bfloat16
# iteration: 2.29 ms against this kernel's 1.9 on an H200.)
@cuda.jit
def bn_backward_sums(kept, mean, inv, from_x, gamma, beta, dy, sums, rows, dim, run, relu, slope):
    """sums[c] += sum of dy', sums[dim + c] += sum of dy' * x_hat (dy' = dy through the ReLU mask)."""
    for t in range(cuda.grid(1), dim * ((rows + run - 1) // run), cuda.gridsize(1)):
        c = t % dim
        r0 = (t // dim) * run
        r1 = min(r0 + run, rows)
        mu, s, g, b = mean[c], inv[c], gamma[c], beta[c]
        s0 = 0.0
        s1 = 0.0
        i = r0 * dim + c
        for _r in range(r0, r1):
            h = normalized(kept[i], mu, s, from_x)
            d = float64(pre_relu_grad(dy[i], g * h + b, relu, slope))
            s0 += d
            s1 += d * h
            i += dim
        cuda.atomic.add(sums, c, s0)
        cuda.atomic.add(sums, dim + c, s1)


@cuda.jit
def bn_backward_apply(kept, mean, inv, from_x, gamma, beta, sums, dy, dx, rows, dim, m, batch, relu, slope):
    """dx = gamma * inv * (dy' - sum(dy')/m - x_hat * sum(dy' x_hat)/m) (batch statistics) or gamma * inv * dy'
    (global); dx may be dy."""
    sub, c0, per, active = lane(dim)
    if active:
        step = cuda.gridDim.x * per
        d = step * dim
        for c in range(c0, dim, BLOCK):
            g, b, mu, s = gamma[c], beta[c], mean[c], inv[c]
            k = g * s
            avg_dy = 0.0
            avg_dyh = 0.0
            if batch:
                avg_dy = sums[c] / m
                avg_dyh = sums[dim + c] / m
            r = cuda.blockIdx.x * per + sub
            while r + 3 * step < rows:  # loads first: dx may be dy
                i = r * dim + c
                k0, k1, k2, k3 = kept[i], kept[i + d], kept[i + 2 * d], kept[i + 3 * d]
                g0, g1, g2, g3 = dy[i], dy[i + d], dy[i + 2 * d], dy[i + 3 * d]
                dx[i] = input_grad(normalized(k0, mu, s, from_x), g0, g, b, k, avg_dy, avg_dyh, relu, slope)
                dx[i + d] = input_grad(normalized(k1, mu, s, from_x), g1, g, b, k, avg_dy, avg_dyh, relu, slope)
                dx[i + 2 * d] = input_grad(normalized(k2, mu, s, from_x), g2, g, b, k, avg_dy, avg_dyh, relu, slope)
                dx[i + 3 * d] = input_grad(normalized(k3, mu, s, from_x), g3, g, b, k, avg_dy, avg_dyh, relu, slope)
                r += 4 * step
            while r < rows:
                i = r * dim + c
                dx[i] = input_grad(normalized(kept[i], mu, s, from_x), dy[i], g, b, k, avg_dy, avg_dyh, relu, slope)
                r += step


# ---- pooling: a block per image row; its threads in (column, channel) lanes as the passes above -------------
# The window's rows are the block's (computed once per row); a thread's columns step by its lane's stride, so the
# output windows holding a column advance by comparisons (pooling._rows_holding), with no division per element.
@cuda.jit
def max_forward(x, y, mask, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, signed):
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * oh, cuda.gridDim.x):
        img = row // oh
        qh = row - img * oh
        h0 = qh * sh - ph
        r0 = max(h0, 0)
        r1 = min(h0 + kh, h)
        src = img * h * w * c
        out = row * ow * c
        for ch in range(c0, c, BLOCK):
            for qw in range(sub, ow, per):
                w0 = qw * sw - pw
                s0 = max(w0, 0)
                s1 = min(w0 + kw, w)
                best = -math.inf
                arg = -1
                for r in range(r0, r1):
                    at_row = src + r * w * c + ch
                    for s in range(s0, s1):
                        v = x[at_row + s * c]
                        if v > best:
                            best = v
                            arg = r * w + s
                o = out + qw * c + ch
                y[o] = best
                mask[o] = _mask_entry(arg, best, signed)


@cuda.jit(device=True, inline=True)
def _input_row(row, c, h, w, oh, ow, kh, sh, ph):
    """Input row `row` (image * h + r) of a pooling's backward: r, the output rows [lo, hi) whose windows hold it,
    and the flat indexes of its image's first output and of its own first element."""
    img = row // h
    r = row - img * h
    lo_h, hi_h = _out_range(r, ph, kh, sh, oh)
    return r, lo_h, hi_h, img * oh * ow * c, row * w * c


@cuda.jit
def max_backward(dy, mask, dx, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, relu, slope):
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * h, cuda.gridDim.x):
        r, lo_h, hi_h, out, at = _input_row(row, c, h, w, oh, ow, kh, sh, ph)
        for ch in range(c0, c, BLOCK):
            lo_w = 0
            hi_w = 0
            for s in range(sub, w, per):
                lo_w, hi_w = _rows_holding(s, lo_w, hi_w, ow, kw, sw, pw)
                me = r * w + s
                grad = 0.0
                positive = False
                for qh in range(lo_h, hi_h):
                    for qw in range(lo_w, hi_w):
                        o = out + (qh * ow + qw) * c + ch
                        pixel, above = _chosen(mask[o], relu)
                        if pixel == me:
                            grad += dy[o]
                            positive = above
                dx[at + s * c + ch] = _through_relu(grad, positive, relu, slope)


# Windows of at most 3x3 (ResNet's and Inception's 3x3 stride-2 poolings, padded or not): the walk above, but a
# window's nine loads are issued before any comparison, from indexes clamped into the plane (a position outside
# it is loaded from its edge and never chosen). The loop above waits for each load before the next: nine memory
# latencies per output, which made ResNet-50's pool1 about 0.65 ms of its forward on an H200 (the bytes take
# about 0.05).
@cuda.jit(device=True, inline=True)
def _take(v, inside, at, best, arg):
    """The running maximum after a candidate: strict >, so the first maximum in row order stays (as the loop)."""
    if inside and v > best:
        return v, at
    return best, arg


@cuda.jit(device=True, inline=True)
def _small_window_row(x, at_row, c, w, w0, kw, row_inside, plane_row, best, arg):
    """One window row of up to three columns from w0: loads first, then the comparisons in column order."""
    v0 = float32(x[at_row + min(max(w0, 0), w - 1) * c])
    v1 = float32(x[at_row + min(max(w0 + 1, 0), w - 1) * c])
    v2 = float32(x[at_row + min(max(w0 + 2, 0), w - 1) * c])
    best, arg = _take(v0, row_inside and 0 <= w0 < w, plane_row + w0, best, arg)
    best, arg = _take(v1, row_inside and kw > 1 and 0 <= w0 + 1 < w, plane_row + w0 + 1, best, arg)
    return _take(v2, row_inside and kw > 2 and 0 <= w0 + 2 < w, plane_row + w0 + 2, best, arg)


@cuda.jit
def max_forward_small(x, y, mask, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, signed):
    """max_forward for kh, kw <= 3."""
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * oh, cuda.gridDim.x):
        img = row // oh
        h0 = (row - img * oh) * sh - ph
        src = img * h * w * c
        out = row * ow * c
        at0 = src + min(max(h0, 0), h - 1) * w * c
        at1 = src + min(max(h0 + 1, 0), h - 1) * w * c
        at2 = src + min(max(h0 + 2, 0), h - 1) * w * c
        for ch in range(c0, c, BLOCK):
            for qw in range(sub, ow, per):
                w0 = qw * sw - pw
                best = float32(-math.inf)
                arg = -1
                best, arg = _small_window_row(x, at0 + ch, c, w, w0, kw, 0 <= h0 < h, h0 * w, best, arg)
                best, arg = _small_window_row(x, at1 + ch, c, w, w0, kw, kh > 1 and 0 <= h0 + 1 < h, (h0 + 1) * w,
                                              best, arg)
                best, arg = _small_window_row(x, at2 + ch, c, w, w0, kw, kh > 2 and 0 <= h0 + 2 < h, (h0 + 2) * w,
                                              best, arg)
                o = out + qw * c + ch
                y[o] = best
                mask[o] = _mask_entry(arg, best, signed)


# Where a pixel lies in at most two windows per axis (kernel <= 2 * stride: ResNet's 3x3 stride 2), its four
# candidate windows' mask entries and gradients are loaded together (indexes clamped into the output plane), then
# added in the loop's order, window row then column; the loop above loads each gradient only after its mask entry
# matched, two memory latencies per window.
@cuda.jit(device=True, inline=True)
def _pick(entry, grad, inside, me, relu, total, positive):
    pixel, above = _chosen(entry, relu)
    if inside and pixel == me:
        return total + grad, above
    return total, positive


@cuda.jit
def max_backward_pairs(dy, mask, dx, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, relu, slope):
    """max_backward for kh <= 2 * sh and kw <= 2 * sw."""
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * h, cuda.gridDim.x):
        r, lo_h, hi_h, out, at = _input_row(row, c, h, w, oh, ow, kh, sh, ph)
        first = out + min(lo_h, oh - 1) * ow * c
        second = out + min(lo_h + 1, oh - 1) * ow * c
        for ch in range(c0, c, BLOCK):
            lo_w = 0
            hi_w = 0
            for s in range(sub, w, per):
                lo_w, hi_w = _rows_holding(s, lo_w, hi_w, ow, kw, sw, pw)
                q0 = min(lo_w, ow - 1) * c + ch
                q1 = min(lo_w + 1, ow - 1) * c + ch
                m00, m01, m10, m11 = mask[first + q0], mask[first + q1], mask[second + q0], mask[second + q1]
                g00, g01, g10, g11 = dy[first + q0], dy[first + q1], dy[second + q0], dy[second + q1]
                me = r * w + s
                grad = 0.0
                positive = False
                grad, positive = _pick(m00, g00, lo_h < hi_h and lo_w < hi_w, me, relu, grad, positive)
                grad, positive = _pick(m01, g01, lo_h < hi_h and lo_w + 1 < hi_w, me, relu, grad, positive)
                grad, positive = _pick(m10, g10, lo_h + 1 < hi_h and lo_w < hi_w, me, relu, grad, positive)
                grad, positive = _pick(m11, g11, lo_h + 1 < hi_h and lo_w + 1 < hi_w, me, relu, grad, positive)
                dx[at + s * c + ch] = _through_relu(grad, positive, relu, slope)


# Where the windows tile the planes (kernel == stride, no padding, h == oh * kh, w == ow * kw: VGG's 2x2 stride-2
# poolings; kernels/pooling.py's max_backward_tiles is the NCHW twin), a thread per output: forward loads its
# whole 2x2 window before comparing (the loop above waits for each load before the next: four memory latencies
# per output), backward reads the mask and gradient once and writes the window, the gradient at the chosen
# pixel and 0 elsewhere (the walk above reads them once per pixel of the window).
@cuda.jit(device=True, inline=True)
def _tile_row(row, c, h, w, oh, ow, kh):
    """Output row `row` (image * oh + window row) of a tiling pooling: the first image row of its windows, the
    flat index of that row's first element, and of the output row's."""
    img = row // oh
    r0 = (row - img * oh) * kh
    return r0, (img * h + r0) * w * c, row * ow * c


@cuda.jit
def max_forward_tiles(x, y, mask, n, c, h, w, oh, ow, kh, kw, signed):
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * oh, cuda.gridDim.x):
        r0, src, out = _tile_row(row, c, h, w, oh, ow, kh)
        for ch in range(c0, c, BLOCK):
            for qw in range(sub, ow, per):
                s0 = qw * kw
                at = src + s0 * c + ch
                best = -math.inf
                arg = -1
                if kh == 2 and kw == 2:
                    v0, v1, v2, v3 = x[at], x[at + c], x[at + w * c], x[at + w * c + c]
                    # the order of the loop below (row by row, strict >: the first maximum wins)
                    if v0 > best:
                        best = v0
                        arg = r0 * w + s0
                    if v1 > best:
                        best = v1
                        arg = r0 * w + s0 + 1
                    if v2 > best:
                        best = v2
                        arg = (r0 + 1) * w + s0
                    if v3 > best:
                        best = v3
                        arg = (r0 + 1) * w + s0 + 1
                else:
                    for i in range(kh):
                        for j in range(kw):
                            v = x[at + (i * w + j) * c]
                            if v > best:
                                best = v
                                arg = (r0 + i) * w + s0 + j
                o = out + qw * c + ch
                y[o] = best
                mask[o] = _mask_entry(arg, best, signed)


@cuda.jit
def max_backward_tiles(dy, mask, dx, n, c, h, w, oh, ow, kh, kw, relu, slope):
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * oh, cuda.gridDim.x):
        r0, top, out = _tile_row(row, c, h, w, oh, ow, kh)
        for ch in range(c0, c, BLOCK):
            for qw in range(sub, ow, per):
                o = out + qw * c + ch
                pixel, positive = _chosen(mask[o], relu)
                g = _through_relu(dy[o], positive, relu, slope)
                s0 = qw * kw
                for i in range(kh):
                    at = top + (i * w + s0) * c + ch
                    me = (r0 + i) * w + s0
                    for j in range(kw):
                        dx[at + j * c] = g if me + j == pixel else float32(0.0)


@cuda.jit
def ave_forward(x, y, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, stochastic):
    """Average (divisor: the window clipped to the padded input) or Caffe's TEST stochastic, in float32."""
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * oh, cuda.gridDim.x):
        img = row // oh
        qh = row - img * oh
        h0 = qh * sh - ph
        h1 = min(h0 + kh, h + ph)
        src = img * h * w * c
        out = row * ow * c
        for ch in range(c0, c, BLOCK):
            for qw in range(sub, ow, per):
                w0 = qw * sw - pw
                w1 = min(w0 + kw, w + pw)
                total = float32(0.0)
                squares = float32(0.0)
                for r in range(max(h0, 0), min(h1, h)):
                    at_row = src + r * w * c + ch
                    for s in range(max(w0, 0), min(w1, w)):
                        v = x[at_row + s * c]
                        total += v
                        squares += v * v
                o = out + qw * c + ch
                if stochastic:
                    y[o] = squares / (FLT_MIN32 + total)
                else:
                    y[o] = total / float32((h1 - h0) * (w1 - w0))


@cuda.jit
def ave_backward(dy, dx, n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw):
    sub, c0, per, active = lane(c)
    if not active:
        return
    for row in range(cuda.blockIdx.x, n * h, cuda.gridDim.x):
        r, lo_h, hi_h, out, at = _input_row(row, c, h, w, oh, ow, kh, sh, ph)
        for ch in range(c0, c, BLOCK):
            lo_w = 0
            hi_w = 0
            for s in range(sub, w, per):
                lo_w, hi_w = _rows_holding(s, lo_w, hi_w, ow, kw, sw, pw)
                grad = float32(0.0)
                for qh in range(lo_h, hi_h):
                    h0 = qh * sh - ph
                    rows = min(h0 + kh, h + ph) - h0
                    for qw in range(lo_w, hi_w):
                        w0 = qw * sw - pw
                        grad += dy[out + (qh * ow + qw) * c + ch] / float32(rows * (min(w0 + kw, w + pw) - w0))
                dx[at + s * c + ch] = grad
