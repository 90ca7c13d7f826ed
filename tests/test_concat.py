"""The Concat layer (layers/concat.py) on the CPU backend."""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError


def test_concat_along_channels_and_batch():
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal((2, c, 3, 2)) for c in (1, 3, 2)]
    layer, shapes = make_layer("type: 'Concat'", [x.shape for x in xs])
    assert shapes == [(2, 6, 3, 2)] and layer.backward_needs() == frozenset()
    (y,) = forward(layer, [x.copy() for x in xs], shapes)
    np.testing.assert_array_equal(y, np.concatenate(xs, axis=1))
    check_gradients("type: 'Concat'", xs)

    xs = [rng.standard_normal((n, 3, 2)) for n in (2, 1)]
    for proto in ("type: 'Concat' concat_param { axis: 0 }", "type: 'Concat' concat_param { concat_dim: 0 }",
                  "type: 'Concat' concat_param { axis: -3 }"):
        layer, shapes = make_layer(proto, [x.shape for x in xs])
        assert shapes == [(3, 3, 2)]
        (y,) = forward(layer, [x.copy() for x in xs], shapes)
        np.testing.assert_array_equal(y, np.concatenate(xs, axis=0))
    check_gradients("type: 'Concat' concat_param { axis: 0 }", xs)


def test_concat_backward_skips_bottoms_without_gradient():
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((2, c)) for c in (2, 3)]
    layer, shapes = make_layer("type: 'Concat'", [x.shape for x in xs])
    dy = rng.standard_normal(shapes[0])
    diffs = [np.full(x.shape, 7.0) for x in xs]
    layer.backward([None], [dy], [False, True], xs, diffs)
    np.testing.assert_array_equal(diffs[0], 7.0)
    np.testing.assert_array_equal(diffs[1], dy[:, 2:])


def test_concat_rejects_mismatched_shapes():
    with pytest.raises(UserError, match=r"under_test.*Concat.*bottom 1 has shape \(2, 3, 5\).*bottom 0 has "
                                        r"\(2, 4, 4\).*axis 1"):
        make_layer("type: 'Concat'", [(2, 4, 4), (2, 3, 5)])
    with pytest.raises(UserError, match=r"bottom 1 has shape \(2, 4\)"):
        make_layer("type: 'Concat'", [(2, 4, 4), (2, 4)])
    with pytest.raises(UserError, match="not both"):
        make_layer("type: 'Concat' concat_param { axis: 1 concat_dim: 1 }", [(2, 4), (2, 4)])
    with pytest.raises(UserError, match="axis 3 out of range for a 2-D blob"):
        make_layer("type: 'Concat' concat_param { axis: 3 }", [(2, 4), (2, 4)])
