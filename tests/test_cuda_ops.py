"""Every CUDA op against the CPU op on realistic shapes, and whole Nets on both backends.

Tolerances: elementwise ops and the kernels that mirror the CPU loops agree to float32 rounding
(rtol 1e-5); reductions accumulate in a different order (rtol 1e-4). cuDNN convolution is run with
FMA math (tf32=False): cuDNN's default math may use TF32 tensor cores (~1e-3 relative error), so the
tests switch it off and compare at rtol 1e-4 relative to the output's scale. Dropout masks are compared bit for bit.
Run with `make gpu-test` on a GPU machine; everything here is skipped elsewhere.
"""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.geometry import ConvGeometry, LRNGeometry, PoolGeometry
from test_activations import OPS
import gpu_harness
from gpu_harness import (FLOAT32_VALUES, CPU, GPU_ONLY, assert_param_grads_match, close, dev, dummy_images, f32,
                         one_iteration_on_both, randn, run_both)

pytestmark = GPU_ONLY


@pytest.mark.parametrize("name,fwd_args,bwd_args,reads_top", OPS)
def test_activations(gpu, rng, name, fwd_args, bwd_args, reads_top):
    """Every row of test_activations.OPS, on a realistic shape."""
    x = randn(rng, 32, 64, 28, 28)
    if name in ("power", "log"):
        x = np.clip(x, -4, 4)  # shift + scale * x stays > 0: a fractional power or log of a negative is NaN
    (_, yc), (_, yg) = run_both(gpu, f"{name}_forward", [x, np.zeros_like(x)], *fwd_args)
    assert np.isfinite(yc).all()
    close(yg, yc)
    dy = randn(rng, *x.shape)
    (*_, dxc), (*_, dxg) = run_both(gpu, f"{name}_backward", [yc if reads_top else x, dy, np.zeros_like(x)],
                                    *bwd_args)
    close(dxg, dxc)


def test_basic_blas1_and_reductions(gpu, rng):
    x, y = randn(rng, 1000, 37), randn(rng, 1000, 37)
    for op, args in (("axpy", (0.3, x, y)), ("axpby", (0.3, x, -1.7, y)), ("scal", (2.5, x))):
        host = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
        devs = [dev(gpu, a) if isinstance(a, np.ndarray) else a for a in args]
        getattr(CPU.ops, op)(*host)
        getattr(gpu.ops, op)(*devs)
        close(gpu.to_host(devs[-1]), host[-1])
    dx, dy_ = dev(gpu, x), dev(gpu, y)
    for op, a in (("asum", (x,)), ("sumsq", (x,)), ("dot", (x, y))):
        want = getattr(CPU.ops, op)(*a)
        got = getattr(gpu.ops, op)(*((dx,) if len(a) == 1 else (dx, dy_)))
        assert abs(got - want) <= 1e-9 * max(1.0, abs(want)) + 1e-6, (op, got, want)
    d = dev(gpu, x)
    gpu.ops.fill(d, 3.25)
    assert (gpu.to_host(d) == f32(3.25)).all()
    c = dev(gpu, np.zeros_like(x))
    gpu.ops.copy(dx, c)
    assert (gpu.to_host(c) == x).all()


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm(gpu, rng, ta, tb):
    m, n, k = 64, 500, 800
    a = randn(rng, *((k, m) if ta else (m, k)))
    b = randn(rng, *((n, k) if tb else (k, n)))
    c = randn(rng, m, n)
    hc = c.copy()
    CPU.ops.gemm(ta, tb, 0.5, a, b, 1.5, hc)
    dc = dev(gpu, c)
    gpu.ops.gemm(ta, tb, 0.5, dev(gpu, a), dev(gpu, b), 1.5, dc)
    close(gpu.to_host(dc), hc, rtol=1e-4, atol_scale=1e-5)


