"""Sigmoid, TanH, Dropout, Softmax, SoftmaxWithLoss and Accuracy on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from google.protobuf import text_format
from harness import check_gradients, forward, make_layer

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cpu.dropout import keep_mask
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

FLT_MIN = float(np.finfo(np.float32).tiny)


def _in_place(prototxt: str) -> str:
    return prototxt + " bottom: 'x' top: 'x'"


# ---- Sigmoid, TanH ----------------------------------------------------------------------------

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
    layer, _ = make_layer(_in_place(proto), [x.shape])
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


# ---- Dropout ----------------------------------------------------------------------------------

def _fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _spec_keep(i, ratio, seed, iteration, layer_index):
    """The mask formula exactly as the dropout ops module documents it, one element in plain Python ints."""
    g = 0x9E3779B9
    k1 = _fmix32((seed % 2**32 + g) % 2**32)
    k1 = _fmix32(((k1 ^ iteration % 2**32) + g) % 2**32)
    k1 = _fmix32(((k1 ^ layer_index % 2**32) + g) % 2**32)
    k2 = _fmix32((k1 + g) % 2**32)
    h = _fmix32((_fmix32(i ^ k1) + k2) % 2**32)
    return (h >> 8) >= int(np.ceil(ratio * 2**24))


def test_dropout_mask_matches_documented_formula_bit_for_bit():
    rng = np.random.default_rng(11)
    n = 5000
    for ratio, seed, iteration, layer_index in ((0.5, 1234, 0, 3), (0.1, -7, 123456, 0), (0.9, 2**40 + 5, 9, 17)):
        mask = keep_mask(n, ratio, seed, iteration, layer_index)
        for i in rng.choice(n, 200, replace=False):
            assert mask[i] == _spec_keep(int(i), ratio, seed, iteration, layer_index), (ratio, seed, i)


def test_dropout_mask_statistics_and_dependence_on_the_stream():
    n = 1 << 20
    for ratio in (0.2, 0.5, 0.75):
        dropped = 1.0 - keep_mask(n, ratio, 1, 0, 0).mean()
        assert abs(dropped - ratio) < 0.004, (ratio, dropped)  # std of the fraction is < 0.0005
    base = keep_mask(n, 0.5, 1, 5, 2)
    np.testing.assert_array_equal(base, keep_mask(n, 0.5, 1, 5, 2))
    # A change of any key gives an unrelated mask: about half the positions disagree.
    for other in (keep_mask(n, 0.5, 1, 6, 2), keep_mask(n, 0.5, 1, 5, 3), keep_mask(n, 0.5, 2, 5, 2)):
        assert abs((base != other).mean() - 0.5) < 0.005
    # Neighbouring elements are not correlated.
    assert abs((base[1:] != base[:-1]).mean() - 0.5) < 0.005


def test_dropout_train_forward_backward_and_gradient():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 5, 3, 3)) + 0.1  # no exact zeros: y == 0 then means "dropped"
    proto = "type: 'Dropout' dropout_param { dropout_ratio: 0.3 }"
    ratio = float(np.float32(0.3))  # the prototxt field is a float32
    layer, shapes = make_layer(proto, [x.shape], iteration=7)
    layer.layer_index = 4
    (y,) = forward(layer, [x.copy()], shapes)
    keep = keep_mask(x.size, ratio, 1234, 7, 4).reshape(x.shape)
    assert 0 < keep.sum() < x.size
    np.testing.assert_allclose(y, np.where(keep, x / (1 - ratio), 0.0), rtol=1e-12)
    # Backward regenerates the same mask from the context alone (no bottom, no top).
    assert layer.backward_needs() == frozenset()
    dy = rng.standard_normal(x.shape)
    dx = np.full(x.shape, np.nan)
    layer.backward([None], [dy.copy()], [True], [None], [dx])
    np.testing.assert_allclose(dx, np.where(keep, dy / (1 - ratio), 0.0), rtol=1e-12)
    # Another iteration draws another mask.
    layer.ctx.iteration = 8
    (y8,) = forward(layer, [x.copy()], shapes)
    assert ((y8 == 0) != (y == 0)).any()
    check_gradients(proto, [x])


def test_dropout_in_place_float32_and_test_phase_identity():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 50)).astype(np.float32) + np.float32(0.1)
    proto = "type: 'Dropout' dropout_param { dropout_ratio: 0.5 }"
    layer, _ = make_layer(_in_place(proto), [x.shape])
    buf = x.copy()
    layer.forward([buf], [buf])
    assert buf.dtype == np.float32
    keep = keep_mask(x.size, 0.5, 1234, 0, 0).reshape(x.shape)
    np.testing.assert_array_equal(buf, np.where(keep, x * np.float32(2.0), np.float32(0)))

    test_layer, shapes = make_layer(proto, [x.shape], phase=pb.TEST)
    (y,) = forward(test_layer, [x.copy()], shapes, dtype=np.float32)
    np.testing.assert_array_equal(y, x)
    dx = np.zeros_like(x)
    test_layer.backward([y], [x.copy()], [True], [x], [dx])
    np.testing.assert_array_equal(dx, x)


@pytest.mark.parametrize("ratio", [1.0, -0.1])
def test_dropout_rejects_ratio_outside_unit_interval(ratio):
    with pytest.raises(UserError, match=r"under_test.*dropout_ratio"):
        make_layer(f"type: 'Dropout' dropout_param {{ dropout_ratio: {ratio} }}", [(2, 3)])


# ---- Softmax ----------------------------------------------------------------------------------

def _softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("axis", [1, 2, -1, 0])
def test_softmax_reference_and_gradient(axis):
    rng = np.random.default_rng(14)
    x = 3.0 * rng.standard_normal((2, 4, 3, 2))
    proto = f"type: 'Softmax' softmax_param {{ axis: {axis} }}"
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, _softmax_ref(x, axis), rtol=1e-12)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-12)
    check_gradients(proto, [x])


def test_softmax_stable_in_place_and_float32():
    rng = np.random.default_rng(15)
    x = rng.standard_normal((3, 5, 2)) + 1000.0  # exp(x) alone would overflow
    layer, _ = make_layer(_in_place("type: 'Softmax'"), [x.shape])
    buf = x.copy()
    with np.errstate(over="raise"):
        layer.forward([buf], [buf])
    ref = _softmax_ref(x, 1)
    np.testing.assert_allclose(buf, ref, rtol=1e-9)
    dy = rng.standard_normal(x.shape)
    diff = dy.copy()
    layer.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(diff, ref * (dy - (dy * ref).sum(axis=1, keepdims=True)), rtol=1e-9, atol=1e-12)

    layer32, shapes = make_layer("type: 'Softmax'", [x.shape])
    (y32,) = forward(layer32, [x.astype(np.float32)], shapes, dtype=np.float32)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, ref, rtol=1e-4)


# ---- SoftmaxWithLoss --------------------------------------------------------------------------

MODES = ["FULL", "VALID", "BATCH_SIZE", "NONE"]


def _loss_case(rng, shape=(3, 4, 2, 2), ignore=None):
    """Random scores and float labels of shape (N, 1, H, W); about a third ignored when `ignore` is set."""
    n, c = shape[0], shape[1]
    scores = 2.0 * rng.standard_normal(shape)
    labels = rng.integers(0, c, (n, 1) + shape[2:]).astype(np.float64)
    if ignore is not None:
        labels[rng.random(labels.shape) < 0.35] = ignore
        labels.flat[0] = 1  # at least one counted position
    return scores, labels


def _loss_ref(scores, labels, ignore, mode):
    """Direct float64 loop: mean -log softmax(scores)[label] with Caffe's normalizers."""
    prob = _softmax_ref(scores, 1)
    n, c = scores.shape[:2]
    inner = int(np.prod(scores.shape[2:]))
    p, lab = prob.reshape(n, c, inner), labels.reshape(n, inner)
    total, valid = 0.0, 0
    for i in range(n):
        for j in range(inner):
            if ignore is not None and lab[i, j] == ignore:
                continue
            total -= np.log(max(p[i, int(lab[i, j]), j], FLT_MIN))
            valid += 1
    norm = {"FULL": n * inner, "VALID": valid, "BATCH_SIZE": n, "NONE": 1}[mode]
    return total / max(norm, 1), prob


