"""The channels-last (NHWC) kernels and ops under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), no GPU needed: the
layout conversion, per-channel sums, the conv bias + ReLU pass, the fused BatchNorm + Scale (+ ReLU) forward and
backward, and max / average pooling, each on NHWC memory against the CPU op on the same values in NCHW.

The ops (backend/cuda/channels_last_ops.py) read an array's shape and its flat memory (`device.flat`); here an
`Nhwc` stand-in holds the logical (N, C, H, W) shape and, as its flat view, a simulated device array of the
values in N, H, W, C order, which is what a channels-last pool view is on the GPU.
The `simulator` tests run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run deselects them.
"""
from __future__ import annotations

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import activate_bare_device, simulated  # noqa: E402

from superneurons.backend.cpu import CpuBackend  # noqa: E402
from superneurons.backend.cuda import kernels as K  # noqa: E402
from superneurons.backend.cuda.kernels import channels_last as lk  # noqa: E402
from superneurons.backend.geometry import PoolGeometry  # noqa: E402

CPU = CpuBackend().ops


class Nhwc:
    """An (N, C, H, W) array stored channels last: what the ops see of a channels-last device view."""

    def __init__(self, nchw: np.ndarray):
        self.shape = nchw.shape
        self.dtype = nchw.dtype
        self.size = nchw.size
        self.ndim = 4
        self._sn_flat = cuda.to_device(np.ascontiguousarray(nchw.transpose(0, 2, 3, 1)).reshape(-1))

    def nchw(self) -> np.ndarray:
        n, c, h, w = self.shape
        return self._sn_flat.copy_to_host().reshape(n, h, w, c).transpose(0, 3, 1, 2)


def _ops():
    activate_bare_device()
    from superneurons.backend.cuda import channels_last_ops

    return channels_last_ops


@simulated
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 7, 3, 1), (3, 2, 1, 6)])
def test_convert_both_ways_and_cast(rng, shape):
    x = rng.standard_normal(shape)
    n, c, h, w = shape
    src = cuda.to_device(x.reshape(-1))
    dst = cuda.to_device(np.zeros(x.size, np.float32))
    K.launch(lk.convert_cast, x.size)(np.float32(1.0), src, dst, c, h * w, False, True)  # NCHW float64 -> NHWC
    np.testing.assert_array_equal(dst.copy_to_host(), x.astype(np.float32).transpose(0, 2, 3, 1).reshape(-1))
    back = cuda.to_device(np.zeros(x.size, np.float32))
    K.launch(lk.convert, x.size)(dst, back, c, h * w, True, False)
    np.testing.assert_array_equal(back.copy_to_host(), x.astype(np.float32).reshape(-1))


@simulated
def test_convert_axpy(rng):
    """y (NCHW) += alpha * x (NHWC): a weight gradient left in its KRSC copy added into the KCRS master's."""
    shape = (4, 3, 2, 5)
    x, y = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    n, c, h, w = shape
    d = cuda.to_device(y.reshape(-1).copy())
    src = cuda.to_device(np.ascontiguousarray(x.transpose(0, 2, 3, 1)).reshape(-1))
    K.launch(lk.convert_axpy, y.size)(np.float32(0.5), src, d, c, h * w, True, False)
    np.testing.assert_allclose(d.copy_to_host().reshape(shape), y + np.float32(0.5) * x, rtol=1e-6, atol=1e-6)


# A tile with idle rows (3 channels: an image batch), tiles cut at both edges (40 x 36), 1x1 planes, and rows
# and columns past one tile with one block taking every tile in turn (the grid capped; the simulator runs each
# block's threads in Python, so one block keeps it quick).
TRANSPOSES = [((2, 3, 5, 7), None), ((1, 40, 6, 6), None), ((1, 33, 1, 1), None), ((2, 65, 3, 11), 1)]


