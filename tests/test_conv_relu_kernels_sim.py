"""The CUDA side of the Convolution + ReLU fusion under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), no GPU needed:
the bias + ReLU pass of kernels/conv_relu.py against NumPy float64 on fresh random inputs, on planes smaller
than a block, longer than one, and long enough for the plain sweep, with one and several blocks per channel;
and the op conv_relu_forward's host logic (bias or none) with cuDNN's plan replaced by the CPU convolution.

The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them. Skipped without numba-cuda.
"""
from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import simulated  # noqa: E402


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
@pytest.mark.parametrize("kernel,shape", [(ck.bias_relu, (5, 3, 2, 3)), (ck.bias_relu_rows, (3, 2, 1, 1100))])
@pytest.mark.parametrize("chunk", [1, 2])
def test_kernels_with_several_blocks_per_channel(rng, kernel, shape, chunk):
    """Each channel's planes split over blocks (the last one short when chunk does not divide N): every block
    covers only its own planes, with its channel's bias."""
    n, c, inner = shape[0], shape[1], shape[2] * shape[3]
    blocks = c * -(-n // chunk)
    y, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    d = cuda.to_device(y.reshape(-1))
    K.launch(kernel, 0, blocks=blocks)(d, cuda.to_device(b), n, c, inner, chunk, np.float32(0.1))
    pre = y.astype(np.float64) + b.astype(np.float64).reshape(1, -1, 1, 1)
    out = d.copy_to_host().reshape(shape)
    np.testing.assert_allclose(out, np.where(pre > 0, pre, pre * 0.1), rtol=1e-6, atol=1e-6)


# ---- the ops, cuDNN's plan replaced by the CPU convolution ----------------------------------------------

class HostPlan:
    """Stands in for cudnn.ConvPlan's forward: the CPU convolution on host copies of the simulator's arrays
    (what matters here is what the fused op does after cuDNN's call)."""

    def __init__(self, geom: ConvGeometry):
        self.geom = geom

    def forward(self, x, w, y):
        out = np.empty(y.shape, np.float32)
        CPU.conv_forward(x.copy_to_host(), w.copy_to_host(), None, out, self.geom)
        y.copy_to_device(out)


@pytest.fixture
def host_plans(monkeypatch):
    device = types.SimpleNamespace(cudnn=types.SimpleNamespace(
        conv_plan=lambda x_shape, w_shape, y_shape, geom, dtype: HostPlan(geom)),
        workspace_from=lambda workspace: contextlib.nullcontext())  # host plans take no workspace
    monkeypatch.setattr(gconv, "current", lambda: device)


@simulated
@pytest.mark.parametrize("slope", [0.0, 0.25])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_forward_op_matches_the_cpu_op(rng, host_plans, slope, bias):
    """The convolution, then bias + ReLU (or the ReLU alone) in place; against the CPU fused op (which
    test_conv_relu_fusion.py checks against the unfused ops and float64)."""
    geom = ConvGeometry((3, 3), (1, 1), (1, 1))
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    w = (rng.standard_normal((4, 3, 3, 3)) / 5).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32) if bias else None
    y_shape = (2, 4, 6, 5)
    y_cpu = np.empty(y_shape, np.float32)
    CPU.conv_relu_forward(x, w, b, y_cpu, geom, slope)
    d_y = cuda.to_device(np.full(y_shape, np.nan, np.float32))
    gconv.conv_relu_forward(cuda.to_device(x), cuda.to_device(w), None if b is None else cuda.to_device(b), d_y,
                            geom, slope)
    np.testing.assert_allclose(d_y.copy_to_host(), y_cpu, rtol=1e-6, atol=1e-6)
