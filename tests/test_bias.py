"""The Bias layer (layers/bias.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError


@pytest.mark.parametrize("extra,bshape", [("", (3,)), ("bias_param { axis: 1 num_axes: 2 }", (3, 4)),
                                          ("bias_param { axis: 0 num_axes: -1 }", (2, 3, 4, 2)),
                                          ("bias_param { num_axes: 0 }", ())])
def test_bias_learned_reference_and_gradient(extra, bshape):
    rng = np.random.default_rng(110)
    x = rng.standard_normal((2, 3, 4, 2))
    proto = f"type: 'Bias' {extra}"
    layer, shapes = make_layer(proto, [x.shape])
    assert [p.shape for p in layer.params] == [bshape] and layer.backward_needs() == frozenset()
    (y,) = forward(layer, [x.copy()], shapes)
    b = layer.params[0].data.reshape((1,) * (1 if extra.find("axis: 0") < 0 else 0) + bshape
                                     + (1,) * (4 - len(bshape) - (1 if extra.find("axis: 0") < 0 else 0)))
    np.testing.assert_allclose(y, x + b, rtol=1e-14)
    check_gradients(proto, [x])


def test_bias_second_bottom_and_in_place():
    rng = np.random.default_rng(111)
    x = rng.standard_normal((2, 3, 4))
    b = rng.standard_normal((3, 4))
    proto = "type: 'Bias'"
    layer, shapes = make_layer(proto, [x.shape, b.shape])
    assert layer.params == []
    (y,) = forward(layer, [x.copy(), b.copy()], shapes)
    np.testing.assert_allclose(y, x + b, rtol=1e-14)
    check_gradients(proto, [x, b])
    scalar, shapes = make_layer("type: 'Bias' bias_param { axis: 2 }", [x.shape, ()])
    (y,) = forward(scalar, [x.copy(), np.array(0.5)], shapes)
    np.testing.assert_allclose(y, x + 0.5)
    inplace, _ = make_layer("type: 'Bias' bottom: 'x' top: 'x'", [x.shape])
    buf = x.copy()
    inplace.forward([buf], [buf])
    np.testing.assert_allclose(buf, x + inplace.params[0].data.reshape(1, 3, 1))
    with pytest.raises(UserError, match=r"bias bottom's shape \(4,\) does not match"):
        make_layer(proto, [x.shape, (4,)])