def _loss_proto(ignore, mode=None, extra=""):
    fields = (f"ignore_label: {ignore} " if ignore is not None else "") + (f"normalization: {mode}" if mode else "")
    return f"type: 'SoftmaxWithLoss' loss_param {{ {fields} }} {extra}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore", [None, 3])
def test_softmax_loss_reference_and_gradient(mode, ignore):
    rng = np.random.default_rng(16 + MODES.index(mode))
    scores, labels = _loss_case(rng, ignore=ignore)
    proto = _loss_proto(ignore, mode)
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [()] and layer.is_loss and layer.label_bottoms == (1,)
    (loss,) = forward(layer, [scores.copy(), labels.copy()], shapes)
    ref, _ = _loss_ref(scores, labels, ignore, mode)
    np.testing.assert_allclose(loss, ref, rtol=1e-12)
    # The random top weight plays the loss weight the Net writes into the top diff.
    check_gradients(proto, [scores, labels], check_bottoms=[0])


def test_softmax_loss_legacy_normalize_and_default():
    rng = np.random.default_rng(20)
    scores, labels = _loss_case(rng, ignore=0)
    bottoms = [scores, labels]
    cases = {"": "VALID", "normalize: true": "VALID", "normalize: false": "BATCH_SIZE",
             "normalize: false normalization: FULL": "FULL"}
    values = {}
    for fields, mode in cases.items():
        layer, shapes = make_layer(f"type: 'SoftmaxWithLoss' loss_param {{ ignore_label: 0 {fields} }}",
                                   [b.shape for b in bottoms])
        (values[fields],) = forward(layer, [b.copy() for b in bottoms], shapes)
        np.testing.assert_allclose(values[fields], _loss_ref(scores, labels, 0, mode)[0], rtol=1e-12)
    assert len({float(v) for v in values.values()}) == 3  # the modes really differ on this case


