"""Concat, Eltwise, Flatten, BatchNorm, Scale and Split on the CPU backend: float64 references and gradients."""
import numpy as np
import pytest
from google.protobuf import text_format
from harness import _numeric, check_gradients, forward, make_layer

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net


def _f32(v):
    """A prototxt float field's value as the layer sees it (the schema stores float32)."""
    return float(np.float32(v))


EPS = _f32(1e-5)  # BatchNorm's default eps


def _rand(rng, *shape):
    # Bounded away from 0 so PROD's top / x and MAX's comparisons stay well conditioned.
    return rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)


def _fd_bottom_gradients(layer, bottoms, top_shapes, rng, eps=1e-6):
    """Central differences of sum(top * R) for a layer whose params the test has set (check_gradients
    draws random ones, which BatchNorm's global statistics cannot take: scale_factor must be positive)."""
    weights = [rng.standard_normal(s) for s in top_shapes]

    def objective():
        tops = forward(layer, [b.copy() for b in bottoms], top_shapes)
        return sum(float((t * w).sum()) for t, w in zip(tops, weights))

    tops = forward(layer, [b.copy() for b in bottoms], top_shapes)
    analytic = [np.zeros_like(b) for b in bottoms]
    layer.backward(tops, [w.copy() for w in weights], [True] * len(bottoms), [b.copy() for b in bottoms], analytic)
    return analytic, [_numeric(objective, b, eps) for b in bottoms]


# ---- Concat -----------------------------------------------------------------------------------

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


# ---- Eltwise ----------------------------------------------------------------------------------

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


# ---- Flatten ----------------------------------------------------------------------------------

def test_flatten_shapes():
    cases = {
        "": (2, 60),
        "flatten_param { axis: 2 }": (2, 3, 20),
        "flatten_param { axis: 1 end_axis: 2 }": (2, 12, 5),
        "flatten_param { axis: -3 end_axis: -2 }": (2, 12, 5),
        "flatten_param { axis: 0 }": (120,),
        "flatten_param { axis: 3 }": (2, 3, 4, 5),
    }
    for extra, want in cases.items():
        layer, shapes = make_layer(f"type: 'Flatten' {extra}", [(2, 3, 4, 5)])
        assert shapes == [want], extra
        assert layer.shares_data and layer.shares_diff and layer.backward_needs() == frozenset()
    with pytest.raises(UserError, match=r"end_axis 1 \(axis 1\) comes before axis 2"):
        make_layer("type: 'Flatten' flatten_param { axis: 2 end_axis: 1 }", [(2, 3, 4, 5)])
    with pytest.raises(UserError, match="axis 4 out of range for a 4-D blob"):
        make_layer("type: 'Flatten' flatten_param { axis: 4 }", [(2, 3, 4, 5)])


def _net(text, seed=5):
    return Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=seed)


def test_flatten_top_and_diff_are_views_in_a_net():
    net = _net("""
    force_backward: true
    layer { name: 'in' type: 'Input' top: 'x' top: 'w'
            input_param { shape { dim: 2 dim: 3 dim: 4 } shape { dim: 2 dim: 12 } } }
    layer { name: 'flat' type: 'Flatten' bottom: 'x' top: 'xf' }
    layer { name: 'prod' type: 'Eltwise' bottom: 'xf' bottom: 'w' top: 'loss'
            eltwise_param { operation: PROD } loss_weight: 1 }
    """)
    rng = np.random.default_rng(30)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((2, 12)).astype(np.float32)
    net.data["x"].array[...] = x
    net.data["w"].array[...] = w
    assert net.data["xf"].array.shape == (2, 12)
    assert np.shares_memory(net.data["xf"].array, net.data["x"].array)
    loss = net.forward()
    np.testing.assert_allclose(loss, float((x.reshape(2, 12) * w).sum()), rtol=1e-5)
    net.backward()
    np.testing.assert_array_equal(net.diff["x"].array, w.reshape(2, 3, 4))


# ---- BatchNorm --------------------------------------------------------------------------------

def _bn_reference(x, eps=EPS):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps), mean.ravel(), var.ravel()


