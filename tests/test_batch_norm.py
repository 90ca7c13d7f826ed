"""The BatchNorm layer (layers/batch_norm.py) on the CPU backend: float64 references and gradients, running
statistics, in place, and BatchNorm + Scale in place in a Net."""
import numpy as np
from harness import _numeric, check_gradients, cpu_net, forward, make_layer

from superneurons.layers.base import NEEDS_BOTTOM
from superneurons.proto import superneurons_pb2 as pb


def _f32(v):
    """A prototxt float field's value as the layer sees it (the schema stores float32)."""
    return float(np.float32(v))


EPS = _f32(1e-5)  # BatchNorm's default eps


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
    in_place = cpu_net(_BN_SCALE_NET.format(bn_top="x", sc_top="x"))
    separate = cpu_net(_BN_SCALE_NET.format(bn_top="bn", sc_top="sc"))
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
