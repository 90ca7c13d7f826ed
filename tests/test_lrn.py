"""The LRN layer (layers/lrn.py) on the CPU backend: a float64 reference written from the definition,
finite-difference gradients, float32, and config errors."""
import numpy as np
import pytest
from google.protobuf import text_format
from harness import assert_setup_refuses, check_gradients, forward, make_layer

from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.proto import superneurons_pb2 as pb


def _rng(seed):
    return np.random.default_rng(seed)


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
    assert_setup_refuses(_lrn_proto(body), [shape], words)
