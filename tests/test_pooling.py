"""The Pooling layer (layers/pooling.py) on the CPU backend: a float64 reference written from the definition
(direct sliding windows), finite-difference gradients, Caffe's shape rules (ceil rounding, checked on the
AlexNet and GoogLeNet stems), and config errors."""
import numpy as np
import pytest
from harness import assert_setup_refuses, check_gradients, forward, make_layer
from zoo import missing, zoo_path

from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb

ZOO = str(zoo_path("caffe/models"))


def _rng(seed):
    return np.random.default_rng(seed)


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
    assert_setup_refuses(_pool_proto(method, body), [shape], words, phase=phase)


def test_mask_top_only_for_max():
    proto = "name: 'pool' type: 'Pooling' top: 'y' top: 'm' pooling_param { pool: AVE kernel_size: 2 }"
    with pytest.raises(UserError, match="'pool'.*second"):
        make_layer(proto, [(1, 1, 4, 4)])


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