def test_softmax_loss_second_top_backward_scale_and_axis():
    rng = np.random.default_rng(21)
    scores = rng.standard_normal((5, 3, 6))  # classes on axis 2
    labels = rng.integers(0, 6, (5, 3)).astype(np.float64)
    proto = ("type: 'SoftmaxWithLoss' softmax_param { axis: 2 } loss_param { normalization: FULL } "
             "bottom: 's' bottom: 'l' top: 'loss' top: 'prob'")
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [(), scores.shape]
    loss, prob = forward(layer, [scores.copy(), labels.copy()], shapes)
    ref_prob = _softmax_ref(scores, 2)
    np.testing.assert_allclose(prob, ref_prob, rtol=1e-12)
    onehot = np.eye(6)[labels.astype(int)]
    np.testing.assert_allclose(loss, -np.log((ref_prob * onehot).sum(-1)).mean(), rtol=1e-12)
    dx = np.full(scores.shape, np.nan)
    weight = np.array(2.5)
    layer.backward([loss, prob], [weight, rng.standard_normal(prob.shape)], [True, False],
                   [scores, labels], [dx, None])
    np.testing.assert_allclose(dx, 2.5 * (ref_prob - onehot) / 15, rtol=1e-12)


def test_softmax_loss_clamps_vanishing_probability_at_flt_min():
    layer, shapes = make_layer("type: 'SoftmaxWithLoss'", [(1, 2), (1,)])
    (loss,) = forward(layer, [np.array([[0.0, -2000.0]]), np.array([1.0])], shapes)
    np.testing.assert_allclose(loss, -np.log(FLT_MIN), rtol=1e-12)
    assert np.isfinite(loss)


def test_softmax_loss_and_accuracy_reject_bad_labels():
    for type_name in ("SoftmaxWithLoss", "Accuracy"):
        with pytest.raises(UserError, match=r"under_test.*label blob 'b1' has 5 values.*6 positions"):
            make_layer(f"type: '{type_name}'", [(6, 4), (5,)])
        layer, shapes = make_layer(f"type: '{type_name}'", [(3, 4), (3,)])
        with pytest.raises(UserError, match=r"under_test.*1 label\(s\) outside the 4 classes.*e\.g\. 4.*'b1'"):
            forward(layer, [np.zeros((3, 4)), np.array([0.0, 4.0, 2.0])], shapes)
    # An ignored value may lie outside the classes (e.g. 255 for "void" pixels).
    layer, shapes = make_layer("type: 'SoftmaxWithLoss' loss_param { ignore_label: 255 }", [(3, 4), (3,)])
    (loss,) = forward(layer, [np.zeros((3, 4)), np.array([0.0, 255.0, 2.0])], shapes)
    np.testing.assert_allclose(loss, np.log(4.0), rtol=1e-12)


