"""The Convolution layer (layers/convolution.py) on the CPU backend: a float64 reference written from the
definition (direct sliding windows), finite-difference gradients, Caffe's shape rules, and config errors."""
import time

import numpy as np
import pytest
from harness import assert_setup_refuses, check_gradients, forward, make_layer

from superneurons.backend.cpu import conv as conv_ops
from superneurons.layers.base import NEEDS_BOTTOM


def _rng(seed):
    return np.random.default_rng(seed)


def ref_conv(x, w, b, stride, pad, dilation, group):
    """Sliding-window convolution: each output is the dot product of its filter with the dilated patch."""
    n_img, _, h, wd = x.shape
    m, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    ext = (dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)
    oh = (h + 2 * pad[0] - ext[0]) // stride[0] + 1
    ow = (wd + 2 * pad[1] - ext[1]) // stride[1] + 1
    y = np.zeros((n_img, m, oh, ow))
    per_group = m // group
    for n in range(n_img):
        for o in range(m):
            c0 = (o // per_group) * cg
            for r in range(oh):
                for c in range(ow):
                    r0, q0 = r * stride[0], c * stride[1]
                    patch = xp[n, c0:c0 + cg, r0:r0 + ext[0]:dilation[0], q0:q0 + ext[1]:dilation[1]]
                    y[n, o, r, c] = (patch * w[o]).sum() + (b[o] if b is not None else 0.0)
    return y


# (conv_param text, bottom shape, stride, pad, dilation, group)
CONV_CASES = {
    "plain": ("num_output: 3 kernel_size: 3", (2, 2, 5, 5), (1, 1), (0, 0), (1, 1), 1),
    "stride2_pad1": ("num_output: 4 kernel_size: 3 stride: 2 pad: 1", (2, 3, 6, 5), (2, 2), (1, 1), (1, 1), 1),
    "dilation2": ("num_output: 2 kernel_size: 2 dilation: 2 pad: 1", (1, 2, 5, 6), (1, 1), (1, 1), (2, 2), 1),
    "group2": ("num_output: 4 kernel_size: 3 group: 2 pad: 1", (2, 4, 4, 4), (1, 1), (1, 1), (1, 1), 2),
    "depthwise": ("num_output: 3 kernel_size: 3 group: 3 stride: 2 pad: 1", (2, 3, 5, 5), (2, 2), (1, 1),
                  (1, 1), 3),
    "depthwise_x2": ("num_output: 6 kernel_size: 3 group: 3", (1, 3, 4, 5), (1, 1), (0, 0), (1, 1), 3),
    "nonsquare": ("num_output: 3 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1",
                  (2, 2, 7, 4), (2, 1), (0, 1), (1, 1), 1),
    "per_axis_repeated": ("num_output: 2 kernel_size: 2 kernel_size: 3 stride: 1 stride: 2 pad: 1 pad: 0 "
                          "dilation: 2 dilation: 1", (1, 2, 5, 7), (1, 2), (1, 0), (2, 1), 1),
    "no_bias_1x1": ("num_output: 3 kernel_size: 1 bias_term: false", (2, 4, 3, 3), (1, 1), (0, 0), (1, 1), 1),
}


def _conv_proto(body):
    return f"name: 'conv' type: 'Convolution' convolution_param {{ {body} }}"


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_forward_matches_sliding_window_reference(case):
    body, shape, stride, pad, dilation, group = CONV_CASES[case]
    x = _rng(1).standard_normal(shape)
    layer, shapes = make_layer(_conv_proto(body), [shape])
    w = layer.params[0].data
    b = layer.params[1].data if len(layer.params) > 1 else None
    expected = ref_conv(x, w, b, stride, pad, dilation, group)
    assert shapes == [expected.shape]
    assert w.shape[1] == shape[1] // group
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_gradients(case):
    body, shape, *_ = CONV_CASES[case]
    check_gradients(_conv_proto(body), [_rng(2).standard_normal(shape)])


def test_conv_backward_accumulates_params_and_overwrites_bottom_diff():
    rng = _rng(3)
    x = rng.standard_normal((2, 2, 5, 5))
    layer, shapes = make_layer(_conv_proto("num_output: 3 kernel_size: 3 pad: 1"), [x.shape], rng=rng)
    (y,) = forward(layer, [x], shapes)
    dy = rng.standard_normal(y.shape)
    dx = np.full(x.shape, 123.0)  # stale garbage must be overwritten
    layer.backward([y], [dy], [True], [x], [dx])
    dw1, db1, dx1 = layer.params[0].diff.copy(), layer.params[1].diff.copy(), dx.copy()
    np.testing.assert_allclose(db1, dy.sum(axis=(0, 2, 3)), rtol=1e-12)
    layer.backward([y], [dy], [True], [x], [dx])
    np.testing.assert_allclose(layer.params[0].diff, 2 * dw1, rtol=1e-12)
    np.testing.assert_allclose(layer.params[1].diff, 2 * db1, rtol=1e-12)
    np.testing.assert_allclose(dx, dx1, rtol=1e-12)
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})


def test_conv_chunked_batch_matches_whole_batch(monkeypatch):
    """A big batch is cut into chunks so im2col stays small; chunking must not change a single number."""
    rng = _rng(4)
    x = rng.standard_normal((5, 4, 6, 6))
    proto = _conv_proto("num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2")
    results = []
    for col_elements in (1 << 23, 100):  # 100 elements: one image per chunk
        monkeypatch.setattr(conv_ops, "_COL_ELEMENTS", col_elements)
        layer, shapes = make_layer(proto, [x.shape], rng=_rng(5))
        (y,) = forward(layer, [x], shapes)
        dx = np.zeros_like(x)
        layer.backward([y], [np.cos(y)], [True], [x], [dx])
        results.append((y, dx, layer.params[0].diff.copy(), layer.params[1].diff.copy()))
    for whole, chunked in zip(*results):
        np.testing.assert_allclose(chunked, whole, rtol=1e-12, atol=1e-13)


