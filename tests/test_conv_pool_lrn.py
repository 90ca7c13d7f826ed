"""Convolution, Pooling and LRN on the CPU backend: float64 references written from the definitions
(direct sliding windows), finite-difference gradients, Caffe's shape rules, and config errors."""
import time

import numpy as np
import pytest
from google.protobuf import text_format
from harness import check_gradients, forward, make_layer
from zoo import missing, zoo_path

from superneurons.backend.cpu import conv as conv_ops
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.proto import superneurons_pb2 as pb

ZOO = str(zoo_path("caffe/models"))


def _rng(seed):
    return np.random.default_rng(seed)


# ---- references ------------------------------------------------------------------------------------

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


def ref_pool(x, kernel, stride, pad, out_hw, method):
    """Caffe's windows: MAX over the window clipped to the image; AVE's sum over the same pixels divided by
    the window clipped to the padded image. Also returns MAX's argmax as h * W + w."""
    n_img, ch, h, w = x.shape
    y = np.zeros((n_img, ch) + tuple(out_hw))
    mask = np.zeros(y.shape, np.int64)
    for r in range(out_hw[0]):
        for c in range(out_hw[1]):
            h0, w0 = r * stride[0] - pad[0], c * stride[1] - pad[1]
            h1, w1 = min(h0 + kernel[0], h + pad[0]), min(w0 + kernel[1], w + pad[1])
            divisor = (h1 - h0) * (w1 - w0)
            hs, ws, he, we = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
            win = x[:, :, hs:he, ws:we]
            if method == "max":
                flat = win.reshape(n_img, ch, -1)
                a = flat.argmax(axis=2)
                y[:, :, r, c] = flat.max(axis=2)
                mask[:, :, r, c] = (hs + a // (we - ws)) * w + ws + a % (we - ws)
            elif method == "ave":
                y[:, :, r, c] = win.sum(axis=(2, 3)) / divisor
            else:  # stochastic, TEST: activation-weighted mean
                y[:, :, r, c] = (win * win).sum(axis=(2, 3)) / win.sum(axis=(2, 3))
    return y, mask


def ref_lrn(x, size, alpha, beta, k, across):
    n_img, ch, h, w = x.shape
    half = (size - 1) // 2
    s = np.zeros_like(x)
    if across:
        for c in range(ch):
            lo, hi = max(0, c - half), min(ch, c + half + 1)
            s[:, c] = k + alpha / size * (x[:, lo:hi] ** 2).sum(axis=1)
    else:  # Caffe: 1 + alpha * (average of squares over a size x size zero-padded patch); k unused
        for r in range(h):
            for c in range(w):
                win = x[:, :, max(0, r - half):r + half + 1, max(0, c - half):c + half + 1]
                s[:, :, r, c] = 1.0 + alpha / size ** 2 * (win ** 2).sum(axis=(2, 3))
    return x * s ** -beta


# ---- convolution ------------------------------------------------------------------------------------

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
    with pytest.raises(UserError) as err:
        make_layer(_conv_proto(body), [shape])
    msg = str(err.value)
    assert "'conv'" in msg and "Convolution" in msg
    for word in words:
        assert word in msg


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


# ---- pooling ----------------------------------------------------------------------------------------

# (pooling_param text without `pool`, bottom shape, kernel, stride, pad, expected (OH, OW))
POOL_CASES = {
    # ceil: (7 - 3) / 2 = 2 exactly; (6 - 3) / 2 = 1.5 -> 2 + 1 = 3
    "k3s2_ceil": ("kernel_size: 3 stride: 2", (2, 2, 7, 6), (3, 3), (2, 2), (0, 0), (3, 3)),
    "k3s2_pad1": ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 5), (3, 3), (2, 2), (1, 1), (4, 3)),
    # ceil gives 3, but the third window would start in the bottom padding: Caffe drops it -> 2
    "last_window_rule": ("kernel_size: 2 stride: 2 pad: 1", (1, 2, 3, 3), (2, 2), (2, 2), (1, 1), (2, 2)),
    "overlap_s1_pad1": ("kernel_size: 3 stride: 1 pad: 1", (1, 2, 4, 4), (3, 3), (1, 1), (1, 1), (4, 4)),
    "floor": ("kernel_size: 3 stride: 2 round_mode: FLOOR", (2, 2, 6, 6), (3, 3), (2, 2), (0, 0), (2, 2)),
    "nonsquare": ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0", (1, 3, 4, 7),
                  (2, 3), (1, 2), (1, 0), (5, 3)),
    "global": ("global_pooling: true", (2, 3, 4, 5), (4, 5), (1, 1), (0, 0), (1, 1)),
    "kernel_overhangs_input": ("kernel_size: 3 stride: 2", (1, 2, 2, 2), (3, 3), (2, 2), (0, 0), (1, 1)),
}