@simulated
@pytest.mark.parametrize("shape,blocks", TRANSPOSES)
def test_transpose_between_layouts_in_every_mode(rng, monkeypatch, shape, blocks):
    """layout.transpose (a 32x32 shared tile per block) against NumPy: NCHW to NHWC and back, copy, scale into
    another type, and add into; half bits (uint16) move exactly."""
    from superneurons.backend.cuda.layout import transpose

    if blocks is not None:
        monkeypatch.setattr(lk, "transpose_blocks", lambda n, rows, cols: blocks)

    x = rng.standard_normal(shape).astype(np.float32)
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    dst = cuda.to_device(np.zeros(x.size, np.float32))
    transpose(np.float32(1.0), cuda.to_device(x.reshape(-1)), dst, shape, False, lk.COPY)
    np.testing.assert_array_equal(dst.copy_to_host(), nhwc.reshape(-1))
    half = cuda.to_device(np.zeros(x.size, np.float16))
    transpose(np.float32(0.5), cuda.to_device(nhwc.reshape(-1)), half, shape, True, lk.SCALE)
    np.testing.assert_array_equal(half.copy_to_host(), (np.float32(0.5) * x).astype(np.float16).reshape(-1))
    y = rng.standard_normal(shape).astype(np.float32)
    acc = cuda.to_device(y.reshape(-1).copy())
    transpose(np.float32(-2.0), cuda.to_device(nhwc.reshape(-1)), acc, shape, True, lk.AXPY)
    np.testing.assert_array_equal(acc.copy_to_host(), (y + np.float32(-2.0) * x).reshape(-1))
    bits = rng.integers(0, 1 << 16, x.size, dtype=np.uint32).astype(np.uint16)
    moved = cuda.to_device(np.zeros(x.size, np.uint16))
    transpose(np.float32(1.0), cuda.to_device(bits), moved, shape, False, lk.COPY)
    np.testing.assert_array_equal(moved.copy_to_host(), bits.reshape(shape).transpose(0, 2, 3, 1).reshape(-1))


# the last: two channel tiles (the second partly idle) and two row groups, four rows per trip and a tail
SUMS_SHAPES = [(2, 3, 4, 5), (4, 16, 3, 3), (4, 40, 9, 9)]


@simulated
@pytest.mark.parametrize("shape,dtype", [(s, np.float32) for s in SUMS_SHAPES] + [(SUMS_SHAPES[-1], np.float16)])
def test_channel_sums(rng, shape, dtype):
    """Against float64 sums of the stored values (float16 storage: its rounded values; the sums stay float64)."""
    ops = _ops()
    x, y = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    n, c, h, w = shape
    db = rng.standard_normal(c).astype(np.float32)
    d = cuda.to_device(db)
    ops.bias_backward(Nhwc(x), d, n, c, h * w)  # adds
    np.testing.assert_allclose(d.copy_to_host(), db + x.astype(np.float64).sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    ds = cuda.to_device(np.zeros(c, np.float32))
    ops.channel_mul_grad(Nhwc(x), Nhwc(y), ds, n, c, h * w, False)
    np.testing.assert_allclose(ds.copy_to_host(), (x.astype(np.float64) * y).sum(axis=(0, 2, 3)), rtol=1e-5,
                               atol=1e-5)
    mean, var = cuda.to_device(np.zeros(c, np.float32)), cuda.to_device(np.zeros(c, np.float32))
    ops.bn_batch_stats(Nhwc(x), mean, var, n, c, h * w)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean.copy_to_host(), x64.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var.copy_to_host(), x64.var(axis=(0, 2, 3)), rtol=1e-4, atol=1e-6)


# channels that share a block's threads with other rows (3, 96: a thread per (row, channel), some idle), and more
# channels than a block has threads (300: each thread takes several)
CHANNELS = [(2, 3, 4, 5), (2, 96, 2, 3), (2, 300, 1, 3)]
# rows enough for the four-rows-per-trip path, and a tail (rows > 4 x the rows the grid covers at once)
FOUR_ROWS = [(4, 96, 4, 5), (2, 3, 16, 17)]