def test_softmax_loss_in_a_net_float32():
    """The scalar top, the prob buffer and the loss weight work through the Net's pool in float32."""
    text = """
    name: 'tiny'
    layer { name: 'in' type: 'Input' top: 'x' top: 'label'
            input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
    layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'score'
            inner_product_param { num_output: 5 weight_filler { type: 'gaussian' std: 0.5 } } }
    layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'score' bottom: 'label' top: 'loss' loss_weight: 2 }
    layer { name: 'acc' type: 'Accuracy' bottom: 'score' bottom: 'label' top: 'acc' }
    """
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    net = Net(graph, CpuBackend(), seed=3)
    rng = np.random.default_rng(22)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    label = np.array([0, 4, 2, 1], np.float32)
    net.data["x"].array[...] = x
    net.data["label"].array[...] = label
    loss = net.forward()
    w, b = net.layer("ip").params[0].data, net.layer("ip").params[1].data
    score = x.astype(np.float64) @ w.T.astype(np.float64) + b
    prob = _softmax_ref(score, 1)
    ref = -np.log(prob[np.arange(4), label.astype(int)]).mean()
    np.testing.assert_allclose(loss, 2 * ref, rtol=1e-5)
    assert net.blob("loss").shape == () and net.blob("acc").shape == ()
    np.testing.assert_allclose(net.blob("acc"), np.mean(score.argmax(1) == label))
    net.backward()
    dscore = 2 * (prob - np.eye(5)[label.astype(int)]) / 4
    np.testing.assert_allclose(net.diff["score"].array, dscore, rtol=1e-4, atol=1e-6)
    assert net.diff["score"].array.dtype == np.float32


# ---- Accuracy ---------------------------------------------------------------------------------

def _topk_ref(scores, labels, k, axis, ignore):
    """Direct computation: is the label among the k largest scores along `axis` (no ties in random data)."""
    s = np.moveaxis(scores, axis, -1)
    c = s.shape[-1]
    s = s.reshape(-1, c)
    lab = labels.reshape(-1)
    top = np.argsort(-s, axis=1)[:, :k]
    counted = lab != ignore if ignore is not None else np.ones(lab.shape, bool)
    hit = np.array([int(l) in t for l, t in zip(lab, top)]) & counted
    per_class = [hit[counted & (lab == j)].mean() if (counted & (lab == j)).any() else 0.0 for j in range(c)]
    return hit.sum() / max(counted.sum(), 1), np.array(per_class)


@pytest.mark.parametrize("shape,axis,k,ignore", [
    ((40, 7), 1, 1, None),
    ((40, 7), 1, 3, 2),
    ((6, 5, 3, 4), 1, 2, None),
    ((6, 3, 4, 5), -1, 1, 0),
])
def test_accuracy_against_numpy_topk(shape, axis, k, ignore):
    rng = np.random.default_rng(23 + k)
    scores = rng.standard_normal(shape)
    c = shape[axis]
    label_shape = tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    labels = rng.integers(0, c, label_shape).astype(np.float64)
    axis_field = f"axis: {axis} " if axis != 1 else ""
    ignore_field = f"ignore_label: {ignore} " if ignore is not None else ""
    proto = (f"type: 'Accuracy' accuracy_param {{ top_k: {k} {axis_field}{ignore_field}}} "
             "bottom: 's' bottom: 'l' top: 'acc' top: 'per_class'")
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [(), (c,)] and not layer.has_backward
    acc, per_class = forward(layer, [scores, labels], shapes)
    ref_acc, ref_per_class = _topk_ref(scores, labels, k, axis, ignore)
    assert 0.0 < ref_acc < 1.0  # a case that can tell right from wrong
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-12)
    np.testing.assert_allclose(per_class, ref_per_class, rtol=1e-12)


def test_accuracy_ties_count_against_the_true_class_as_in_caffe():
    layer, shapes = make_layer("type: 'Accuracy' accuracy_param { top_k: 2 } top: 'acc' top: 'per_class'",
                               [(4, 4), (4,)])
    scores = np.array([[1.0, 1.0, 1.0, 1.0],    # all tied: 3 others >= true, not in top 2
                       [3.0, 2.0, 2.0, 0.0],    # true 2 ties with 1, one higher: 2 others >= -> wrong
                       [3.0, 2.0, 1.0, 0.0],    # true 1: one higher -> right
                       [2.0, 2.0, 0.0, 0.0]])   # true 1 ties with 0 only -> right
    acc, per_class = forward(layer, [scores, np.array([0.0, 2.0, 1.0, 1.0])], shapes)
    np.testing.assert_allclose(acc, 0.5)
    np.testing.assert_allclose(per_class, [0.0, 1.0, 0.0, 0.0])  # class 3 never appears: 0, as in Caffe


def test_accuracy_rejects_top_k_beyond_classes_and_all_ignored_gives_zero():
    with pytest.raises(UserError, match=r"top_k is 5.*4 classes"):
        make_layer("type: 'Accuracy' accuracy_param { top_k: 5 }", [(3, 4), (3,)])
    layer, shapes = make_layer("type: 'Accuracy' accuracy_param { ignore_label: 1 }", [(3, 4), (3,)])
    (acc,) = forward(layer, [np.random.default_rng(0).standard_normal((3, 4)), np.ones(3)], shapes)
    assert acc == 0.0
