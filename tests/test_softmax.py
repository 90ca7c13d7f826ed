"""The Softmax layer (layers/softmax.py) on the CPU backend: float64 reference and gradient."""
import numpy as np
import pytest
from harness import check_gradients, forward, in_place, make_layer, softmax_reference


@pytest.mark.parametrize("axis", [1, 2, -1, 0])
def test_softmax_reference_and_gradient(axis):
    rng = np.random.default_rng(14)
    x = 3.0 * rng.standard_normal((2, 4, 3, 2))
    proto = f"type: 'Softmax' softmax_param {{ axis: {axis} }}"
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, softmax_reference(x, axis), rtol=1e-12)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-12)
    check_gradients(proto, [x])


def test_softmax_stable_in_place_and_float32():
    rng = np.random.default_rng(15)
    x = rng.standard_normal((3, 5, 2)) + 1000.0  # exp(x) alone would overflow
    layer, _ = make_layer(in_place("type: 'Softmax'"), [x.shape])
    buf = x.copy()
    with np.errstate(over="raise"):
        layer.forward([buf], [buf])
    ref = softmax_reference(x, 1)
    np.testing.assert_allclose(buf, ref, rtol=1e-9)
    dy = rng.standard_normal(x.shape)
    diff = dy.copy()
    layer.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(diff, ref * (dy - (dy * ref).sum(axis=1, keepdims=True)), rtol=1e-9, atol=1e-12)

    layer32, shapes = make_layer("type: 'Softmax'", [x.shape])
    (y32,) = forward(layer32, [x.astype(np.float32)], shapes, dtype=np.float32)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, ref, rtol=1e-4)
