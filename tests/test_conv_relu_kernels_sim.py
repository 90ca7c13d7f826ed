"""The CUDA side of the Convolution + ReLU fusion under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), no GPU needed:
the passes of kernels/conv_relu.py (bias + ReLU forward; ReLU mask + per-channel bias-gradient sum backward)
against NumPy float64 on fresh random inputs, on planes smaller than a block, longer than one, and long enough
for the plain sweep, with one and several blocks per channel; and the ops conv_relu_forward/backward's host logic
(bias or none, our bias sum or cuDNN's, gradients skipped) with cuDNN's plan replaced by the CPU convolution.

A normal run (no NUMBA_ENABLE_CUDASIM) has one test: it reruns this file in a child process with the simulator
on, so this process's numba stays real for the other test files. Skipped without numba-cuda.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import IN_SIMULATOR, rerun_under_simulator, simulated  # noqa: E402


if not IN_SIMULATOR:
    def test_conv_relu_kernels_under_simulator():
        rerun_under_simulator(__file__)


from superneurons.backend.cpu import CpuBackend  # noqa: E402
from superneurons.backend.cuda import kernels as K  # noqa: E402
from superneurons.backend.cuda.kernels import conv_relu as ck  # noqa: E402
from superneurons.backend.cuda.ops import conv as gconv  # noqa: E402
from superneurons.backend.geometry import ConvGeometry  # noqa: E402

CPU = CpuBackend().ops

# (N, C, H, W): a plane of one element; planes shorter than a block (several per block); longer than a block
# but below ck.ROWS_MIN (the general walk wraps within a plane); at least ROWS_MIN (the plain sweep), one with
# a tail shorter than a block.
SHAPES = [(3, 2, 1, 1), (3, 2, 5, 7), (2, 3, 10, 30), (2, 2, 32, 40), (1, 2, 37, 29)]


def _y_with_zeros(rng, shape):
    """Random values with exact zeros among them (the mask's boundary: y > 0 is false at 0)."""
    y = rng.standard_normal(shape).astype(np.float32)
    y.reshape(-1)[:: 7] = 0.0
    return y


def _masked32(y, dy, slope):
    """Caffe's ReLU gradient in float32: dy where y > 0, else dy * slope."""
    return np.where(y > 0, dy, dy * np.float32(slope))


@simulated
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_bias_relu_matches_float64(rng, shape, slope):
    y = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    d = cuda.to_device(y)
    gconv.bias_relu(d, cuda.to_device(b), shape[0], shape[1], shape[2] * shape[3], slope)
    pre = y.astype(np.float64) + b.astype(np.float64).reshape(1, -1, 1, 1)
    np.testing.assert_allclose(d.copy_to_host(), np.where(pre > 0, pre, pre * slope), rtol=1e-6, atol=1e-6)


@simulated
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_relu_mask_bias_sum_matches_float64(rng, shape, slope):
    """dy masked in place; db += the float64 per-channel sum of the masked dy (db holds values: it accumulates)."""
    y, dy = _y_with_zeros(rng, shape), rng.standard_normal(shape).astype(np.float32)
    db0 = rng.standard_normal(shape[1]).astype(np.float32)
    d_dy, d_db = cuda.to_device(dy), cuda.to_device(db0)
    gconv.relu_mask_bias_sum(cuda.to_device(y), d_dy, d_db, shape[0], shape[1], shape[2] * shape[3], slope)
    np.testing.assert_array_equal(d_dy.copy_to_host(), _masked32(y, dy, slope))
    want = db0.astype(np.float64) + np.where(y > 0, dy, dy * slope).astype(np.float64).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(d_db.copy_to_host(), want, rtol=1e-6, atol=1e-6)


@simulated
@pytest.mark.parametrize("kernels,shape", [((ck.bias_relu, ck.relu_mask_sum), (5, 3, 2, 3)),
                                           ((ck.bias_relu_rows, ck.relu_mask_sum_rows), (3, 2, 1, 1100))])
@pytest.mark.parametrize("chunk", [1, 2])
def test_kernels_with_several_blocks_per_channel(rng, kernels, shape, chunk):
    """Each channel's planes split over blocks (the last one short when chunk does not divide N): every block
    covers only its own planes, and the channel's partial sums add up (atomics into float64 sums)."""
    forward, backward = kernels
    n, c, inner = shape[0], shape[1], shape[2] * shape[3]
    blocks = c * -(-n // chunk)
    y, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    d = cuda.to_device(y.reshape(-1))
    K.launch(forward, 0, blocks=blocks)(d, cuda.to_device(b), n, c, inner, chunk, np.float32(0.1))
    pre = y.astype(np.float64) + b.astype(np.float64).reshape(1, -1, 1, 1)
    out = d.copy_to_host().reshape(shape)
    np.testing.assert_allclose(out, np.where(pre > 0, pre, pre * 0.1), rtol=1e-6, atol=1e-6)

    dy = rng.standard_normal(shape).astype(np.float32)
    d_dy, sums = cuda.to_device(dy.reshape(-1)), cuda.to_device(np.zeros(c))
    K.launch(backward, 0, blocks=blocks)(cuda.to_device(out.reshape(-1)), d_dy, sums, n, c, inner, chunk,
                                         np.float32(0.1))
    masked = _masked32(out, dy, 0.1)
    np.testing.assert_array_equal(d_dy.copy_to_host().reshape(shape), masked)
    np.testing.assert_allclose(sums.copy_to_host(), masked.astype(np.float64).sum(axis=(0, 2, 3)), rtol=1e-12)


# ---- the ops, cuDNN's plan replaced by the CPU convolution ----------------------------------------------

class HostPlan:
    """Stands in for cudnn.ConvPlan: each call runs the CPU convolution on host copies of the simulator's
    arrays (what matters here is what the fused ops do around cuDNN's calls)."""

    def __init__(self, geom: ConvGeometry):
        self.geom = geom

    def forward(self, x, w, y):
        out = np.empty(y.shape, np.float32)
        CPU.conv_forward(x.copy_to_host(), w.copy_to_host(), None, out, self.geom)
        y.copy_to_device(out)

    def backward_bias(self, dy, db):
        db.copy_to_device(db.copy_to_host() + dy.copy_to_host().sum(axis=(0, 2, 3)))

    def backward_filter(self, x, dy, dw, accumulate=True):
        got = dw.copy_to_host()
        h_x = x.copy_to_host()
        CPU.conv_backward(h_x, np.zeros(dw.shape, np.float32), dy.copy_to_host(), None, got, None, self.geom,
                          overwrite_dw=not accumulate)
        dw.copy_to_device(got)

    def backward_data(self, w, dy, dx, accumulate=False):
        got = dx.copy_to_host()
        CPU.conv_backward(np.zeros(dx.shape, np.float32), w.copy_to_host(), dy.copy_to_host(), got, None, None,
                          self.geom, accumulate_dx=accumulate)
        dx.copy_to_device(got)


@pytest.fixture
def host_plans(monkeypatch):
    device = types.SimpleNamespace(cudnn=types.SimpleNamespace(
        conv_plan=lambda x_shape, w_shape, y_shape, geom, dtype: HostPlan(geom)))
    monkeypatch.setattr(gconv, "current", lambda: device)


@simulated
@pytest.mark.parametrize("slope", [0.0, 0.25])
@pytest.mark.parametrize("bias_sum", ["own", "cudnn"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dx_wanted", [True, False])
def test_fused_ops_match_the_cpu_ops(rng, host_plans, monkeypatch, slope, bias_sum, bias, dx_wanted):
    """Forward: the convolution, then bias + ReLU (or the ReLU alone) in place. Backward: the mask in place (with
    the bias sum where ours is chosen), then the gradients of the masked dy; against the CPU fused op (which
    test_conv_relu_fusion.py checks against the unfused ops and float64)."""
    monkeypatch.setenv("SUPERNEURONS_CONV_BIAS_SUM", bias_sum)
    geom = ConvGeometry((3, 3), (1, 1), (1, 1))
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    w = (rng.standard_normal((4, 3, 3, 3)) / 5).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32) if bias else None
    y_shape = (2, 4, 6, 5)
    y_cpu = np.empty(y_shape, np.float32)
    CPU.conv_relu_forward(x, w, b, y_cpu, geom, slope)
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    d_y = cuda.to_device(np.full(y_shape, np.nan, np.float32))
    gconv.conv_relu_forward(d_x, d_w, None if b is None else cuda.to_device(b), d_y, geom, slope)
    np.testing.assert_allclose(d_y.copy_to_host(), y_cpu, rtol=1e-6, atol=1e-6)

    dy = rng.standard_normal(y_shape).astype(np.float32)
    held = [rng.standard_normal(s).astype(np.float32) for s in (x.shape, w.shape, (4,))]
    host = [dy.copy(), held[0].copy() if dx_wanted else None, held[1].copy(), held[2].copy() if bias else None]
    CPU.conv_relu_backward(x, w, host[0], host[1], host[2], host[3], geom, y_cpu, slope, overwrite_dw=False)
    dev = [None if a is None else cuda.to_device(a) for a in
           (dy, held[0] if dx_wanted else None, held[1], held[2] if bias else None)]
    gconv.conv_relu_backward(d_x, d_w, *dev, geom, cuda.to_device(y_cpu), slope, overwrite_dw=False)
    names = ("masked dy", "dx", "dw", "db")
    for want, got, name in zip(host, dev, names):
        assert (want is None) == (got is None), name
        if want is not None:
            np.testing.assert_allclose(got.copy_to_host(), want, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(dev[0].copy_to_host(), host[0])  # the mask: one float32 op, either way