def _pool_proto(method, body, name="pool"):
    return f"name: '{name}' type: 'Pooling' pooling_param {{ pool: {method} {body} }}"


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_pool_forward_matches_reference(method, case):
    body, shape, kernel, stride, pad, out_hw = POOL_CASES[case]
    x = _rng(10).standard_normal(shape)
    layer, shapes = make_layer(_pool_proto(method, body), [shape])
    assert shapes == [shape[:2] + out_hw]
    (y,) = forward(layer, [x.copy()], shapes)
    expected, mask = ref_pool(x, kernel, stride, pad, out_hw, method.lower())
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-15)
    if method == "MAX":
        np.testing.assert_array_equal(layer.buffers["mask"].array, mask)
        assert layer.buffers["mask"].array.dtype == np.int32


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_pool_gradients(method, case):
    body, shape, *_ = POOL_CASES[case]
    layer = check_gradients(_pool_proto(method, body), [_rng(11).standard_normal(shape)])
    assert layer.backward_needs() == frozenset()  # MAX reads only its mask buffer, AVE nothing


def test_max_pool_ties_pick_the_first_pixel_and_route_all_overlaps():
    x = np.zeros((1, 1, 3, 3))
    x[0, 0, 1, 1] = 5.0  # the centre wins every overlapping 2x2 window
    layer, shapes = make_layer(_pool_proto("MAX", "kernel_size: 2 stride: 1"), [x.shape])
    (y,) = forward(layer, [x], shapes)
    np.testing.assert_array_equal(layer.buffers["mask"].array, np.full((1, 1, 2, 2), 4))
    dx = np.full_like(x, 7.0)
    layer.backward([y], [np.ones_like(y)], [True], [x], [dx])
    expected = np.zeros_like(x)
    expected[0, 0, 1, 1] = 4.0
    np.testing.assert_array_equal(dx, expected)
    # All-equal window: Caffe keeps the first pixel in row-major order.
    layer, shapes = make_layer(_pool_proto("MAX", "kernel_size: 2 stride: 1"), [x.shape])
    forward(layer, [np.ones_like(x)], shapes)
    np.testing.assert_array_equal(layer.buffers["mask"].array[0, 0], [[0, 1], [3, 4]])


