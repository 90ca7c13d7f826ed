"""The Scale layer (layers/scale.py) on the CPU backend: float64 references and gradients."""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM
from superneurons.proto import superneurons_pb2 as pb


def test_scale_learned_param_shapes_and_gradients():
    rng = np.random.default_rng(50)
    x = rng.standard_normal((2, 3, 4, 2))
    cases = {  # scale_param -> (the scale's shape, the axis it starts at)
        "": ((3,), 1),
        "axis: 1 num_axes: 2": ((3, 4), 1),
        "axis: 0 num_axes: -1": ((2, 3, 4, 2), 0),
        "axis: -1": ((2,), 3),
        "num_axes: 0": ((), 1),
    }
    for extra, (want, axis) in cases.items():
        for bias in ("false", "true"):
            proto = f"type: 'Scale' scale_param {{ {extra} bias_term: {bias} }}"
            layer, shapes = make_layer(proto, [x.shape])
            assert layer.params[0].shape == want and shapes == [x.shape]
            assert len(layer.params) == (2 if bias == "true" else 1)
            assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
            (y,) = forward(layer, [x.copy()], shapes)
            bshape = (1,) * axis + want + (1,) * (4 - axis - len(want))
            expect = x * layer.params[0].data.reshape(bshape)
            if bias == "true":
                expect = expect + layer.params[1].data.reshape(bshape)
            np.testing.assert_allclose(y, expect, rtol=1e-14, err_msg=extra)
            check_gradients(proto, [x])


def test_scale_default_fillers_are_one_and_zero():
    from superneurons.layers.fillers import fill

    layer, _ = make_layer("type: 'Scale' scale_param { bias_term: true }", [(2, 3)])
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(fill(layer.params[0].filler, (3,), rng), 1.0)
    np.testing.assert_array_equal(fill(layer.params[1].filler, (3,), rng), 0.0)


def test_scale_second_bottom_is_the_scale():
    rng = np.random.default_rng(51)
    x, s = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4))
    proto = "type: 'Scale' scale_param { bias_term: true }"
    layer, shapes = make_layer(proto, [x.shape, s.shape])
    assert [p.shape for p in layer.params] == [(3, 4)]  # only the bias is a param
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
    (y,) = forward(layer, [x.copy(), s.copy()], shapes)
    np.testing.assert_allclose(y, x * s + layer.params[0].data, rtol=1e-14)
    check_gradients(proto, [x, s])
    # A scalar second bottom scales everything, whatever the axis.
    c = np.array(rng.standard_normal())
    layer, shapes = make_layer("type: 'Scale' scale_param { axis: 2 }", [x.shape, ()])
    (y,) = forward(layer, [x.copy(), c.copy()], shapes)
    np.testing.assert_allclose(y, x * c, rtol=1e-14)
    check_gradients("type: 'Scale'", [x, c])


def test_scale_in_place_matches_out_of_place():
    rng = np.random.default_rng(52)
    x = rng.standard_normal((3, 2, 4))
    dy = rng.standard_normal(x.shape)
    proto = "type: 'Scale' scale_param { bias_term: true }"
    ref, shapes = make_layer(proto, [x.shape], rng=np.random.default_rng(7))
    (y_ref,) = forward(ref, [x.copy()], shapes)
    dx_ref = np.zeros_like(x)
    ref.backward([y_ref], [dy.copy()], [True], [x.copy()], [dx_ref])

    layer, _ = make_layer(proto + " bottom: 'a' top: 'a'", [x.shape], rng=np.random.default_rng(7))
    assert layer.in_place and layer.backward_needs() == frozenset()
    data = x.copy()
    layer.forward([data], [data])
    np.testing.assert_array_equal(data, y_ref)
    diff = dy.copy()
    layer.backward([data], [diff], [True], [data], [diff])
    np.testing.assert_allclose(diff, dx_ref, rtol=1e-14)
    for p, p_ref in zip(layer.params, ref.params):
        np.testing.assert_allclose(p.diff, p_ref.diff, rtol=1e-14)
    # In TEST there is no backward, so no copy of the bottom is kept.
    test_layer, _ = make_layer(proto + " bottom: 'a' top: 'a'", [x.shape], phase=pb.TEST)
    assert "x" not in test_layer.buffers


def test_scale_rejects_bad_shapes():
    with pytest.raises(UserError, match=r"under_test.*Scale.*\(3, 5\) does not match.*\(2, 3, 4\) from axis 1"):
        make_layer("type: 'Scale'", [(2, 3, 4), (3, 5)])
    with pytest.raises(UserError, match="axis 2 with num_axes 2 goes past the 3 axes"):
        make_layer("type: 'Scale' scale_param { axis: 2 num_axes: 2 }", [(2, 3, 4)])