def test_conv_keeps_float32():
    rng = _rng(6)
    x64 = rng.standard_normal((2, 3, 6, 6))
    proto = _conv_proto("num_output: 4 kernel_size: 3 group: 1 pad: 1")
    layer, shapes = make_layer(proto, [x64.shape], dtype=np.float32, rng=_rng(7))
    x = x64.astype(np.float32)
    (y,) = forward(layer, [x], shapes, dtype=np.float32)
    dx = np.zeros_like(x)
    layer.backward([y], [y.copy()], [True], [x], [dx])
    assert y.dtype == dx.dtype == layer.params[0].diff.dtype == layer.params[1].diff.dtype == np.float32
    w, b = (p.data.astype(np.float64) for p in layer.params)
    np.testing.assert_allclose(y, ref_conv(x64.astype(np.float32), w, b, (1, 1), (1, 1), (1, 1), 1),
                               rtol=1e-4, atol=1e-4)


def test_conv_output_shapes():
    layer, shapes = make_layer(_conv_proto("num_output: 96 kernel_size: 11 stride: 4"), [(1, 3, 227, 227)])
    assert shapes == [(1, 96, 55, 55)] and layer.params[0].shape == (96, 3, 11, 11)
    # AlexNet conv2: 2 groups of 128 filters over 48 channels each.
    layer, shapes = make_layer(_conv_proto("num_output: 256 kernel_size: 5 pad: 2 group: 2"), [(1, 96, 27, 27)])
    assert shapes == [(1, 256, 27, 27)] and layer.params[0].shape == (256, 48, 5, 5)
    _, shapes = make_layer(_conv_proto("num_output: 8 kernel_size: 3 dilation: 4 pad: 4"), [(1, 2, 9, 9)])
    assert shapes == [(1, 8, 9, 9)]  # extent 9, padded input 17 -> 9


@pytest.mark.parametrize("body, shape, words", [
    ("num_output: 2 kernel_size: 5", (1, 1, 3, 3), ["extent 5", "3 + 2*0"]),
    ("num_output: 2 kernel_size: 3 dilation: 3 pad: 1", (1, 1, 4, 4), ["extent 7", "4 + 2*1 = 6"]),
    ("num_output: 3 kernel_size: 1 group: 2", (1, 4, 3, 3), ["num_output 3", "group 2"]),
    ("num_output: 4 kernel_size: 1 group: 2", (1, 3, 3, 3), ["3 input channels", "group 2"]),
    ("num_output: 2", (1, 1, 3, 3), ["kernel is required"]),
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 1, 3, 3), ["not both"]),
    ("num_output: 2 kernel_h: 3", (1, 1, 3, 3), ["kernel_h and kernel_w"]),
    ("num_output: 2 kernel_size: 1 stride: 0", (1, 1, 3, 3), ["stride must be >= 1"]),
    ("kernel_size: 1", (1, 1, 3, 3), ["num_output"]),
    ("num_output: 2 kernel_size: 1", (1, 1, 3), ["2 spatial axes"]),
])
def test_conv_bad_configs_name_the_layer(body, shape, words):
    assert_setup_refuses(_conv_proto(body), [shape], words)


def test_lenet_convolutions_timing_report():
    """LeNet's two convolutions, forward and backward, on a 64-image batch in float32 (about 20 ms on 2 idle
    cores), printed beside the bare matrix products they cannot avoid (`pytest -s` shows it). Only a
    report: wall time on a shared CI machine says more about its load than about this code, so a bound
    here would flake; correctness is asserted by the tests above."""
    rng = _rng(8)
    f32 = np.float32
    conv1, s1 = make_layer(_conv_proto("num_output: 20 kernel_size: 5"), [(64, 1, 28, 28)], dtype=f32)
    conv2, s2 = make_layer(_conv_proto("num_output: 50 kernel_size: 5"), [(64, 20, 12, 12)], dtype=f32)
    x1 = rng.standard_normal((64, 1, 28, 28)).astype(f32)
    x2 = rng.standard_normal((64, 20, 12, 12)).astype(f32)
    y1, y2, dx2 = np.empty(s1[0], f32), np.empty(s2[0], f32), np.empty_like(x2)
    col1 = rng.standard_normal((25, 64 * 24 * 24)).astype(f32)
    col2 = rng.standard_normal((500, 64 * 8 * 8)).astype(f32)
    w1, w2 = conv1.params[0].data.reshape(20, 25), conv2.params[0].data.reshape(50, 500)

    def convolutions():
        conv1.forward([x1], [y1])
        conv2.forward([x2], [y2])
        conv2.backward([y2], [y2], [True], [x2], [dx2])
        conv1.backward([y1], [y1], [False], [x1], [None])

    def products():  # forward of both, dW of both, dcol of conv2
        dy1, dy2 = y1.reshape(20, -1), y2.reshape(50, -1)
        return w1 @ col1, w2 @ col2, dy1 @ col1.T, dy2 @ col2.T, w2.T @ dy2

    def best_of(fn, n=5):
        best = float("inf")
        for _ in range(n):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    convolutions()
    products()
    conv_s, gemm_s = best_of(convolutions), best_of(products)
    print(f"\nLeNet conv1+conv2 forward+backward: {conv_s * 1e3:.1f} ms (their GEMMs alone: {gemm_s * 1e3:.1f} ms)")
    assert y1.dtype == y2.dtype == dx2.dtype == f32 and np.isfinite(dx2).all()