def test_max_pool_mask_top():
    x = _rng(12).standard_normal((2, 2, 5, 5))
    proto = ("name: 'p' type: 'Pooling' bottom: 'x' top: 'y' top: 'm' "
             "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    layer, shapes = make_layer(proto, [x.shape])
    assert shapes == [(2, 2, 2, 2)] * 2
    _, m = forward(layer, [x], shapes)
    _, mask = ref_pool(x, (3, 3), (2, 2), (0, 0), (2, 2), "max")
    np.testing.assert_array_equal(m, mask.astype(np.float64))


def test_pool_keeps_float32():
    x = _rng(13).standard_normal((2, 3, 5, 5)).astype(np.float32)
    for method in ("MAX", "AVE"):
        layer, shapes = make_layer(_pool_proto(method, "kernel_size: 3 stride: 2 pad: 1"), [x.shape],
                                   dtype=np.float32)
        (y,) = forward(layer, [x], shapes, dtype=np.float32)
        dx = np.zeros_like(x)
        layer.backward([y], [y], [True], [x], [dx])
        assert y.dtype == dx.dtype == np.float32
        expected, _ = ref_pool(x.astype(np.float64), (3, 3), (2, 2), (1, 1), (3, 3), method.lower())
        np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_stochastic_pooling_test_phase_is_the_weighted_mean():
    x = _rng(14).uniform(0.1, 1.0, (2, 2, 5, 5))
    layer, shapes = make_layer(_pool_proto("STOCHASTIC", "kernel_size: 3 stride: 2"), [x.shape], phase=pb.TEST)
    (y,) = forward(layer, [x], shapes)
    expected, _ = ref_pool(x, (3, 3), (2, 2), (0, 0), (2, 2), "stochastic")
    np.testing.assert_allclose(y, expected, rtol=1e-12)


def test_pool_output_shapes():
    max3s2 = _pool_proto("MAX", "kernel_size: 3 stride: 2")
    assert make_layer(max3s2, [(1, 96, 55, 55)])[1] == [(1, 96, 27, 27)]  # AlexNet pool1
    # GoogLeNet pool1 on 112: (112 - 3) / 2 = 54.5 rounds up -> 56 (floor would give 55)
    assert make_layer(max3s2, [(1, 64, 112, 112)])[1] == [(1, 64, 56, 56)]
    floor = _pool_proto("MAX", "kernel_size: 3 stride: 2 round_mode: FLOOR")
    assert make_layer(floor, [(1, 64, 112, 112)])[1] == [(1, 64, 55, 55)]
    # With padding: (112 + 2 - 3) / 2 = 55.5 -> 56 + 1 = 57; the last window starts at 56*2 - 1 = 111, inside
    assert make_layer(_pool_proto("MAX", "kernel_size: 3 stride: 2 pad: 1"), [(1, 8, 112, 112)])[1] == \
        [(1, 8, 57, 57)]


@pytest.mark.parametrize("method, body, shape, phase, words", [
    ("MAX", "kernel_size: 2 pad: 2", (1, 1, 5, 5), pb.TRAIN, ["pad 2", "kernel 2"]),
    ("MAX", "kernel_size: 4 round_mode: FLOOR", (1, 1, 3, 3), pb.TRAIN, ["kernel 4", "3 + 2*0"]),
    ("MAX", "kernel_size: 1 stride: 3", (1, 1, 5, 5), pb.TRAIN, ["starts at 6", "input height 5"]),
    ("STOCHASTIC", "kernel_size: 2", (1, 1, 4, 4), pb.TRAIN, ["STOCHASTIC", "TEST"]),
    ("STOCHASTIC", "kernel_size: 3 pad: 1", (1, 1, 4, 4), pb.TEST, ["padding"]),
    ("AVE", "global_pooling: true kernel_size: 2", (1, 1, 4, 4), pb.TRAIN, ["global_pooling"]),
    ("AVE", "global_pooling: true stride: 2", (1, 1, 4, 4), pb.TRAIN, ["stride 1"]),
    ("MAX", "stride: 2", (1, 1, 4, 4), pb.TRAIN, ["kernel is required"]),
    ("MAX", "kernel_size: 2", (1, 4, 4), pb.TRAIN, ["4-D"]),
])
def test_pool_bad_configs_name_the_layer(method, body, shape, phase, words):
    with pytest.raises(UserError) as err:
        make_layer(_pool_proto(method, body), [shape], phase=phase)
    msg = str(err.value)
    assert "'pool'" in msg and "Pooling" in msg
    for word in words:
        assert word in msg


def test_mask_top_only_for_max():
    proto = "name: 'pool' type: 'Pooling' top: 'y' top: 'm' pooling_param { pool: AVE kernel_size: 2 }"
    with pytest.raises(UserError, match="'pool'.*second"):
        make_layer(proto, [(1, 1, 4, 4)])


# ---- LRN --------------------------------------------------------------------------------------------

LRN_CASES = {
    "across": ("local_size: 3 alpha: 0.7 beta: 0.75 k: 2", (2, 5, 3, 3), True),
    "across_wide": ("local_size: 5 alpha: 1.3 beta: 0.6 k: 1.5", (1, 4, 2, 3), True),
    # k is deliberately not 1: Caffe ignores it within a channel, and so must we.
    "within": ("local_size: 3 alpha: 0.9 beta: 0.75 k: 3 norm_region: WITHIN_CHANNEL", (2, 2, 4, 5), False),
    "within_wide": ("local_size: 5 alpha: 2.0 beta: 0.5 norm_region: WITHIN_CHANNEL", (1, 2, 4, 3), False),
}


def _lrn_proto(body):
    return f"name: 'norm' type: 'LRN' lrn_param {{ {body} }}"


def _lrn_args(body):
    p = text_format.Parse(body, pb.LRNParameter())
    return int(p.local_size), float(p.alpha), float(p.beta), float(p.k)


@pytest.mark.parametrize("case", sorted(LRN_CASES))
def test_lrn_forward_matches_reference(case):
    body, shape, across = LRN_CASES[case]
    x = _rng(20).standard_normal(shape) * 1.5
    layer, shapes = make_layer(_lrn_proto(body), [shape])
    assert shapes == [shape]
    (y,) = forward(layer, [x], shapes)
    np.testing.assert_allclose(y, ref_lrn(x, *_lrn_args(body), across), rtol=1e-12)


@pytest.mark.parametrize("case", sorted(LRN_CASES))
def test_lrn_gradients(case):
    body, shape, _ = LRN_CASES[case]
    layer = check_gradients(_lrn_proto(body), [_rng(21).standard_normal(shape) * 1.5])
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM, NEEDS_TOP})


