"""The Eltwise layer (layers/eltwise.py) on the CPU backend: float64 references and gradients."""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP


def _f32(v):
    """A prototxt float field's value as the layer sees it (the schema stores float32)."""
    return float(np.float32(v))


def _rand(rng, *shape):
    # Bounded away from 0 so PROD's top / x and MAX's comparisons stay well conditioned.
    return rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)


def _eltwise(op, extra=""):
    return f"type: 'Eltwise' eltwise_param {{ operation: {op} {extra} }}"


def test_eltwise_sum_with_coefficients():
    rng = np.random.default_rng(20)
    xs = [_rand(rng, 2, 3, 4) for _ in range(3)]
    for extra, coeffs in (("", (1.0, 1.0, 1.0)), ("coeff: 0.3 coeff: -1.7 coeff: 2", (_f32(0.3), _f32(-1.7), 2.0))):
        layer, shapes = make_layer(_eltwise("SUM", extra), [x.shape for x in xs])
        assert layer.backward_needs() == frozenset()
        (y,) = forward(layer, [x.copy() for x in xs], shapes)
        np.testing.assert_allclose(y, sum(c * x for c, x in zip(coeffs, xs)), rtol=1e-14)
        check_gradients(_eltwise("SUM", extra), xs)


def test_eltwise_prod_stable_and_unstable():
    rng = np.random.default_rng(21)
    xs = [_rand(rng, 3, 4) for _ in range(3)]
    for stable, needs in (("true", {NEEDS_BOTTOM}), ("false", {NEEDS_BOTTOM, NEEDS_TOP})):
        proto = _eltwise("PROD", f"stable_prod_grad: {stable}")
        layer, shapes = make_layer(proto, [x.shape for x in xs])
        assert layer.backward_needs() == frozenset(needs)
        (y,) = forward(layer, [x.copy() for x in xs], shapes)
        np.testing.assert_allclose(y, xs[0] * xs[1] * xs[2], rtol=1e-14)
        dy = rng.standard_normal(y.shape)
        diffs = [np.zeros_like(x) for x in xs]
        layer.backward([y], [dy], [True] * 3, xs, diffs)
        for i, others in enumerate(((1, 2), (0, 2), (0, 1))):
            np.testing.assert_allclose(diffs[i], dy * xs[others[0]] * xs[others[1]], rtol=1e-12)
        check_gradients(proto, xs)
    # The stable gradient is exact where an input is 0 (the unstable one divides by it).
    zs = [np.array([[0.0, 2.0]]), np.array([[3.0, 0.5]])]
    layer, shapes = make_layer(_eltwise("PROD"), [(1, 2), (1, 2)])
    (y,) = forward(layer, zs, shapes)
    diffs = [np.zeros((1, 2)), np.zeros((1, 2))]
    layer.backward([y], [np.ones((1, 2))], [True, True], zs, diffs)
    np.testing.assert_array_equal(diffs[0], [[3.0, 0.5]])


def test_eltwise_max_argmax_and_gradient():
    rng = np.random.default_rng(22)
    xs = [_rand(rng, 2, 3, 5) for _ in range(3)]
    layer, shapes = make_layer(_eltwise("MAX"), [x.shape for x in xs])
    assert layer.backward_needs() == frozenset()
    assert layer.buffers["argmax"].dtype == np.int32
    (y,) = forward(layer, [x.copy() for x in xs], shapes)
    stacked = np.stack(xs)
    np.testing.assert_array_equal(y, stacked.max(axis=0))
    np.testing.assert_array_equal(layer.buffers["argmax"].array, stacked.argmax(axis=0))
    dy = rng.standard_normal(y.shape)
    diffs = [np.zeros_like(x) for x in xs]
    layer.backward([y], [dy], [True] * 3, xs, diffs)
    for i in range(3):
        np.testing.assert_array_equal(diffs[i], np.where(stacked.argmax(axis=0) == i, dy, 0.0))
    check_gradients(_eltwise("MAX"), xs)
    # Ties go to the first bottom, as in Caffe.
    layer, shapes = make_layer(_eltwise("MAX"), [(3,), (3,)])
    forward(layer, [np.array([1.0, 2.0, 3.0]), np.array([1.0, 5.0, 0.0])], shapes)
    np.testing.assert_array_equal(layer.buffers["argmax"].array, [0, 1, 0])


@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_eltwise_in_place_matches_out_of_place(op):
    """top == bottom 0 (same arrays for data and diff) gives the same values and diffs."""
    rng = np.random.default_rng(23)
    xs = [_rand(rng, 2, 4) for _ in range(3)]
    dy = rng.standard_normal((2, 4))
    extra = "coeff: 2 coeff: -1 coeff: 0.5" if op == "SUM" else ""
    ref, shapes = make_layer(_eltwise(op, extra), [x.shape for x in xs])
    (y_ref,) = forward(ref, [x.copy() for x in xs], shapes)
    diffs_ref = [np.zeros_like(x) for x in xs]
    ref.backward([y_ref], [dy.copy()], [True] * 3, xs, diffs_ref)

    layer, _ = make_layer(_eltwise(op, extra) + " bottom: 'a' bottom: 'b' bottom: 'c' top: 'a'",
                          [x.shape for x in xs])
    assert layer.in_place
    bottoms = [x.copy() for x in xs]
    layer.forward(bottoms, [bottoms[0]])
    np.testing.assert_array_equal(bottoms[0], y_ref)
    diffs = [dy.copy(), np.zeros_like(dy), np.zeros_like(dy)]
    layer.backward([bottoms[0]], [diffs[0]], [True] * 3, bottoms, diffs)
    for d, d_ref in zip(diffs, diffs_ref):
        np.testing.assert_array_equal(d, d_ref)


def test_eltwise_rejects_bad_configurations():
    with pytest.raises(UserError, match=r"under_test.*bottom 1 has shape \(2, 5\) but bottom 0 has \(2, 4\)"):
        make_layer(_eltwise("SUM"), [(2, 4), (2, 5)])
    with pytest.raises(UserError, match="2 coeff values for 3 bottoms"):
        make_layer(_eltwise("SUM", "coeff: 1 coeff: 2"), [(2,), (2,), (2,)])
    with pytest.raises(UserError, match="coeff applies to SUM only"):
        make_layer(_eltwise("PROD", "coeff: 1 coeff: 2"), [(2,), (2,)])
    with pytest.raises(UserError, match="PROD cannot work in place on 'a'"):
        make_layer(_eltwise("PROD") + " bottom: 'a' bottom: 'b' top: 'a'", [(2,), (2,)])
    layer, _ = make_layer(_eltwise("SUM"), [(2,), (2,)])
    with pytest.raises(UserError, match=r"takes 2\.\.n bottom blob\(s\), got 1"):
        layer.check_counts(1, 1)  # the graph counts bottoms before setup