@simulated
@pytest.mark.parametrize("shape,slope", [(shape, slope) for shape in CHANNELS for slope in (None, 0.0, 0.25)]
                         + [(FOUR_ROWS[0], 0.25), (FOUR_ROWS[1], None)])
def test_bias_and_bias_relu(rng, shape, slope):
    ops = _ops()
    n, c, h, w = shape
    y = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    a = Nhwc(y)
    if slope is None:
        ops.add_bias(a, cuda.to_device(b), n, c, h * w)
    else:
        ops.bias_relu(a, cuda.to_device(b), n, c, h * w, slope)
    pre = y.astype(np.float64) + b.reshape(1, -1, 1, 1)
    want = pre if slope is None else np.where(pre > 0, pre, pre * slope)
    np.testing.assert_allclose(a.nchw(), want, rtol=1e-6, atol=1e-6)


def _bn_params(rng, c):
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
    beta = rng.standard_normal(c).astype(np.float32)
    return gamma, beta


@simulated
@pytest.mark.parametrize("relu", [None, 0.0, 0.1])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("global_stats", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 3, 5), (2, 300, 1, 3)])
def test_fused_batch_norm_matches_the_cpu(rng, relu, keep, global_stats, shape):
    _check_fused_batch_norm(rng, relu, keep, global_stats, shape)


@simulated
@pytest.mark.parametrize("keep", [True, False])
def test_fused_batch_norm_four_rows_per_trip(rng, keep):
    _check_fused_batch_norm(rng, 0.1, keep, False, FOUR_ROWS[0])


@simulated
def test_fused_batch_norm_tiles_and_row_groups(rng):
    """Sums over several channel tiles and row groups (kernels/channels_last.py: tiled_blocks)."""
    _check_fused_batch_norm(rng, 0.0, False, False, SUMS_SHAPES[-1])


def _check_fused_batch_norm(rng, relu, keep, global_stats, shape) -> None:
    """The NHWC fused BatchNorm + Scale (+ ReLU) forward and backward against the CPU's NCHW ones."""
    ops = _ops()
    n, c, h, w = shape
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 0.5
    dy = rng.standard_normal(shape).astype(np.float32)
    gamma, beta = _bn_params(rng, c)
    running = (rng.uniform(0, 1, c).astype(np.float32), rng.uniform(1, 2, c).astype(np.float32),
               np.array([2.0], np.float32))

    def run(cpu: bool):
        ms, vs, sf = (r.copy() for r in running)
        stats = [np.zeros(c, np.float32) for _ in range(3)]  # mean, var, inv_std
        y = np.zeros(shape, np.float32)
        x_hat = np.zeros(shape, np.float32) if keep else None
        dx = np.zeros(shape, np.float32)
        dg, dbt = np.full(c, 0.5, np.float32), np.full(c, -0.5, np.float32)
        args = dict(outer=n, channels=c, inner=h * w)
        if cpu:
            CPU.bn_affine_forward(x, y, x_hat, *stats, gamma, beta, ms, vs, sf, eps=1e-5,
                                  use_global_stats=global_stats, update_running=not global_stats,
                                  moving_average_fraction=0.9, var_correction=1.2, relu_slope=relu, **args)
            kept = x_hat if keep else x
            CPU.bn_affine_backward(kept, None if keep else stats[0], stats[2], gamma, beta, dy, dx, dg, dbt,
                                   use_global_stats=global_stats, relu_slope=relu, **args)
            return y, dx, dg, dbt, ms, vs, sf, stats
        dev = [cuda.to_device(a) for a in (ms, vs, sf, *stats, gamma, beta, dg, dbt)]
        d_ms, d_vs, d_sf, d_mean, d_var, d_inv, d_g, d_b, d_dg, d_db = dev
        gx, gy, gdx, gdy = Nhwc(x), Nhwc(y), Nhwc(dx), Nhwc(dy)
        gh = Nhwc(x_hat) if keep else None
        ops.bn_affine_forward(gx, gy, gh, d_mean, d_var, d_inv, d_g, d_b, d_ms, d_vs, d_sf, eps=1e-5,
                              use_global_stats=global_stats, update_running=not global_stats,
                              moving_average_fraction=0.9, var_correction=1.2, relu_slope=relu, **args)
        ops.bn_affine_backward(gh if keep else gx, None if keep else d_mean, d_inv, d_g, d_b, gdy, gdx, d_dg, d_db,
                               use_global_stats=global_stats, relu_slope=relu, **args)
        return (gy.nchw(), gdx.nchw(), d_dg.copy_to_host(), d_db.copy_to_host(), d_ms.copy_to_host(),
                d_vs.copy_to_host(), d_sf.copy_to_host(), [a.copy_to_host() for a in (d_mean, d_var, d_inv)])

    want, got = run(True), run(False)
    for name, a, b in zip(("y", "dx", "dgamma", "dbeta", "mean_sum", "var_sum", "scale_factor"), want[:7], got[:7]):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4, err_msg=name)
    for a, b in zip(want[7], got[7]):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5)


