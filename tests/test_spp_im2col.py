"""SPP and Im2col (layers/spp.py, layers/im2col.py) on the CPU backend: forward against float64 NumPy
references written from Caffe's definitions, backward against central differences, on fresh random inputs."""
import math

import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError


def spp_reference(x, height, method):
    """Each level's bins pooled by hand (windows of ceil(H / bins) with that stride, padded by half the excess;
    AVE divides by the window clipped to the padded bottom, as Caffe's pooling does), flattened and joined."""
    n, c, h, w = x.shape
    levels = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        oh = -(-(h + 2 * ph - kh) // kh) + 1
        ow = -(-(w + 2 * pw - kw) // kw) + 1
        oh -= (oh - 1) * kh >= h + ph if ph else 0
        ow -= (ow - 1) * kw >= w + pw if pw else 0
        out = np.zeros((n, c, oh, ow))
        for i in range(oh):
            for j in range(ow):
                y0, x0 = i * kh - ph, j * kw - pw
                y1, x1 = min(y0 + kh, h + ph), min(x0 + kw, w + pw)
                area = (y1 - y0) * (x1 - x0)
                win = x[:, :, max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]
                out[:, :, i, j] = win.max(axis=(2, 3)) if method == "MAX" else win.sum(axis=(2, 3)) / area
        levels.append(out)
    if height == 1:
        return levels[0]
    return np.concatenate([lv.reshape(n, -1) for lv in levels], axis=1)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("height,hw", [(1, (5, 4)), (3, (7, 6)), (2, (4, 4))])
def test_spp_reference_and_gradient(rng, method, height, hw):
    x = rng.standard_normal((2, 3) + hw)
    proto = f"type: 'SPP' spp_param {{ pyramid_height: {height} pool: {method} }}"
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x], shapes)
    np.testing.assert_allclose(y, spp_reference(x, height, method), rtol=1e-12)
    check_gradients(proto, [x])


def test_spp_refuses_what_pooling_cannot_do():
    with pytest.raises(UserError, match=r"'under_test' \(SPP\): pyramid level 1 \(2 x 2 bins\) on a 1 x 6 "
                                         r"bottom: pad 1 must be smaller than the kernel 1 \(height\)"):
        make_layer("type: 'SPP' spp_param { pyramid_height: 3 }", [(1, 2, 1, 6)])
    with pytest.raises(UserError, match="pyramid_height must be 1 or more, got 0"):
        make_layer("type: 'SPP' spp_param { pyramid_height: 0 }", [(1, 2, 4, 4)])


def im2col_reference(x, k, s, p, d):
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    oh = (h + 2 * p[0] - (d[0] * (k[0] - 1) + 1)) // s[0] + 1
    ow = (w + 2 * p[1] - (d[1] * (k[1] - 1) + 1)) // s[1] + 1
    col = np.zeros((n, c * k[0] * k[1], oh, ow))
    for ch in range(c):
        for i in range(k[0]):
            for j in range(k[1]):
                for a in range(oh):
                    for b in range(ow):
                        col[:, (ch * k[0] + i) * k[1] + j, a, b] = xp[:, ch, a * s[0] + i * d[0], b * s[1] + j * d[1]]
    return col


@pytest.mark.parametrize("k,s,p,d", [((3, 3), (1, 1), (1, 1), (1, 1)), ((2, 3), (2, 1), (0, 1), (1, 2))])
def test_im2col_reference_and_gradient(rng, k, s, p, d):
    x = rng.standard_normal((2, 2, 5, 6))
    proto = (f"type: 'Im2col' convolution_param {{ kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} "
             f"stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]} dilation: {d[0]} dilation: {d[1]} }}")
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x], shapes)
    np.testing.assert_allclose(y, im2col_reference(x, k, s, p, d), rtol=0, atol=0)
    check_gradients(proto, [x])


def test_im2col_refuses_a_kernel_past_the_input():
    with pytest.raises(UserError, match=r"Im2col\): kernel extent 5 .* larger than the padded input height 3 \+ 2\*0"):
        make_layer("type: 'Im2col' convolution_param { kernel_size: 5 }", [(1, 1, 3, 8)])
