"""The Deconvolution layer (layers/deconvolution.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.layers.base import NEEDS_BOTTOM


def _deconv_ref(x, w, b, stride, pad, group):
    """Direct scatter: every input pixel adds its value times the kernel into the (padded) output."""
    n, c, h, wd = x.shape
    mg, kh, kw = w.shape[1:]
    m = mg * group
    oh, ow = stride * (h - 1) + kh - 2 * pad, stride * (wd - 1) + kw - 2 * pad
    full = np.zeros((n, m, oh + 2 * pad, ow + 2 * pad))
    cg = c // group
    for i in range(n):
        for ci in range(c):
            g = ci // cg
            for yy in range(h):
                for xx in range(wd):
                    full[i, g * mg:(g + 1) * mg, yy * stride:yy * stride + kh, xx * stride:xx * stride + kw] += \
                        x[i, ci, yy, xx] * w[ci]
    out = full[:, :, pad:pad + oh, pad:pad + ow]
    return out + (b.reshape(1, -1, 1, 1) if b is not None else 0)


@pytest.mark.parametrize("stride,pad,group,bias", [(2, 1, 1, True), (1, 0, 2, False), (3, 0, 1, True)])
def test_deconvolution_reference_and_gradient(stride, pad, group, bias):
    rng = np.random.default_rng(121)
    x = rng.standard_normal((2, 4, 3, 3))
    proto = (f"type: 'Deconvolution' convolution_param {{ num_output: 4 kernel_size: 3 stride: {stride} "
             f"pad: {pad} group: {group} bias_term: {str(bias).lower()} }}")
    layer, shapes = make_layer(proto, [x.shape])
    assert [p.shape for p in layer.params][0] == (4, 4 // group, 3, 3)
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
    (y,) = forward(layer, [x.copy()], shapes)
    ref = _deconv_ref(x, layer.params[0].data, layer.params[1].data if bias else None, stride, pad, group)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    check_gradients(proto, [x])


def test_deconvolution_is_the_adjoint_of_convolution():
    rng = np.random.default_rng(122)
    conv, cshapes = make_layer("type: 'Convolution' convolution_param { num_output: 3 kernel_size: 3 stride: 2 "
                               "pad: 1 bias_term: false }", [(1, 2, 7, 7)])
    deconv, dshapes = make_layer("type: 'Deconvolution' convolution_param { num_output: 2 kernel_size: 3 stride: 2 "
                                 "pad: 1 bias_term: false }", [cshapes[0]])
    assert dshapes == [(1, 2, 7, 7)]
    deconv.params[0].data[...] = conv.params[0].data
    u = rng.standard_normal((1, 2, 7, 7))
    v = rng.standard_normal(cshapes[0])
    (cu,) = forward(conv, [u], cshapes)
    (dv,) = forward(deconv, [v], dshapes)
    np.testing.assert_allclose((cu * v).sum(), (u * dv).sum(), rtol=1e-12)