def test_bias_and_channel_ops(gpu, rng):
    outer, dim, inner = 16, 64, 196
    y, b = randn(rng, outer, dim, inner), randn(rng, dim)
    (yc, _), (yg, _) = run_both(gpu, "add_bias", [y, b], outer, dim, inner)
    close(yg, yc)
    (_, dbc), (_, dbg) = run_both(gpu, "bias_backward", [y, b], outer, dim, inner)
    close(dbg, dbc, rtol=1e-4)
    (_, _, yc), (_, _, yg) = run_both(gpu, "channel_mul", [y, b, np.zeros_like(y)], outer, dim, inner)
    close(yg, yc)
    for acc in (True, False):
        (_, _, dsc), (_, _, dsg) = run_both(gpu, "channel_mul_grad", [y, yc, b], outer, dim, inner, acc)
        close(dsg, dsc, rtol=1e-4)


@pytest.mark.parametrize("shape,kernel,stride,pad,group", [
    ((32, 64, 56, 56), (3, 3), (1, 1), (1, 1), 1),   # a ResNet 3x3 conv
    ((8, 3, 227, 227), (11, 11), (4, 4), (0, 0), 1),  # AlexNet conv1
    ((16, 32, 28, 28), (5, 5), (1, 1), (2, 2), 4),    # grouped
])
@pytest.mark.parametrize("graph", [True, False])
def test_conv(gpu, rng, shape, kernel, stride, pad, group, graph, monkeypatch):
    """Through cuDNN's graph API (execution plans; grouped convolutions stay on the legacy API) and the legacy one."""
    from superneurons.backend.cuda.device import current

    monkeypatch.setenv("SUPERNEURONS_CUDNN_GRAPH", "1" if graph else "0")
    current().cudnn._convs.clear()  # plans are cached per shape: set this one up under the setting above
    m = 64
    geom = ConvGeometry(kernel, stride, pad, (1, 1), group)
    oh, ow = geom.out_size(shape[2:])
    x = randn(rng, *shape)
    w = (randn(rng, m, shape[1] // group, *kernel) / np.sqrt(shape[1] // group * kernel[0] * kernel[1])).astype(f32)
    b = randn(rng, m)
    y = np.zeros((shape[0], m, oh, ow), f32)
    (_, _, _, yc), (_, _, _, yg) = run_both(gpu, "conv_forward", [x, w, b, y], geom)
    dy = randn(rng, *y.shape)
    dw0, db0 = randn(rng, *w.shape), randn(rng, m)  # accumulated into, as Caffe's param diffs are
    host = [x, w, dy, np.zeros_like(x), dw0.copy(), db0.copy()]
    CPU.ops.conv_backward(*host, geom)
    d = [dev(gpu, a) for a in (x, w, dy, np.zeros_like(x), dw0, db0)]
    gpu.ops.conv_backward(*d, geom)
    got = {"fwd": (yg, yc)} | {name: (gpu.to_host(d[i]), host[i]) for name, i in (("dx", 3), ("dw", 4), ("db", 5))}
    # Backward data adding into a gradient already held (a split blob's sum: beta = 1, its own plan).
    held = randn(rng, *x.shape)
    summed = dev(gpu, held)
    gpu.ops.conv_backward(d[0], d[1], d[2], summed, None, None, geom, accumulate_dx=True)
    got["dx+="] = (gpu.to_host(summed), held + host[3])
    # Backward filter overwriting dw (beta = 0, for a dw just cleared): the garbage in it must not count.
    fresh = np.zeros_like(w)
    CPU.ops.conv_backward(x, w, dy, None, fresh, None, geom)
    overwritten = dev(gpu, randn(rng, *w.shape))
    gpu.ops.conv_backward(d[0], d[1], d[2], None, overwritten, None, geom, overwrite_dw=True)
    got["dw="] = (gpu.to_host(overwritten), fresh)
    plan = current().cudnn.conv_plan(shape, w.shape, y.shape, geom, gpu_harness.STORAGE)
    assert [runner.graph for runner in plan.tables] == [graph and group == 1] * 5
    label = gpu.ops.conv_algorithm(shape, w.shape, y.shape, geom, gpu_harness.STORAGE)
    print(f"conv {shape} k{kernel} g{group} graph={graph} ({label}):", end="")  # the engines, before any check
    for name, (g, want) in got.items():
        print(f" {name} {close(g, want, rtol=1e-4, atol_scale=1e-4):.2e}", end="")
    print()


@pytest.mark.parametrize("choice", ["cudnn", "own", "auto"])
@pytest.mark.parametrize("channels,plane", [(16, 55), (512, 14)])
def test_conv_bias_gradient_by_either_kernel(gpu, rng, choice, channels, plane, monkeypatch):
    """db += the per-channel sum of dy, by cuDNN's call or our kernel (SUPERNEURONS_CONV_BIAS_SUM); `auto` takes
    ours on the large plane and cuDNN's on the small plane of many channels."""
    from superneurons.backend.cuda.ops.conv import own_bias_sum

    monkeypatch.setenv("SUPERNEURONS_CONV_BIAS_SUM", choice)
    assert own_bias_sum(channels, plane * plane) == {"cudnn": False, "own": True, "auto": plane == 55}[choice]
    geom = ConvGeometry((1, 1))
    x = randn(rng, 4, 8, plane, plane)
    w = randn(rng, channels, 8, 1, 1)
    dy = randn(rng, 4, channels, plane, plane)
    db0 = randn(rng, channels)
    want = db0.astype(np.float64) + dy.astype(np.float64).sum(axis=(0, 2, 3))
    db = dev(gpu, db0)
    gpu.ops.conv_backward(dev(gpu, x), dev(gpu, w), dev(gpu, dy), None, None, db, geom)
    close(gpu.to_host(db), want.astype(f32), rtol=1e-5, atol_scale=1e-5)


@pytest.mark.parametrize("method,kernel,stride,pad,ceil_extra,size", [
    ("max", (3, 3), (2, 2), (0, 0), True, 27), ("max", (2, 2), (2, 2), (0, 0), False, 27),
    ("max", (2, 2), (2, 2), (0, 0), False, 28),  # windows tiling the planes: max_backward_tiles
    ("ave", (3, 3), (2, 2), (1, 1), True, 27), ("stochastic", (3, 3), (2, 2), (0, 0), True, 27),
])
def test_pooling(gpu, rng, method, kernel, stride, pad, ceil_extra, size):
    n, c, h, w = 16, 32, size, size
    geom = PoolGeometry(method, kernel, stride, pad)
    oh = -(-(h + 2 * pad[0] - kernel[0]) // stride[0]) + 1 if ceil_extra else (h + 2 * pad[0] - kernel[0]) // stride[0] + 1
    x = randn(rng, n, c, h, w)
    if method == "stochastic":
        x = np.abs(x)
    y = np.zeros((n, c, oh, oh), f32)
    mask = np.zeros(y.shape, np.int32) if method == "max" else None
    (_, yc, mc), (_, yg, mg) = run_both(gpu, "pool_forward", [x, y, mask], geom)
    close(yg, yc)
    if method == "max":
        assert (mg == mc).all()
    if method == "stochastic":
        return
    dy = randn(rng, *y.shape)
    (_, _, dxc), (_, _, dxg) = run_both(gpu, "pool_backward", [dy, mc, np.zeros_like(x)], geom)
    close(dxg, dxc)
    if method == "max":  # taking the backward of a (leaky) ReLU before it: the mask signed, the gradient masked
        relu_out = np.where(x > 0.5, x, 0.1 * x).astype(f32)
        (_, _, sc), (_, _, sg) = run_both(gpu, "pool_forward", [relu_out, y, mask], geom, None, True)
        assert (sg == sc).all() and (sc < 0).any()
        (_, _, dxc), (_, _, dxg) = run_both(gpu, "pool_backward", [dy, sc, np.zeros_like(x)], geom, 0.1)
        close(dxg, dxc)


@pytest.mark.parametrize("across", [True, False])
def test_lrn(gpu, rng, across):
    geom = LRNGeometry(across, 5, 1e-2, 0.75, 2.0)
    x = randn(rng, 8, 64, 27, 27)
    (_, yc, sc), (_, yg, sg) = run_both(gpu, "lrn_forward", [x, np.zeros_like(x), np.zeros_like(x)], geom)
    close(yg, yc)
    close(sg, sc)
    dy = randn(rng, *x.shape)
    (*_, dxc), (*_, dxg) = run_both(gpu, "lrn_backward", [x, yc, sc, dy, np.zeros_like(x)], geom)
    close(dxg, dxc, rtol=1e-4)


@FLOAT32_VALUES
def test_softmax_and_loss(gpu, rng):
    outer, ch, inner = 64, 1000, 1
    x = randn(rng, outer, ch, inner) * 3
    (_, pc), (_, pg) = run_both(gpu, "softmax_forward", [x, np.zeros_like(x)])
    close(pg, pc, atol_scale=1e-6)
    d = dev(gpu, x)
    gpu.ops.softmax_forward(d, d)  # in place
    close(gpu.to_host(d), pc, atol_scale=1e-6)
    dy = randn(rng, *x.shape)
    (*_, dxc), (*_, dxg) = run_both(gpu, "softmax_backward", [pc, dy, np.zeros_like(x)])
    close(dxg, dxc, rtol=1e-4)
    label = rng.integers(0, ch, (outer, inner)).astype(f32)
    label[0, 0] = 7  # the ignored label
    for norm in ("VALID", "FULL", "BATCH_SIZE", "NONE"):
        loss_c = np.zeros((), f32)
        CPU.ops.softmax_loss_forward(pc, label, loss_c, 7, norm)
        loss_g = dev(gpu, np.zeros((), f32))
        gpu.ops.softmax_loss_forward(dev(gpu, pc), dev(gpu, label), loss_g, 7, norm)
        close(gpu.to_host(loss_g), loss_c)
        (*_, dxc), (*_, dxg) = run_both(gpu, "softmax_loss_backward",
                                        [pc, label, np.array(0.7, f32), np.zeros_like(pc)], 7, norm)
        close(dxg, dxc)
    for top_k in (1, 5):
        acc_c, per_c = np.zeros((), f32), np.zeros(ch, f32)
        CPU.ops.accuracy_forward(x, label, top_k, None, acc_c, per_c)
        acc_g, per_g = dev(gpu, np.zeros((), f32)), dev(gpu, np.zeros(ch, f32))
        gpu.ops.accuracy_forward(dev(gpu, x), dev(gpu, label), top_k, None, acc_g, per_g)
        close(gpu.to_host(acc_g), acc_c)
        close(gpu.to_host(per_g), per_c)
    from superneurons.errors import UserError

    bad = label.copy()
    bad[3, 0], bad[5, 0] = ch + 2, -1  # two bad labels; the first in memory order is named
    check = gpu.ops.softmax_loss_forward(dev(gpu, pc), dev(gpu, bad), dev(gpu, np.zeros((), f32)), None, "VALID")
    with pytest.raises(UserError, match=rf"^2 label\(s\) outside the {ch} classes \[0, {ch}\), e.g. {ch + 2}$"):
        check()  # the verdict is read when asked for, not at the forward
    good = gpu.ops.softmax_loss_forward(dev(gpu, pc), dev(gpu, label), dev(gpu, np.zeros((), f32)), 7, "VALID")
    good()  # no error


def test_dropout_bit_identical(gpu, rng):
    x = randn(rng, 64, 4096)
    for it in (0, 17):
        (_, yc), (_, yg) = run_both(gpu, "dropout_apply", [x, np.zeros_like(x)], 0.5, 1701, it, 12)
        assert np.array_equal(yg, yc)
        assert 0.45 < (yc != 0).mean() < 0.55


@FLOAT32_VALUES
def test_a_launch_with_new_scalars_reuses_its_recorded_block(gpu, rng):
    """The fast launch path keys a launch by its arrays and its scalars' types and writes the scalars' values
    at each launch: dropout on the same arrays in successive iterations (a new pass key in its device word each
    time) and with another ratio (a new threshold and float32 scale) reuses one recorded block and matches the
    CPU bit for bit."""
    from superneurons.backend.cuda import kernels as K
    from superneurons.backend.cuda.kernels import dropout as dk

    x = randn(rng, 8, 1000)
    src, dst = dev(gpu, x), dev(gpu, np.zeros_like(x))
    for iteration, ratio in ((0, 0.5), (1, 0.5), (2, 0.3), (3, 0.5)):
        gpu.ops.dropout_apply(src, dst, ratio, 1701, iteration, 12)
        want = np.zeros_like(x)
        CPU.ops.dropout_apply(x, want, ratio, 1701, iteration, 12)
        assert np.array_equal(gpu.to_host(dst), want), (iteration, ratio)
    launcher = K.launch(dk.dropout_apply, x.size)
    if K.FAST:
        assert len(launcher.blocks) == 1


def test_batch_norm(gpu, rng):
    outer, ch, inner = 32, 64, 28 * 28
    x = randn(rng, outer, ch, inner) * 2 + 1
    c = lambda: np.zeros(ch, f32)  # noqa: E731
    (_, mc, vc), (_, mg, vg) = run_both(gpu, "bn_batch_stats", [x, c(), c()], outer, ch, inner)
    close(mg, mc, rtol=1e-4)
    close(vg, vc, rtol=1e-4)
    sums = [randn(rng, ch), np.abs(randn(rng, ch)), np.array([3.0], f32)]
    (ms, vs, sf, _, _), (ms_g, vs_g, sf_g, _, _) = run_both(gpu, "bn_running_update", sums + [mc, vc], 0.999, 1.001)
    close(ms_g, ms)
    close(vs_g, vs)
    close(sf_g, sf)
    (*_, gm, gv), (*_, gm_g, gv_g) = run_both(gpu, "bn_global_stats", [ms, vs, sf, c(), c()])
    close(gm_g, gm)
    close(gv_g, gv)
    host = [x, mc, vc, 1e-5, c(), np.zeros_like(x)]
    CPU.ops.bn_normalize(*host, outer, ch, inner)
    d = [dev(gpu, a) if isinstance(a, np.ndarray) else a for a in [x, mc, vc, 1e-5, c(), np.zeros_like(x)]]
    gpu.ops.bn_normalize(*d, outer, ch, inner)
    close(gpu.to_host(d[4]), host[4])
    close(gpu.to_host(d[5]), host[5], rtol=1e-4)
    dy = randn(rng, *x.shape)
    (*_, dxc), (*_, dxg) = run_both(gpu, "bn_backward", [x, mc, host[4], dy, np.zeros_like(x)], outer, ch, inner)
    close(dxg, dxc, rtol=1e-3, atol_scale=1e-4)


@FLOAT32_VALUES
@pytest.mark.parametrize("dims", [(32, 64, 28 * 28), (16, 256, 7 * 7), (24, 512, 14 * 14), (8, 32, 56 * 56 + 5)])
@pytest.mark.parametrize("relu,global_stats", [(True, False), (False, False), (True, True)])
def test_fused_batch_norm_scale_relu(gpu, rng, dims, relu, global_stats):
    """bn_affine_forward/backward against test_fusion's independent float64 reference; the last planes are
    long enough for the plain-sweep kernels (SUPERNEURONS_BN_ROWS_MIN), with a partial last trip; the
    256- and 512-channel shapes run the one-block-per-channel kernels (SUPERNEURONS_BN_CHANNEL_MIN)."""
    from test_fusion import reference, reference_backward

    outer, ch, inner = dims
    x = randn(rng, outer, ch, inner) * 2 + 0.5
    gamma, beta = randn(rng, ch), randn(rng, ch)
    running = [np.abs(randn(rng, ch)), np.abs(randn(rng, ch)) + 0.5, np.array([2.0], f32)]
    stats64 = (running[0].astype(np.float64) / 2, running[1].astype(np.float64) / 2) if global_stats else None
    want, x_hat, mean, var = reference(x.astype(np.float64), gamma.astype(np.float64), beta.astype(np.float64), relu,
                                       stats64)
    d = {k: dev(gpu, a) for k, a in dict(x=x, y=np.zeros_like(x), x_hat=np.zeros_like(x), mean=np.zeros(ch, f32),
                                         var=np.zeros(ch, f32), inv=np.zeros(ch, f32), gamma=gamma, beta=beta,
                                         ms=running[0], vs=running[1], sf=running[2]).items()}
    slope = 0.0 if relu else None
    gpu.ops.bn_affine_forward(d["x"], d["x"], d["x_hat"], d["mean"], d["var"], d["inv"], d["gamma"], d["beta"],
                              d["ms"], d["vs"], d["sf"], outer, ch, inner, 1e-5, global_stats, True, 0.9, 1.25, slope)
    close(gpu.to_host(d["x"]), want, rtol=1e-4, atol_scale=1e-5)  # in place, as in ResNet
    close(gpu.to_host(d["x_hat"]), x_hat, rtol=1e-4, atol_scale=1e-5)
    inv_std = 1 / np.sqrt(var + 1e-5)
    close(gpu.to_host(d["inv"]), inv_std, rtol=1e-5)
    if not global_stats:
        close(gpu.to_host(d["ms"]), 0.9 * running[0] + mean, rtol=1e-5)
        close(gpu.to_host(d["vs"]), 0.9 * running[1] + 1.25 * var, rtol=1e-5)
        assert gpu.to_host(d["sf"])[0] == np.float32(2.0 * 0.9 + 1)
    dy = randn(rng, outer, ch, inner)
    if relu:  # where the pre-activation is within rounding of 0 the mask may go either way: no gradient there
        g64, b64 = gamma.astype(np.float64)[None, :, None], beta.astype(np.float64)[None, :, None]
        dy[np.abs(g64 * x_hat + b64) < 1e-4 * (np.abs(g64 * x_hat) + np.abs(b64))] = 0
    want_dx, want_dg, want_db = reference_backward(x_hat, gamma.astype(np.float64), beta.astype(np.float64),
                                                   dy.astype(np.float64), relu, inv_std, not global_stats)
    dg0, db0 = randn(rng, ch), randn(rng, ch)  # param diffs accumulate
    ddy, ddg, ddb = dev(gpu, dy), dev(gpu, dg0), dev(gpu, db0)
    gpu.ops.bn_affine_backward(d["x_hat"], None, d["inv"], d["gamma"], d["beta"], ddy, ddy, ddg, ddb, outer, ch,
                               inner, global_stats, slope)
    err = close(gpu.to_host(ddy), want_dx, rtol=1e-3, atol_scale=1e-4)
    close(gpu.to_host(ddg), dg0 + want_dg, rtol=1e-4, atol_scale=1e-4)
    close(gpu.to_host(ddb), db0 + want_db, rtol=1e-4, atol_scale=1e-4)
    # From the kept input x instead of x_hat (the BatchNorm out of place): x_hat normalized again, the same bits.
    xdy, xdg, xdb = dev(gpu, dy), dev(gpu, dg0), dev(gpu, db0)
    gpu.ops.bn_affine_backward(dev(gpu, x), d["mean"], d["inv"], d["gamma"], d["beta"], xdy, xdy, xdg, xdb, outer,
                               ch, inner, global_stats, slope)
    for a, b in ((xdy, ddy), (xdg, ddg), (xdb, ddb)):
        np.testing.assert_array_equal(gpu.to_host(a), gpu.to_host(b))
    print(f"fused bn {dims} relu={relu} global={global_stats}: max |dx err| {err:.2e}")


class RecordingWorkspace:
    """A WorkspaceSource with a settable budget that records what convolutions acquire."""

    def __init__(self, budget: int):
        from numba import cuda

        self.budget = budget
        self.buf = cuda.device_array(max(budget, 1), np.uint8)
        self.acquired: list[int] = []
        self.held = False
        self.borrowed: list[int] = []  # cuDNN's measuring outputs, one per accumulating direction measured
        self.lent = None

    def available(self) -> int:
        return self.budget

    def acquire(self, nbytes: int) -> int:
        assert not self.held and nbytes <= self.budget
        self.held = True
        self.acquired.append(nbytes)
        return self.buf.device_ctypes_pointer.value

    def release(self) -> None:
        assert self.held
        self.held = False

    def borrow(self, nbytes: int) -> int:
        from numba import cuda

        self.borrowed.append(nbytes)
        self.lent = cuda.device_array(max(nbytes, 1), np.uint8)
        return self.lent.device_ctypes_pointer.value

    def give_back(self) -> None:
        self.lent = None


@pytest.mark.parametrize("find", [True, False])
@pytest.mark.parametrize("budget", [0, 64 << 20])
def test_conv_algorithms_respect_the_workspace_source(gpu, rng, budget, find, monkeypatch):
    from superneurons.backend.cuda import cudnn
    from superneurons.backend.cuda.device import current

    monkeypatch.setenv("SUPERNEURONS_CUDNN_FIND", "1" if find else "0")
    current().cudnn._convs.clear()  # plans are cached per shape: this budget's are made afresh
    shape, m = (16, 32, 28, 28), 48
    geom = ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), 1)
    x = randn(rng, *shape)
    w = (randn(rng, m, shape[1], 3, 3) / np.sqrt(shape[1] * 9)).astype(f32)
    y = np.zeros((16, m, 28, 28), f32)
    source = RecordingWorkspace(budget)
    gpu.set_workspace_source(source)
    try:
        (_, _, _, yc), (_, _, _, yg) = run_both(gpu, "conv_forward", [x, w, None, y], geom)
        close(yg, yc, rtol=1e-4, atol_scale=1e-4)
        dy, dw0 = randn(rng, *y.shape), randn(rng, *w.shape)
        host = [x, w, dy, np.zeros_like(x), dw0.copy(), None]
        CPU.ops.conv_backward(*host, geom)
        d = [dev(gpu, a) for a in (x, w, dy, np.zeros_like(x), dw0)] + [None]
        gpu.ops.conv_backward(*d, geom)
        close(gpu.to_host(d[3]), host[3], rtol=1e-4, atol_scale=1e-4)
        close(gpu.to_host(d[4]), host[4], rtol=1e-4, atol_scale=1e-4)  # dw accumulated once (Find used a scratch)
        assert all(n <= budget for n in source.acquired) and not source.held and source.lent is None
        assert source.borrowed == ([d[4].nbytes] if find else [])  # backward data here sets dx, it does not add
        plan = current().cudnn.conv_plan(shape, w.shape, y.shape, geom, gpu_harness.STORAGE)
        ran = [cudnn.FORWARD, cudnn.BACKWARD_DATA, cudnn.BACKWARD_FILTER]  # not the adding backward data
        assert all(plan.tables[d] is not None and plan.tables[d].measured == find for d in ran)
        assert all(plan.last[d].workspace <= budget for d in ran)
        label = gpu.ops.conv_algorithm(shape, w.shape, y.shape, geom, gpu_harness.STORAGE)
        assert label.startswith("f:") and "-" not in label and ("~" in label) != find
        print(f"budget {budget >> 20} MiB, find={find}: {label}")
    finally:
        gpu.set_workspace_source(None)
    assert current().workspace_source is current().default_workspace
    assert cudnn.FORWARD == 0


def test_concat_and_eltwise(gpu, rng):
    a, b = randn(rng, 8, 16, 14, 14), randn(rng, 8, 48, 14, 14)
    top = np.zeros((8, 64, 14, 14), f32)
    host_top = top.copy()
    CPU.ops.concat_forward([a, b], host_top, 1)
    dt = dev(gpu, top)
    gpu.ops.concat_forward([dev(gpu, a), dev(gpu, b)], dt, 1)
    assert np.array_equal(gpu.to_host(dt), host_top)
    (_, db_c), (_, db_g) = run_both(gpu, "concat_backward", [host_top, np.zeros_like(b)], 1, 16)
    assert np.array_equal(db_g, db_c)
    xs = [randn(rng, 16, 64, 28) for _ in range(3)]
    dxs = [dev(gpu, x) for x in xs]
    for op, extra in (("eltwise_sum", ([1.0, -0.5, 2.0],)), ("eltwise_prod", ())):
        hc, dg = np.zeros_like(xs[0]), dev(gpu, np.zeros_like(xs[0]))
        getattr(CPU.ops, op)(xs, *extra, hc)
        getattr(gpu.ops, op)(dxs, *extra, dg)
        close(gpu.to_host(dg), hc)
    hc, am = np.zeros_like(xs[0]), np.zeros(xs[0].shape, np.int32)
    CPU.ops.eltwise_max(xs, hc, am)
    dg, dam = dev(gpu, np.zeros_like(xs[0])), dev(gpu, np.zeros(xs[0].shape, np.int32))
    gpu.ops.eltwise_max(dxs, dg, dam)
    assert np.array_equal(gpu.to_host(dg), hc) and np.array_equal(gpu.to_host(dam), am)
    td = randn(rng, *xs[0].shape)
    for i in range(3):
        want = np.zeros_like(td)
        CPU.ops.eltwise_max_backward(td, am, i, want)
        got = dev(gpu, np.zeros_like(td))
        gpu.ops.eltwise_max_backward(dev(gpu, td), dam, i, got)
        assert np.array_equal(gpu.to_host(got), want)
        for stable in (True, False):
            prod = xs[0] * xs[1] * xs[2]
            want = np.zeros_like(td)
            CPU.ops.eltwise_prod_backward(xs, i, prod, td, want, stable)
            got = dev(gpu, np.zeros_like(td))
            gpu.ops.eltwise_prod_backward(dxs, i, dev(gpu, prod), dev(gpu, td), got, stable)
            close(gpu.to_host(got), want, rtol=1e-4)


@pytest.mark.parametrize("in_place", [False, True])
def test_eltwise_sum_relu(gpu, rng, in_place):
    """The fused Eltwise SUM + ReLU (graph/fuse.py) at a ResNet join's size; in place, the top is bottom 0 and
    the last gradient is the top gradient itself, as the layer calls the ops. Backward gets the CPU's top on
    both sides: an FMA-rounded sum near 0 could flip a mask element."""
    shape, coeffs, slope = (16, 64, 28, 28), [1.0, -0.5], 0.0
    a, b, dy = randn(rng, *shape), randn(rng, *shape), randn(rng, *shape)
    sides = ((CPU.ops, np.copy, np.asarray), (gpu.ops, lambda x: dev(gpu, x), gpu.to_host))
    tops, grads = [], []
    for ops, put, get in sides:
        xs = [put(a), put(b)]
        top = xs[0] if in_place else put(np.zeros_like(a))
        ops.eltwise_sum_relu(xs, coeffs, top, slope)
        tops.append(get(top))
    close(tops[1], tops[0])
    stored = np.asarray(gpu.to_host(dev(gpu, tops[0])), np.float32)  # a float16 top flushes tiny sums to 0
    for ops, put, get in sides:
        d = put(dy)
        outs = [put(np.zeros_like(dy)), d if in_place else put(np.zeros_like(dy))]
        ops.eltwise_sum_relu_backward(put(stored), d, coeffs[::-1], outs, slope)
        grads.append([get(o) for o in outs])
    for got, want in zip(*grads[::-1]):
        assert np.array_equal(got, np.asarray(want).astype(got.dtype))  # a mask and one product each: exact


@pytest.mark.parametrize("rule", ["sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam"])
def test_solver_updates(gpu, rng, rule):
    n = 100_000
    w, g = randn(rng, n), randn(rng, n)
    hist = [np.abs(randn(rng, n)) for _ in range(2)]
    scalars = {"sgd": (0.01, 0.9), "nesterov": (0.01, 0.9), "adagrad": (0.01, 1e-8), "rmsprop": (0.01, 0.98, 1e-8),
               "adadelta": (1.0, 0.95, 1e-6), "adam": (0.001, 0.9, 0.999, 1e-8, 7)}[rule]
    n_hist = 2 if rule in ("adadelta", "adam") else 1
    host, got = run_both(gpu, f"{rule}_update", [w, g] + hist[:n_hist], *scalars)
    for h, d in zip(host, got):
        close(d, h, rtol=1e-5, atol_scale=1e-6)
    for l1 in (False, True):
        (_, gc), (_, gg) = run_both(gpu, "regularize", [w, g], 5e-4, l1)
        close(gg, gc)


NETS = {
    "lenet": 'name: "LeNet"\n' + dummy_images(64, 1, 28, 28) + """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "xavier" } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 50 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 500 weight_filler { type: "xavier" } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
""",
    "small_convnet": 'name: "SmallConv"\n' + dummy_images(16, 3, 32, 32) + """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2a" type: "Convolution" bottom: "pool1" top: "conv2a"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 group: 2 weight_filler { type: "msra" } } }
layer { name: "conv2b" type: "Convolution" bottom: "pool1" top: "conv2b"
  convolution_param { num_output: 32 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "sum" type: "Eltwise" bottom: "conv2a" bottom: "conv2b" top: "sum" }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "pool1" top: "cat" }
layer { name: "tanh" type: "TanH" bottom: "cat" top: "cat" }
layer { name: "pool2" type: "Pooling" bottom: "cat" top: "pool2" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip" inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
""",
}


@pytest.mark.parametrize("name", sorted(NETS))
def test_net_forward_backward_matches_cpu(gpu, name):
    assert_param_grads_match(*one_iteration_on_both(gpu, NETS[name]), name)