# (method, kernel, stride, pad, the slope of a ReLU whose backward the max pooling runs, or None)
POOLS = [("max", (3, 3), (2, 2), (1, 1), None), ("max", (3, 3), (2, 2), (1, 1), 0.0), ("max", (2, 2), (2, 2), (0, 0), None),
         ("max", (2, 2), (2, 2), (0, 0), 0.0), ("ave", (3, 3), (2, 2), (1, 1), None), ("ave", (2, 2), (1, 1), (0, 0), None)]


def _pooled(size: int, k: int, stride: int, pad: int) -> int:
    """Caffe's pooled size: windows rounded up, the last one starting inside the image or its left padding."""
    out = -(-(size + 2 * pad - k) // stride) + 1
    return out - 1 if pad and (out - 1) * stride >= size + pad else out


# Windows that tile the planes exactly (max_forward_tiles / max_backward_tiles): 2x2 (the four-load path) and
# 3x3, with and without the ReLU, one with more channels than a block has threads.
# The other window walks: up to 3x3 with every load issued first (max_forward_small: stride 1 and 2, padded or
# not, Caffe's rounded-up last window, asymmetric windows), the backward's four candidate windows where a pixel
# lies in at most two per axis (max_backward_pairs: stride 2, and 1x1 stride 2 where some pixels lie in none),
# and the general loops past those (5x5 forward; 3x3 stride 1 backward, three windows per axis).
WALKS = [("max", (3, 3), (1, 1), (1, 1), None, (2, 5, 6, 7)), ("max", (3, 3), (2, 2), (0, 0), 0.0, (2, 4, 8, 7)),
         ("max", (2, 3), (1, 2), (1, 0), None, (1, 6, 5, 8)), ("max", (1, 1), (2, 2), (0, 0), 0.5, (1, 3, 5, 5)),
         ("max", (5, 5), (2, 2), (2, 2), None, (1, 4, 9, 9)), ("max", (3, 3), (2, 2), (1, 1), 0.0, (2, 64, 9, 9))]
TILES = [("max", (2, 2), (2, 2), (0, 0), None, (2, 3, 8, 6)), ("max", (2, 2), (2, 2), (0, 0), 0.0, (1, 96, 4, 6)),
         ("max", (3, 3), (3, 3), (0, 0), 0.25, (2, 5, 6, 9)), ("max", (2, 2), (2, 2), (0, 0), None, (1, 300, 2, 4))]


@simulated
@pytest.mark.parametrize("method,kernel,stride,pad,relu,shape", [(*p, (2, 3, 7, 6)) for p in POOLS] + [
    (*POOLS[1], (1, 96, 5, 4)), (*POOLS[4], (1, 96, 5, 4)), (*POOLS[0], (1, 300, 3, 4))] + TILES + WALKS)
def test_pooling_matches_the_cpu(rng, method, kernel, stride, pad, relu, shape):
    ops = _ops()
    geom = PoolGeometry(method, kernel, stride, pad)
    oh, ow = (_pooled(d, k, st, p) for d, k, st, p in zip(shape[2:], kernel, stride, pad))
    top = (shape[0], shape[1], oh, ow)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, :2, :2] = 0.5  # a tie: the first maximum in row order wins, in every kernel
    dy = rng.standard_normal(top).astype(np.float32)
    y, dx = np.zeros(top, np.float32), np.zeros(shape, np.float32)
    mask = np.zeros(top, np.int32) if method == "max" else None
    signed = relu is not None
    CPU.pool_forward(x, y, mask, geom, signed_mask=signed)
    CPU.pool_backward(dy, mask, dx, geom, relu_slope=relu)
    gy, gdx = Nhwc(np.zeros(top, np.float32)), Nhwc(np.zeros(shape, np.float32))
    gmask = Nhwc(np.zeros(top, np.int32)) if method == "max" else None
    ops.pool_forward(Nhwc(x), gy, gmask, geom, signed_mask=signed)
    ops.pool_backward(Nhwc(dy), gmask, gdx, geom, relu_slope=relu)
    np.testing.assert_allclose(gy.nchw(), y, rtol=1e-6, atol=1e-6)
    if mask is not None:
        np.testing.assert_array_equal(gmask.nchw(), mask)  # the same plane indexes as the NCHW kernels'
    np.testing.assert_allclose(gdx.nchw(), dx, rtol=1e-5, atol=1e-6)


