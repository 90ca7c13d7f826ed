"""The GPU kernels of the LSTM cell (kernels/recurrent.py through ops/recurrent.py) and of Im2col
(kernels/im2col.py) under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), against the CPU ops on fresh random
inputs: their index math on machines without a GPU.

The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them. Skipped without numba-cuda.
"""
from __future__ import annotations


import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import simulated  # noqa: E402

from superneurons.backend.cpu import CpuBackend  # noqa: E402
from superneurons.backend.cuda import kernels as K  # noqa: E402
from superneurons.backend.cuda.kernels import im2col as ik  # noqa: E402
from superneurons.backend.geometry import ConvGeometry  # noqa: E402

CPU = CpuBackend().ops


def _dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


@simulated
@pytest.mark.parametrize("n,hidden", [(3, 2), (1, 5)])
def test_lstm_unit_matches_cpu(rng, n, hidden):
    from superneurons.backend.cuda.ops import recurrent as g

    c_prev, x = rng.standard_normal((1, n, hidden)), 2 * rng.standard_normal((1, n, 4 * hidden))
    cont = np.where(rng.random((1, n)) < 0.5, 0.0, 1.0)
    c, h = np.zeros((1, n, hidden)), np.zeros((1, n, hidden))
    CPU.lstm_unit_forward(c_prev, x, cont, c, h)
    gc, gh = _dev(np.full_like(c, np.nan)), _dev(np.full_like(h, np.nan))
    g.lstm_unit_forward(_dev(c_prev), _dev(x), _dev(cont), gc, gh)
    np.testing.assert_allclose(gc.copy_to_host(), c, rtol=1e-12)
    np.testing.assert_allclose(gh.copy_to_host(), h, rtol=1e-12)
    dc, dh = rng.standard_normal(c.shape), rng.standard_normal(h.shape)
    dc_prev, dx = np.zeros_like(c_prev), np.zeros_like(x)
    CPU.lstm_unit_backward(c_prev, x, cont, dc, dh, dc_prev, dx)
    g_dc_prev, g_dx = _dev(np.full_like(c_prev, np.nan)), _dev(np.full_like(x, np.nan))
    g.lstm_unit_backward(_dev(c_prev), _dev(x), _dev(cont), _dev(dc), _dev(dh), g_dc_prev, g_dx)
    np.testing.assert_allclose(g_dc_prev.copy_to_host(), dc_prev, rtol=1e-12)
    np.testing.assert_allclose(g_dx.copy_to_host(), dx, rtol=1e-12)
    g_dx = _dev(np.full_like(x, np.nan))  # one of the two gradients only
    g.lstm_unit_backward(_dev(c_prev), _dev(x), _dev(cont), _dev(dc), _dev(dh), None, g_dx)
    np.testing.assert_allclose(g_dx.copy_to_host(), dx, rtol=1e-12)


@simulated
@pytest.mark.parametrize("geom,hw", [(ConvGeometry((3, 3), (1, 1), (1, 1)), (4, 5)),
                                     (ConvGeometry((2, 3), (2, 1), (0, 2), (2, 1)), (7, 4))])
def test_im2col_kernels_match_cpu(rng, geom, hw):
    """The kernels with the arguments ops/conv.py's im2col_forward/backward pass them."""
    x = rng.standard_normal((2, 3) + hw)
    oh, ow = geom.out_size(hw)
    col = np.zeros((2, 3 * geom.kernel[0] * geom.kernel[1], oh, ow))
    CPU.im2col_forward(x, col, geom)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom.kernel, geom.stride, geom.pad, geom.dilation
    window = (kh, kw, sh, sw, ph, pw, dh, dw)
    g_col = _dev(np.full(col.size, np.nan))
    K.launch(ik.im2col, col.size)(_dev(x.reshape(-1)), g_col, 3, hw[0], hw[1], oh, ow, *window)
    np.testing.assert_array_equal(g_col.copy_to_host().reshape(col.shape), col)
    dcol, dx = rng.standard_normal(col.shape), np.zeros_like(x)
    CPU.im2col_backward(dcol, dx, geom)
    g_dx = _dev(np.full(x.size, np.nan))
    K.launch(ik.col2im, x.size)(_dev(dcol.reshape(-1)), g_dx, 3, hw[0], hw[1], oh, ow, *window)
    np.testing.assert_allclose(g_dx.copy_to_host().reshape(x.shape), dx, rtol=1e-12, atol=1e-14)
