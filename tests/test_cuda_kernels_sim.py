"""The numba-cuda kernels under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1): no GPU needed, so CI checks the
kernels' logic against the CPU ops on tiny inputs. Skipped without numba-cuda.
The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest


if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
cuda = pytest.importorskip("numba.cuda")
from cudasim import simulated  # noqa: E402


from superneurons.backend.cpu import (  # noqa: E402
    activation as cpu_activation, dropout as cpu_dropout, pooling as cpu_pool, solver_ops)
from superneurons.backend.cuda import kernels as K  # noqa: E402
from superneurons.backend.cuda.kernels import (  # noqa: E402
    dropout as dk, elementwise as ek, pooling as pk, solver as sk)
from superneurons.backend.geometry import PoolGeometry  # noqa: E402


@simulated
def test_dropout_mask_is_bit_identical_to_cpu():
    rng = np.random.default_rng()
    x = rng.standard_normal(300).astype(np.float32)
    seed, it, layer = int(rng.integers(1 << 31)), int(rng.integers(1000)), 3
    want = np.empty_like(x)
    cpu_dropout.dropout_apply(x, want, 0.4, seed, it, layer)
    got = np.empty_like(x)
    key = np.array([cpu_dropout.pass_key(seed, it)], np.uint32)  # the pass's word, as the GPU keeps it
    K.launch(dk.dropout_apply, x.size)(x, got, key, np.uint64(layer),
                                       np.uint64(cpu_dropout.keep_threshold(0.4)), np.float32(1 / 0.6))
    assert np.array_equal(got, want)
    assert cpu_dropout.layer_keys(int(key[0]), layer) == cpu_dropout.stream_keys(seed, it, layer)


@simulated
def test_max_pool_ceil_mode_forward_and_backward():
    rng = np.random.default_rng()
    geom = PoolGeometry("max", (3, 3), (2, 2), (0, 0))
    x = rng.standard_normal((1, 2, 6, 6)).astype(np.float32)
    y, mask = np.empty((1, 2, 3, 3), np.float32), np.empty((1, 2, 3, 3), np.int32)  # ceil: (6-3)/2 -> 3
    cpu_pool.pool_forward(x, y, mask, geom)
    dims = (6, 6, 3, 3, 3, 3, 2, 2, 0, 0)
    yg, mg = np.empty_like(y), np.empty_like(mask)
    K.launch(pk.max_forward, y.size)(x.ravel(), yg.ravel(), mg.ravel(), *dims, False)
    assert np.array_equal(yg, y) and np.array_equal(mg, mask)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dxg = np.empty_like(x), np.empty_like(x)
    cpu_pool.pool_backward(dy, mask, dx, geom)
    K.launch(pk.max_backward, x.size)(dy.ravel(), mask.ravel(), dxg.ravel(), *dims, False, np.float32(0))
    np.testing.assert_allclose(dxg, dx, rtol=1e-6)


@simulated
@pytest.mark.parametrize("x_shape,kernel,stride,pad", [
    ((2, 3, 9, 8), (3, 3), (2, 2), (0, 0)),  # ceil mode: the last windows hang over
    ((1, 2, 7, 7), (3, 3), (2, 2), (1, 1)),  # ResNet's pool1 geometry
    ((1, 2, 6, 5), (2, 3), (2, 1), (1, 0)),  # overlapping along one axis only
    ((2, 1, 5, 5), (2, 2), (3, 3), (0, 0)),  # stride over the kernel: some pixels in no window
    ((2, 2, 8, 6), (2, 2), (2, 2), (0, 0)),  # VGG's windows, tiling the planes: max_backward_tiles too
    ((1, 2, 11, 10), (5, 4), (2, 1), (2, 1)),  # windows over 3x3 elements, up to 3 and 4 windows per pixel
])
@pytest.mark.parametrize("relu_slope", [None, 0.0, 0.25], ids=["plain", "relu", "leaky"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_max_pool_by_columns_matches_cpu(x_shape, kernel, stride, pad, relu_slope, ties):
    """The column-walking forward and backward (the ones the op launches) against the CPU op, on geometries
    that exercise their window-range bookkeeping and load grouping; with `relu_slope`, the pooling reads a
    ReLU's output and its backward goes on through that ReLU (the CPU op then equals pool_backward +
    relu_backward bit for bit). With `ties`, windows hold equal maxima, and the first one must be chosen."""
    rng = np.random.default_rng()
    geom = PoolGeometry("max", kernel, stride, pad)

    def pooled(n, k, st, p):  # Caffe's ceil rounding, the last window starting inside the image or its padding
        out = -(-(n + 2 * p - k) // st) + 1
        return out - 1 if p and (out - 1) * st >= n + p else out

    oh, ow = (pooled(*a) for a in zip(x_shape[2:], kernel, stride, pad))
    x = rng.standard_normal(x_shape).astype(np.float32)
    if ties:
        x = np.round(x).astype(np.float32)
    if relu_slope is not None:  # the pooling's bottom is the ReLU's output, often all non-positive in a window
        x -= 1.5
        x[-1, -1] = -np.abs(x[-1, -1]) - 0.1  # one plane with no window above 0
        x[0, 0, 0, 0] = 3.0  # and one window that is
        cpu_activation.relu_forward(x, x, relu_slope)
    y, mask = np.empty((*x_shape[:2], oh, ow), np.float32), np.empty((*x_shape[:2], oh, ow), np.int32)
    signed = relu_slope is not None
    cpu_pool.pool_forward(x, y, mask, geom, signed_mask=signed)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    want, got = np.empty_like(x), np.full_like(x, np.nan)
    cpu_pool.pool_backward(dy, mask, want, geom, relu_slope)
    if signed:  # the same bits as the pooling's backward and then the ReLU's, on the plain mask
        assert (mask < 0).any() and (mask >= 0).any()
        plain_mask, separate = np.empty_like(mask), np.empty_like(x)
        cpu_pool.pool_forward(x, np.empty_like(y), plain_mask, geom)
        np.testing.assert_array_equal(np.where(mask >= 0, mask, ~mask), plain_mask)
        cpu_pool.pool_backward(dy, plain_mask, separate, geom)
        cpu_activation.relu_backward(x, separate, separate, relu_slope)
        np.testing.assert_array_equal(want, separate)
    planes = x_shape[0] * x_shape[1]
    dims = (x_shape[2], x_shape[3], oh, ow, *kernel, *stride, *pad)
    y_got, mask_got = np.full_like(y, np.nan), np.full_like(mask, -7)
    K.launch(pk.max_forward_columns, planes * ow)(x.ravel(), y_got.ravel(), mask_got.ravel(), planes, *dims, signed)
    assert np.array_equal(y_got, y) and np.array_equal(mask_got, mask)
    y_got, mask_got = np.full_like(y, np.nan), np.full_like(mask, -7)  # the per-output statement of the rules
    K.launch(pk.max_forward, y.size)(x.ravel(), y_got.ravel(), mask_got.ravel(), *dims, signed)
    assert np.array_equal(y_got, y) and np.array_equal(mask_got, mask)
    K.launch(pk.max_backward_columns, planes * x_shape[3])(dy.ravel(), mask.ravel(), got.ravel(), planes, *dims,
                                                           signed, np.float32(relu_slope or 0))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if kernel == stride and pad == (0, 0) and (oh * kernel[0], ow * kernel[1]) == x_shape[2:]:
        tiles = np.full_like(x, np.nan)
        K.launch(pk.max_backward_tiles, y.size)(dy.ravel(), mask.ravel(), tiles.ravel(), *dims[:6], signed,
                                                np.float32(relu_slope or 0))
        np.testing.assert_array_equal(tiles, got)


@simulated
@pytest.mark.parametrize("x_shape,kernel,stride,pad", [
    ((2, 3, 9, 8), (3, 3), (2, 2), (0, 0)),  # ceil mode: the last windows hang over
    ((1, 2, 7, 7), (3, 3), (1, 1), (1, 1)),  # Inception's 3x3 stride-1 average pooling: divisors count padding
    ((1, 2, 6, 5), (2, 3), (2, 1), (1, 0)),  # overlapping along one axis only
    ((2, 1, 5, 5), (2, 2), (3, 3), (0, 0)),  # stride over the kernel: some pixels in no window
    ((2, 2, 6, 6), (6, 6), (1, 1), (0, 0)),  # global pooling
])
def test_ave_pool_by_columns_matches_cpu(x_shape, kernel, stride, pad):
    """The column-walking average forward (and Caffe's TEST-time stochastic one) and backward, summing in
    float32 as Caffe does, against the CPU op (float64 sums) and the per-pixel kernels."""
    rng = np.random.default_rng()

    def pooled(n, k, st, p):
        out = -(-(n + 2 * p - k) // st) + 1
        return out - 1 if p and (out - 1) * st >= n + p else out

    oh, ow = (pooled(*a) for a in zip(x_shape[2:], kernel, stride, pad))
    planes = x_shape[0] * x_shape[1]
    dims = (x_shape[2], x_shape[3], oh, ow, *kernel, *stride, *pad)
    x = rng.standard_normal(x_shape).astype(np.float32)
    for method in ("ave", "stochastic"):
        xm = np.abs(x) if method == "stochastic" else x  # stochastic pooling reads probabilities (>= 0)
        want = np.empty((*x_shape[:2], oh, ow), np.float32)
        cpu_pool.pool_forward(xm, want, None, PoolGeometry(method, kernel, stride, pad))
        got, plain = np.full_like(want, np.nan), np.full_like(want, np.nan)
        K.launch(pk.ave_forward_columns, planes * ow)(xm.ravel(), got.ravel(), planes, *dims, method == "stochastic")
        K.launch(pk.ave_forward, want.size)(xm.ravel(), plain.ravel(), *dims, method == "stochastic")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)
    dy = rng.standard_normal((*x_shape[:2], oh, ow)).astype(np.float32)
    want = np.empty_like(x)
    cpu_pool.pool_backward(dy, None, want, PoolGeometry("ave", kernel, stride, pad))
    got, plain = np.full_like(x, np.nan), np.full_like(x, np.nan)
    K.launch(pk.ave_backward_columns, planes * x_shape[3])(dy.ravel(), got.ravel(), planes, *dims)
    K.launch(pk.ave_backward, x.size)(dy.ravel(), plain.ravel(), *dims)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)


@simulated
@pytest.mark.parametrize("n", [1, 3, 1029, 5000])
def test_unrolled_elementwise_kernels_match_cpu_in_place(n):
    """ReLU forward/backward and the two-input sum take four elements per thread per trip; sizes that leave
    the last trip partly masked, and in place (output = input), as the layers call them."""
    from superneurons.backend.cpu import activation as cpu_act

    rng = np.random.default_rng()
    x, dy, b = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    want = np.empty_like(x)
    cpu_act.relu_forward(x, want, 0.1)
    got = x.copy()
    K.launch_unrolled(ek.relu_forward, n)(got, got, np.float32(0.1))
    assert np.array_equal(got, want)
    want_dx = np.empty_like(x)
    cpu_act.relu_backward(want, dy, want_dx, 0.1)
    got_dx = dy.copy()
    K.launch_unrolled(ek.relu_backward, n)(got, got_dx, got_dx, np.float32(0.1))
    assert np.array_equal(got_dx, want_dx)
    got_sum = x.copy()
    K.launch_unrolled(ek.weighted_sum2, n)(np.float32(1.0), got_sum, np.float32(-2.0), b, got_sum)
    np.testing.assert_allclose(got_sum, x - 2 * b, rtol=1e-6, atol=1e-6)


@simulated
def test_fused_sgd_matches_cpu_rule():
    rng = np.random.default_rng()
    w, g, h = (rng.standard_normal(50).astype(np.float32) for _ in range(3))
    cw, cg, ch = w.copy(), g.copy(), h.copy()
    solver_ops.sgd_update(cw, cg, ch, 0.01, 0.9)
    K.launch(sk.sgd, w.size)(w, g, h, np.float32(0.01), np.float32(0.9))
    for a, b in ((w, cw), (g, cg), (h, ch)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


BN_SHAPES = [((3, 2, 5, 6), True, False), ((2, 3, 300), False, False), ((3, 2, 4, 3), True, True),
             ((2, 2, 33, 40), True, False)]
BN_SETTINGS = {"rows": (256, 0, 0), "walk": (0, 0, 0), "fat_blocks": (256, 2048, 0), "block_per_channel": (0, 0, 1)}


@simulated
@pytest.mark.parametrize("rows_min,min_block,channel_min,shape,relu,global_stats", [
    pytest.param(*settings, *case, id=f"{name}-{'x'.join(map(str, case[0]))}")
    for name, settings in BN_SETTINGS.items() for case in BN_SHAPES
    # "rows" on planes shorter than its 256 elements runs the general walk with one plane per block, the same
    # kernels and launches as "walk" on that shape (ops/fused.py: _kernels, one_block_per_channel; chunking
    # without a minimum block): only its planes of 256 elements or more take a path of their own.
    if not (name == "rows" and int(np.prod(case[0][2:])) < 256)])
def test_fused_batch_norm_scale_relu_ops_match_cpu(shape, relu, global_stats, rows_min, min_block, channel_min,
                                                   monkeypatch):
    """The CUDA fused op (its kernels run by the simulator on host arrays) against the CPU fused op; the
    shapes cover planes shorter and longer than a block, and a plane over four blocks' worth (several
    four-element trips per thread, the last one partly masked). Planes of `rows_min` or more elements run
    the plain-sweep kernels (0: the general walk everywhere); `min_block` makes blocks span several planes;
    `channel_min` 1 runs every shape on the one-launch kernels, one block per channel (0: never)."""
    from superneurons.backend.cpu import fused as cpu_fused
    from superneurons.backend.cuda.ops import fused as cuda_fused

    monkeypatch.setenv("SUPERNEURONS_BN_ROWS", "1" if rows_min > 0 else "0")
    monkeypatch.setenv("SUPERNEURONS_BN_ROWS_MIN", str(rows_min))
    monkeypatch.setenv("SUPERNEURONS_BN_MIN_BLOCK", str(min_block))
    monkeypatch.setenv("SUPERNEURONS_BN_CHANNEL_MIN", str(channel_min))
    assert cuda_fused.one_block_per_channel(*shape[:2], int(np.prod(shape[2:]))) == bool(channel_min)

    rng = np.random.default_rng()
    n, c = shape[0], shape[1]
    dims = (n, c, int(np.prod(shape[2:])))
    x = (rng.standard_normal(shape) * 1.5 + 0.4).astype(np.float32)
    gamma, beta = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(shape).astype(np.float32)
    slope = 0.0 if relu else None
    results = []
    for op in (cpu_fused, cuda_fused):
        running = [np.full(c, 0.75, np.float32), np.full(c, 1.25, np.float32),
                   np.array([2.0], np.float32)]
        y, x_hat = np.zeros_like(x), np.zeros_like(x)
        stats = [np.zeros(c, np.float32) for _ in range(3)]
        op.bn_affine_forward(x, y, x_hat, *stats, gamma, beta, *running, *dims, 1e-5, global_stats, True, 0.9,
                             1.1, slope)
        dx = dy.copy()
        dgamma, dbeta = np.ones(c, np.float32), np.zeros(c, np.float32)
        op.bn_affine_backward(x_hat, None, stats[2], gamma, beta, dx, dx, dgamma, dbeta, *dims, global_stats, slope)
        # the same from x (an out-of-place BatchNorm keeps its input): x_hat normalized again, the same bits
        dx_from_x = dy.copy()
        dgamma_x, dbeta_x = np.ones(c, np.float32), np.zeros(c, np.float32)
        op.bn_affine_backward(x, stats[0], stats[2], gamma, beta, dx_from_x, dx_from_x, dgamma_x, dbeta_x, *dims,
                              global_stats, slope)
        for from_x_hat, from_x in ((dx, dx_from_x), (dgamma, dgamma_x), (dbeta, dbeta_x)):
            np.testing.assert_array_equal(from_x, from_x_hat)
        results.append([y, x_hat, *stats, *running, dx, dgamma, dbeta])
    names = ["y", "x_hat", "mean", "var", "inv_std", "mean_sum", "var_sum", "scale_factor", "dx", "dgamma", "dbeta"]
    for name, got, want in zip(names, results[1], results[0]):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()), err_msg=name)


@simulated
@pytest.mark.parametrize("shape", [(3, 2, 5, 6), (2, 2, 1100), (5, 1, 7, 7)], ids=["walk", "rows", "many_planes"])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_channel_partials_match_float64_sums(shape, mode):
    """The per-channel sums (bias gradients, Scale's gradient, unfused BatchNorm) against NumPy float64 sums:
    planes shorter than a block (the flat walk over several planes per block) and longer (the per-plane
    sweep, its last trip partial), in every mode, with one or several blocks per channel."""
    from superneurons.backend.cuda.kernels import reduce as rk

    rng = np.random.default_rng()
    n, c = shape[0], shape[1]
    inner = int(np.prod(shape[2:]))
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.standard_normal(shape).astype(np.float32)
    mean = rng.standard_normal(c).astype(np.float32)
    inv = (rng.random(c) + 0.5).astype(np.float32)
    for chunk in (1, 2) if mode == 1 else (2,):  # blocks of one plane, of two (the last one short where n is odd)
        sums = np.zeros(2 * c, np.float64)
        blocks = c * -(-n // chunk)
        K.launch(rk.channel_partials, 0, blocks=blocks)(x.ravel(), y.ravel(), mean, inv, sums, n, c, inner,
                                                         chunk, mode)
        xs, ys = (a.reshape(n, c, inner).astype(np.float64) for a in (x, y))
        x_hat = (xs - mean.astype(np.float64)[None, :, None]) * inv.astype(np.float64)[None, :, None]
        first, second = {0: (xs, xs * xs), 1: (xs, None), 2: (xs * ys, None), 3: (ys, ys * x_hat)}[mode]
        np.testing.assert_allclose(sums[:c], first.sum(axis=(0, 2)), rtol=1e-10, atol=1e-10)
        want_second = second.sum(axis=(0, 2)) if second is not None else np.zeros(c)
        np.testing.assert_allclose(sums[c:], want_second, rtol=1e-10, atol=1e-10)


@simulated
def test_dropout_op_keeps_the_pass_key_on_the_device():
    """The op writes the pass's key into its device word when the pass changes (and only then), and the kernel's
    masks follow it: successive passes, a repeated one (the backward regenerating the forward's mask) and a
    pass that dropout_pass set up beforehand all match the CPU."""
    from superneurons.backend.cuda.ops import dropout as gpu_dropout

    rng = np.random.default_rng()
    x = rng.standard_normal(500).astype(np.float32)
    src, dst = cuda.to_device(x), cuda.device_array_like(x)
    seed = int(rng.integers(1 << 31))
    for it in (0, 5, 5, 6):
        gpu_dropout.dropout_apply(src, dst, 0.3, seed, it, 4)
        want = np.empty_like(x)
        cpu_dropout.dropout_apply(x, want, 0.3, seed, it, 4)
        assert np.array_equal(dst.copy_to_host(), want), it
    gpu_dropout.dropout_pass(seed, 9)
    assert int(gpu_dropout._KEY[0].copy_to_host()[0]) == cpu_dropout.pass_key(seed, 9)