# Joins along each axis: channels (the zoo's: Inception's, DenseNet's, SqueezeNet's), with rows long and short
# enough to take both copy walks; batch; height and width.
JOINS = [(1, [(2, 3, 4, 5), (2, 5, 4, 5)]), (1, [(1, 64, 3, 3), (1, 1, 3, 3), (1, 96, 3, 3)]),
         (0, [(1, 3, 4, 5), (2, 3, 4, 5)]), (2, [(2, 3, 1, 5), (2, 3, 4, 5)]), (3, [(2, 3, 4, 2), (2, 3, 4, 6)])]


@simulated
@pytest.mark.parametrize("axis,shapes", JOINS)
def test_concat_slice_and_relu_slab_match_the_cpu(rng, axis, shapes):
    """Concat forward (and Slice's backward) into an NHWC top, Concat's backward (Slice's forward) out of it, and
    a ReLU's backward reading its slice of the top gradient: the CPU's NCHW values."""
    ops = _ops()
    bottoms = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    top_shape = list(shapes[0])
    top_shape[axis] = sum(s[axis] for s in shapes)
    top = np.zeros(top_shape, np.float32)
    CPU.concat_forward(bottoms, top, axis)
    gtop = Nhwc(np.zeros(top_shape, np.float32))
    ops.concat_forward([Nhwc(b) for b in bottoms], gtop, axis)
    np.testing.assert_array_equal(gtop.nchw(), top)
    dtop = rng.standard_normal(top_shape).astype(np.float32)
    offset = 0
    for b in bottoms:
        want = np.zeros(b.shape, np.float32)
        CPU.concat_backward(dtop, want, axis, offset)
        got = Nhwc(np.zeros(b.shape, np.float32))
        ops.concat_backward(Nhwc(dtop), got, axis, offset)
        np.testing.assert_array_equal(got.nchw(), want)
        y = np.maximum(b, 0)
        want_relu = np.zeros(b.shape, np.float32)
        CPU.relu_backward_slab(y, dtop, want_relu, axis, offset, 0.1)
        got_relu = Nhwc(np.zeros(b.shape, np.float32))
        ops.relu_backward_slab(Nhwc(y), Nhwc(dtop), got_relu, axis, offset, 0.1)
        np.testing.assert_array_equal(got_relu.nchw(), want_relu)
        offset += b.shape[axis]