def test_lrn_keeps_float32():
    x = _rng(22).standard_normal((2, 6, 4, 4)).astype(np.float32)
    body = "local_size: 5 alpha: 0.0001 beta: 0.75"
    layer, shapes = make_layer(_lrn_proto(body), [x.shape], dtype=np.float32)
    (y,) = forward(layer, [x], shapes, dtype=np.float32)
    dx = np.zeros_like(x)
    layer.backward([y], [y], [True], [x], [dx])
    assert y.dtype == dx.dtype == layer.buffers["scale"].array.dtype == np.float32
    np.testing.assert_allclose(y, ref_lrn(x.astype(np.float64), 5, 0.0001, 0.75, 1.0, True), rtol=1e-6)


@pytest.mark.parametrize("body, shape, words", [
    ("local_size: 4", (1, 3, 2, 2), ["odd", "4"]),
    ("local_size: 3", (3, 2, 2), ["4-D"]),
])
def test_lrn_bad_configs_name_the_layer(body, shape, words):
    with pytest.raises(UserError) as err:
        make_layer(_lrn_proto(body), [shape])
    msg = str(err.value)
    assert "'norm'" in msg and "LRN" in msg
    for word in words:
        assert word in msg


# ---- real nets --------------------------------------------------------------------------------------

def _stem(path, types=("Input", "Convolution", "Pooling", "LRN", "ReLU")):
    """The model-zoo net up to its first layer outside this module's family (its linear stem)."""
    net = read_net(path)
    keep = []
    for layer in net.layer:
        if layer.type not in types:
            break
        keep.append(layer)
    del net.layer[:]
    net.layer.extend(keep)
    return build_graph(net, pb.TEST, source=path).blob_shapes


@pytest.mark.skipif(bool(missing("caffe/models/bvlc_alexnet/deploy.prototxt")),
                    reason=str(missing("caffe/models/bvlc_alexnet/deploy.prototxt")))
def test_alexnet_stem_shapes():
    shapes = _stem(f"{ZOO}/bvlc_alexnet/deploy.prototxt")
    assert shapes["conv1"] == (10, 96, 55, 55)
    assert shapes["pool1"] == (10, 96, 27, 27)
    assert shapes["conv2"] == (10, 256, 27, 27)
    assert shapes["pool2"] == (10, 256, 13, 13)
    assert shapes["pool5"] == (10, 256, 6, 6)


@pytest.mark.skipif(bool(missing("caffe/models/bvlc_googlenet/deploy.prototxt")),
                    reason=str(missing("caffe/models/bvlc_googlenet/deploy.prototxt")))
def test_googlenet_stem_shapes_use_ceil_rounding():
    shapes = _stem(f"{ZOO}/bvlc_googlenet/deploy.prototxt")
    assert shapes["conv1/7x7_s2"] == (10, 64, 112, 112)
    assert shapes["pool1/3x3_s2"] == (10, 64, 56, 56)  # floor rounding would give 55
    assert shapes["conv2/3x3"] == (10, 192, 56, 56)
    assert shapes["pool2/3x3_s2"] == (10, 192, 28, 28)
