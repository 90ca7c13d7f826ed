"""Sigmoid and TanH (layers/activations.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, in_place, make_layer

ACTIVATIONS = [
    ("Sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x)), lambda x: np.exp(-x) / (1.0 + np.exp(-x)) ** 2),
    ("TanH", np.tanh, lambda x: 1.0 / np.cosh(x) ** 2),
]


@pytest.mark.parametrize("type_name,f,df", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activation_reference_gradient_and_in_place(type_name, f, df):
    rng = np.random.default_rng(10)
    x = 2.0 * rng.standard_normal((2, 3, 4, 3))
    proto = f"type: '{type_name}'"
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, f(x), rtol=1e-12, atol=1e-15)
    check_gradients(proto, [x])

    # In place: one array for bottom and top, one for both diffs, as the Net hands them over.
    layer, _ = make_layer(in_place(proto), [x.shape])
    assert layer.in_place
    buf = x.copy()
    layer.forward([buf], [buf])
    np.testing.assert_allclose(buf, f(x), rtol=1e-12, atol=1e-15)
    dy = rng.standard_normal(x.shape)
    diff = dy.copy()
    layer.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(diff, dy * df(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("type_name", ["Sigmoid", "TanH"])
def test_activation_keeps_float32_and_saturates_without_overflow(type_name):
    layer, shapes = make_layer(f"type: '{type_name}'", [(5,)])
    x = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0], np.float32)
    with np.errstate(all="raise"):
        (y,) = forward(layer, [x], shapes, dtype=np.float32)
    assert y.dtype == np.float32
    low = 0.0 if type_name == "Sigmoid" else -1.0
    np.testing.assert_allclose(y, [low, low, 0.5 if type_name == "Sigmoid" else 0.0, 1.0, 1.0], atol=1e-6)
