"""Reduction and ArgMax (layers/reduction.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM


REDUCE = {"SUM": lambda x, a: x.sum(a), "ASUM": lambda x, a: np.abs(x).sum(a),
          "SUMSQ": lambda x, a: (x * x).sum(a), "MEAN": lambda x, a: x.mean(a)}


@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("axis,coeff", [(0, 1.0), (1, -0.5), (-1, 2.0)])
def test_reduction_reference_and_gradient(op, axis, coeff):
    rng = np.random.default_rng(104)
    x = rng.standard_normal((3, 2, 4))
    proto = f"type: 'Reduction' reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}"
    layer, shapes = make_layer(proto, [x.shape])
    a = axis % 3
    assert shapes == [x.shape[:a]]
    assert layer.backward_needs() == (frozenset({NEEDS_BOTTOM}) if op in ("ASUM", "SUMSQ") else frozenset())
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, coeff * REDUCE[op](x, tuple(range(a, 3))), rtol=1e-12)
    check_gradients(proto, [x])


# ---- ArgMax -----------------------------------------------------------------------------------

def test_argmax_without_axis_caffe_layout():
    rng = np.random.default_rng(105)
    x = rng.standard_normal((4, 3, 2, 2))
    flat = x.reshape(4, -1)
    order = np.argsort(-flat, axis=1)[:, :3]
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 3 }", [x.shape])
    assert shapes == [(4, 1, 3, 1)] and not layer.has_backward
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y[:, 0, :, 0], order)
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 3 out_max_val: true }", [x.shape])
    assert shapes == [(4, 2, 3, 1)]
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y[:, 0, :, 0], order)
    np.testing.assert_array_equal(y[:, 1, :, 0], np.take_along_axis(flat, order, 1))
    layer, shapes = make_layer("type: 'ArgMax'", [(5, 7)])
    assert shapes == [(5, 1, 1)]
    (y,) = forward(layer, [flat[:, :7][:4].repeat(2, 0)[:5]], shapes)
    np.testing.assert_array_equal(y[:, 0, 0], flat[:, :7][:4].repeat(2, 0)[:5].argmax(1))


def test_argmax_along_axis_and_ties():
    rng = np.random.default_rng(106)
    x = rng.standard_normal((2, 5, 3))
    order = np.argsort(-x, axis=1)[:, :2]
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 2 }", [x.shape])
    assert shapes == [(2, 2, 3)]
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y, order)
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 2 out_max_val: true }", [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y, np.take_along_axis(x, order, 1))
    # Ties go to the larger index, as Caffe's partial_sort on (value, index) pairs.
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 2 }", [(1, 4)])
    (y,) = forward(layer, [np.array([[1.0, 3.0, 1.0, 3.0]])], shapes)
    np.testing.assert_array_equal(y.ravel(), [3, 1])
    with pytest.raises(UserError, match="top_k is 6, but must be between 1 and the 5 values"):
        make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 6 }", [x.shape])