def _set_bn_stats(layer, mean_sum, var_sum, scale_factor):
    layer.params[0].data[...] = mean_sum
    layer.params[1].data[...] = var_sum
    layer.params[2].data[...] = scale_factor


def test_batch_norm_train_forward_and_gradient():
    rng = np.random.default_rng(40)
    for shape in ((4, 3, 2, 3), (6, 4)):
        x = rng.standard_normal(shape) * 2.0 + 0.7
        layer, shapes = make_layer("type: 'BatchNorm' batch_norm_param { eps: 0.001 }", [shape])
        assert [p.shape for p in layer.params] == [(shape[1],), (shape[1],), (1,)]
        assert not any(p.learnable for p in layer.params)
        assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
        (y,) = forward(layer, [x.copy()], shapes)
        np.testing.assert_allclose(y, _bn_reference(x, _f32(1e-3))[0], rtol=1e-12, atol=1e-12)
        check_gradients("type: 'BatchNorm' batch_norm_param { eps: 0.001 }", [x], rtol=1e-4, atol=1e-7)


def test_batch_norm_gradient_matches_formula():
    """The analytic batch-statistics gradient against an independent float64 formula."""
    rng = np.random.default_rng(41)
    x = rng.standard_normal((5, 2, 3))
    dy = rng.standard_normal(x.shape)
    layer, shapes = make_layer("type: 'BatchNorm'", [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    dx = np.zeros_like(x)
    layer.backward([y], [dy], [True], [x], [dx])
    x_hat, mean, var = _bn_reference(x)
    m = 5 * 3
    inv_std = 1 / np.sqrt(var + EPS).reshape(1, 2, 1)
    # d/dx of sum(dy * x_hat), written out term by term over the m values of a channel.
    dvar = (dy * (x - mean.reshape(1, 2, 1))).sum(axis=(0, 2), keepdims=True) * -0.5 * inv_std ** 3
    dmean = -(dy * inv_std).sum(axis=(0, 2), keepdims=True)
    want = dy * inv_std + dvar * 2 * (x - mean.reshape(1, 2, 1)) / m + dmean / m
    np.testing.assert_allclose(dx, want, rtol=1e-10, atol=1e-12)


def test_batch_norm_global_stats_forward_and_gradient():
    rng = np.random.default_rng(42)
    x = rng.standard_normal((3, 4, 2, 2))
    mean_sum, var_sum, factor = rng.standard_normal(4), rng.uniform(0.5, 2.0, 4), 2.5
    for proto, phase in (("type: 'BatchNorm'", pb.TEST),
                         ("type: 'BatchNorm' batch_norm_param { use_global_stats: true }", pb.TRAIN)):
        layer, shapes = make_layer(proto, [x.shape], phase=phase)
        assert layer.use_global_stats and layer.backward_needs() == frozenset()
        _set_bn_stats(layer, mean_sum, var_sum, factor)
        (y,) = forward(layer, [x.copy()], shapes)
        mean, var = mean_sum / factor, var_sum / factor
        want = (x - mean.reshape(1, 4, 1, 1)) / np.sqrt(var.reshape(1, 4, 1, 1) + EPS)
        np.testing.assert_allclose(y, want, rtol=1e-12)
        np.testing.assert_array_equal(layer.params[0].data, mean_sum)  # global stats are read, not updated
        analytic, numeric = _fd_bottom_gradients(layer, [x], shapes, rng)
        np.testing.assert_allclose(analytic[0], numeric[0], rtol=1e-5, atol=1e-8)
    # A zero scale factor (nothing accumulated yet) means mean 0 and variance 0, as in Caffe.
    layer, shapes = make_layer("type: 'BatchNorm'", [x.shape], phase=pb.TEST)
    _set_bn_stats(layer, mean_sum, var_sum, 0.0)
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, x / np.sqrt(EPS), rtol=1e-12)


def test_batch_norm_running_statistics_over_two_iterations():
    rng = np.random.default_rng(43)
    x1, x2 = rng.standard_normal((4, 3, 5)) + 1.0, rng.standard_normal((4, 3, 5)) * 3.0
    layer, shapes = make_layer("type: 'BatchNorm' batch_norm_param { moving_average_fraction: 0.9 }", [x1.shape])
    maf, m = _f32(0.9), 4 * 5
    _set_bn_stats(layer, 0.0, 0.0, 0.0)
    forward(layer, [x1.copy()], shapes)
    forward(layer, [x2.copy()], shapes)
    (_, mu1, v1), (_, mu2, v2) = _bn_reference(x1), _bn_reference(x2)
    factor = 1.0 * maf + 1.0
    mean_sum = mu1 * maf + mu2
    var_sum = m / (m - 1) * v1 * maf + m / (m - 1) * v2
    np.testing.assert_allclose(layer.params[2].data, [factor], rtol=1e-14)
    np.testing.assert_allclose(layer.params[0].data, mean_sum, rtol=1e-12)
    np.testing.assert_allclose(layer.params[1].data, var_sum, rtol=1e-12)
    # The unbiased running variance matches NumPy's ddof=1 on a single batch.
    np.testing.assert_allclose(v1 * m / (m - 1), x1.transpose(1, 0, 2).reshape(3, -1).var(axis=1, ddof=1))
    # A TEST-phase layer with these statistics normalizes by the running averages.
    test_layer, _ = make_layer("type: 'BatchNorm'", [x1.shape], phase=pb.TEST)
    _set_bn_stats(test_layer, mean_sum, var_sum, factor)
    (y,) = forward(test_layer, [x1.copy()], shapes)
    want = (x1 - (mean_sum / factor).reshape(1, 3, 1)) / np.sqrt((var_sum / factor).reshape(1, 3, 1) + EPS)
    np.testing.assert_allclose(y, want, rtol=1e-12)


def test_batch_norm_recomputed_forward_leaves_running_stats_unchanged():
    rng = np.random.default_rng(44)
    x = rng.standard_normal((3, 2, 4)).astype(np.float32)
    layer, shapes = make_layer("type: 'BatchNorm'", [x.shape], dtype=np.float32)
    _set_bn_stats(layer, rng.standard_normal(2), rng.uniform(1, 2, 2), 3.0)
    (y,) = forward(layer, [x.copy()], shapes, dtype=np.float32)
    stats = [p.data.copy() for p in layer.params]
    assert not np.array_equal(stats[2], [3.0])  # the first forward did update them
    layer.ctx.recomputing = True
    (y_again,) = forward(layer, [x.copy()], shapes, dtype=np.float32)
    layer.ctx.recomputing = False
    np.testing.assert_array_equal(y_again, y)
    for p, before in zip(layer.params, stats):
        np.testing.assert_array_equal(p.data, before)
        assert p.data.dtype == np.float32


def test_batch_norm_in_place_matches_out_of_place():
    rng = np.random.default_rng(45)
    x = rng.standard_normal((4, 3, 2))
    dy = rng.standard_normal(x.shape)
    ref, shapes = make_layer("type: 'BatchNorm'", [x.shape])
    _set_bn_stats(ref, 0.0, 0.0, 0.0)
    (y_ref,) = forward(ref, [x.copy()], shapes)
    dx_ref = np.zeros_like(x)
    ref.backward([y_ref], [dy.copy()], [True], [x.copy()], [dx_ref])

    layer, _ = make_layer("type: 'BatchNorm' bottom: 'a' top: 'a'", [x.shape])
    assert layer.in_place and layer.backward_needs() == frozenset()
    _set_bn_stats(layer, 0.0, 0.0, 0.0)
    data = x.copy()
    layer.forward([data], [data])
    np.testing.assert_array_equal(data, y_ref)
    data[...] = 123.0  # a following in-place layer (Scale) overwrites the blob before this backward
    diff = dy.copy()
    layer.backward([data], [diff], [True], [data], [diff])
    np.testing.assert_allclose(diff, dx_ref, rtol=1e-13, atol=1e-14)
    for p, p_ref in zip(layer.params, ref.params):
        np.testing.assert_array_equal(p.data, p_ref.data)


# ---- Scale ------------------------------------------------------------------------------------

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


# ---- BatchNorm + Scale in a Net ---------------------------------------------------------------

_BN_SCALE_NET = """
name: 'bn_scale'
force_backward: true
layer {{ name: 'in' type: 'Input' top: 'x' top: 'w'
        input_param {{ shape {{ dim: 4 dim: 3 dim: 2 dim: 2 }} }} }}
layer {{ name: 'bn' type: 'BatchNorm' bottom: 'x' top: '{bn_top}' batch_norm_param {{ moving_average_fraction: 0.5 }} }}
layer {{ name: 'sc' type: 'Scale' bottom: '{bn_top}' top: '{sc_top}'
        scale_param {{ bias_term: true filler {{ type: 'gaussian' std: 1 }}
                      bias_filler {{ type: 'gaussian' std: 1 }} }} }}
layer {{ name: 'loss' type: 'Eltwise' bottom: '{sc_top}' bottom: 'w' top: 'loss'
        eltwise_param {{ operation: PROD }} loss_weight: 1 }}
"""


def test_batch_norm_and_scale_in_place_in_a_net():
    """The usual ResNet pattern (BN and Scale in place on one blob) trains like the out-of-place net."""
    rng = np.random.default_rng(60)
    in_place = _net(_BN_SCALE_NET.format(bn_top="x", sc_top="x"))
    separate = _net(_BN_SCALE_NET.format(bn_top="bn", sc_top="sc"))
    for it in range(2):
        x = (rng.standard_normal((4, 3, 2, 2)) * 1.5 + 0.3).astype(np.float32)
        w = rng.standard_normal(x.shape).astype(np.float32)
        results = []
        for net in (in_place, separate):
            net.clear_param_diffs()
            net.data["x"].array[...] = x
            net.data["w"].array[...] = w
            loss = net.forward_backward()
            results.append((loss, net.diff["x"].array.copy(), [p.diff.copy() for p in net.layer("sc").params],
                            [p.data.copy() for p in net.layer("bn").params]))
        (loss_a, dx_a, pd_a, st_a), (loss_b, dx_b, pd_b, st_b) = results
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
        np.testing.assert_allclose(dx_a, dx_b, rtol=1e-5, atol=1e-6)
        for a, b in zip(pd_a + st_a, pd_b + st_b):
            np.testing.assert_array_equal(a, b)
        # And both match a float64 reference of y = BN(x) * s + b, dL/dy = w.
        s, b = (p.data.astype(np.float64).reshape(1, 3, 1, 1) for p in separate.layer("sc").params)
        x_hat, _, var = _bn_reference(x.astype(np.float64))
        np.testing.assert_allclose(loss_b, float(((x_hat * s + b) * w).sum()), rtol=1e-4)
        np.testing.assert_allclose(pd_b[0], (w * x_hat).sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
        assert dx_a.dtype == np.float32 and np.abs(dx_a).max() > 1e-3
    assert float(st_a[2][0]) == 0.5 * 1.0 + 1.0  # two iterations folded in


# ---- Split ------------------------------------------------------------------------------------

def test_split_sums_diffs_and_copies_when_asked():
    rng = np.random.default_rng(70)
    x = rng.standard_normal((2, 3))
    layer, shapes = make_layer("type: 'Split' top: 'a' top: 'b' top: 'c'", [x.shape])
    assert shapes == [x.shape] * 3 and layer.backward_needs() == frozenset()
    layer.copy_data = True  # the graph sets this when a consumer works in place on a top
    tops = forward(layer, [x.copy()], shapes)
    for t in tops:
        np.testing.assert_array_equal(t, x)
    weights = [rng.standard_normal(x.shape) for _ in range(3)]
    dx = np.zeros_like(x)
    layer.backward(tops, [w.copy() for w in weights], [True], [x], [dx])
    np.testing.assert_allclose(dx, weights[0] + weights[1] + weights[2], rtol=1e-14)

    def objective():
        return sum(float((t * w).sum()) for t, w in zip(forward(layer, [x], shapes), weights))

    np.testing.assert_allclose(dx, _numeric(objective, x, 1e-6), rtol=1e-6, atol=1e-8)
