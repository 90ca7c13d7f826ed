"""The Euclidean, SigmoidCrossEntropy, Hinge, Contrastive, MultinomialLogistic and Infogain losses
(layers/losses.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError
from superneurons.io.binaryproto import array_to_blob
from superneurons.io.prototxt import write_binary


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_euclidean_loss_reference_and_gradient():
    rng = np.random.default_rng(112)
    a = rng.standard_normal((4, 3, 2))
    b = rng.standard_normal((4, 6))
    layer, shapes = make_layer("type: 'EuclideanLoss'", [a.shape, b.shape])
    assert shapes == [()] and layer.is_loss and layer.label_bottoms == ()
    (loss,) = forward(layer, [a, b], shapes)
    np.testing.assert_allclose(loss, ((a.reshape(4, 6) - b) ** 2).sum() / 8, rtol=1e-12)
    check_gradients("type: 'EuclideanLoss'", [a, b])
    with pytest.raises(UserError, match=r"shapes \(4, 6\) and \(4, 5\)"):
        make_layer("type: 'EuclideanLoss'", [(4, 6), (4, 5)])


def _sigmoid_ce_ref(x, t, ignore, mode):
    p = _sig(x)
    terms = t * np.log(p) + (1 - t) * np.log(1 - p)
    valid = np.ones(x.shape, bool) if ignore is None else t != ignore
    norm = {"FULL": x.size, "VALID": valid.sum(), "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return -terms[valid].sum() / max(norm, 1)


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, -1])
def test_sigmoid_cross_entropy_loss_reference_and_gradient(mode, ignore):
    rng = np.random.default_rng(113)
    x = 2.0 * rng.standard_normal((3, 2, 3))
    t = rng.random(x.shape)
    if ignore is not None:
        t[rng.random(x.shape) < 0.3] = ignore
    fields = (f"ignore_label: {ignore} " if ignore is not None else "") + f"normalization: {mode}"
    proto = f"type: 'SigmoidCrossEntropyLoss' loss_param {{ {fields} }}"
    layer, shapes = make_layer(proto, [x.shape, t.shape])
    assert layer.label_bottoms == (1,)
    (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, _sigmoid_ce_ref(x, t, ignore, mode), rtol=1e-12)
    check_gradients(proto, [x, t], check_bottoms=[0])


def test_sigmoid_cross_entropy_default_is_valid_legacy_normalize_and_stability():
    x = np.array([[800.0, -800.0, 0.0]])
    t = np.array([[0.0, 1.0, 1.0]])
    layer, shapes = make_layer("type: 'SigmoidCrossEntropyLoss'", [x.shape, t.shape])
    with np.errstate(over="raise"):
        (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, (800 + 800 + np.log(2)) / 3, rtol=1e-12)
    layer, shapes = make_layer("type: 'SigmoidCrossEntropyLoss' loss_param { normalize: false }", [x.shape, t.shape])
    (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, 800 + 800 + np.log(2), rtol=1e-12)


def _hinge_ref(x, lab, norm):
    n = x.shape[0]
    x = x.reshape(n, -1)
    total = 0.0
    for i in range(n):
        for j in range(x.shape[1]):
            m = max(0.0, 1 + (-x[i, j] if j == int(lab[i]) else x[i, j]))
            total += m if norm == "L1" else m * m
    return total / n


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_reference_and_gradient(norm):
    rng = np.random.default_rng(114)
    x = rng.standard_normal((5, 4, 1, 1))
    lab = rng.integers(0, 4, (5,)).astype(np.float64)
    proto = f"type: 'HingeLoss' hinge_loss_param {{ norm: {norm} }}"
    layer, shapes = make_layer(proto, [x.shape, lab.shape])
    (loss,) = forward(layer, [x, lab], shapes)
    np.testing.assert_allclose(loss, _hinge_ref(x, lab, norm), rtol=1e-12)
    check_gradients(proto, [x, lab], check_bottoms=[0])
    with pytest.raises(UserError, match=r"under_test.*outside the 4 classes.*'b1'"):
        forward(layer, [x, np.array([0.0, 1, 2, 3, 4])], shapes)


def _contrastive_ref(a, b, sim, margin, legacy):
    total = 0.0
    for i in range(a.shape[0]):
        d2 = ((a[i] - b[i]) ** 2).sum()
        if sim[i]:
            total += d2
        elif legacy:
            total += max(margin - d2, 0.0)
        else:
            total += max(margin - np.sqrt(d2), 0.0) ** 2
    return total / (2 * a.shape[0])


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss_reference_and_gradient(legacy):
    rng = np.random.default_rng(115)
    a = rng.standard_normal((6, 3, 1, 1))
    b = rng.standard_normal((6, 3, 1, 1))
    sim = np.array([1, 0, 0, 1, 0, 0], np.float64).reshape(6, 1, 1, 1)
    margin = 6.0 if legacy else 2.5  # some dissimilar pairs inside the margin, some outside
    proto = (f"type: 'ContrastiveLoss' contrastive_loss_param {{ margin: {margin} "
             f"legacy_version: {str(legacy).lower()} }}")
    layer, shapes = make_layer(proto, [a.shape, b.shape, sim.shape])
    assert layer.label_bottoms == (2,)
    (loss,) = forward(layer, [a, b, sim], shapes)
    np.testing.assert_allclose(loss, _contrastive_ref(a, b, sim.ravel(), margin, legacy), rtol=1e-12)
    # Caffe's non-legacy gradient divides by (d + 1e-4), not d: a 1e-4 relative difference, kept for parity.
    check_gradients(proto, [a, b, sim], check_bottoms=[0, 1], rtol=1e-3 if not legacy else 1e-4)


def test_multinomial_logistic_loss_reference_and_gradient():
    rng = np.random.default_rng(116)
    prob = rng.uniform(0.05, 1.0, (4, 5))
    lab = rng.integers(0, 5, (4, 1, 1, 1)).astype(np.float64)
    layer, shapes = make_layer("type: 'MultinomialLogisticLoss'", [prob.shape, lab.shape])
    (loss,) = forward(layer, [prob, lab], shapes)
    np.testing.assert_allclose(loss, -np.log(prob[np.arange(4), lab.ravel().astype(int)]).mean(), rtol=1e-12)
    check_gradients("type: 'MultinomialLogisticLoss'", [prob, lab], check_bottoms=[0])
    prob[0, int(lab.ravel()[0])] = 0.0
    (loss0,) = forward(layer, [prob, lab], shapes)
    assert np.isfinite(loss0) and loss0 > -np.log(1e-20) / 4 - 1e-9
    with pytest.raises(UserError, match="label blob 'b1' has 3 values for the 4 samples"):
        make_layer("type: 'MultinomialLogisticLoss'", [(4, 5), (3,)])


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _infogain_ref(scores, labels, h, ignore, mode):
    prob = _softmax(scores, 1)
    n, c = scores.shape[:2]
    p = prob.reshape(n, c, -1)
    lab = labels.reshape(n, -1)
    total, valid = 0.0, 0
    for i in range(n):
        for j in range(lab.shape[1]):
            if ignore is not None and lab[i, j] == ignore:
                continue
            total -= sum(h[int(lab[i, j]), k] * np.log(max(p[i, k, j], 1e-20)) for k in range(c))
            valid += 1
    norm = {"FULL": n * lab.shape[1], "VALID": valid, "BATCH_SIZE": n, "NONE": 1}[mode]
    return total / max(norm, 1)


@pytest.mark.parametrize("mode,ignore", [("VALID", None), ("FULL", 2), ("BATCH_SIZE", None)])
def test_infogain_loss_third_bottom_reference_and_gradient(mode, ignore):
    rng = np.random.default_rng(117)
    scores = rng.standard_normal((3, 4, 2))
    labels = rng.integers(0, 4, (3, 2)).astype(np.float64)
    labels[0, 0] = 1
    h = rng.uniform(0, 1, (4, 4))
    fields = (f"ignore_label: {ignore} " if ignore is not None else "") + f"normalization: {mode}"
    proto = f"type: 'InfogainLoss' loss_param {{ {fields} }}"
    layer, shapes = make_layer(proto, [scores.shape, labels.shape, h.shape])
    assert layer.label_bottoms == (1, 2)
    (loss,) = forward(layer, [scores, labels, h], shapes)
    np.testing.assert_allclose(loss, _infogain_ref(scores, labels, h, ignore, mode), rtol=1e-12)
    check_gradients(proto, [scores, labels, h], check_bottoms=[0])


def test_infogain_loss_from_binaryproto_identity_is_softmax_loss(tmp_path):
    rng = np.random.default_rng(118)
    scores = rng.standard_normal((5, 3))
    labels = rng.integers(0, 3, (5,)).astype(np.float64)
    path = tmp_path / "H.binaryproto"
    write_binary(str(path), array_to_blob(np.eye(3, dtype=np.float32).reshape(1, 1, 3, 3)))
    proto = f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }} top: 'loss' top: 'prob'"
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [(), scores.shape]
    loss, prob = forward(layer, [scores, labels], shapes)
    np.testing.assert_allclose(prob, _softmax(scores, 1), rtol=1e-12)
    np.testing.assert_allclose(loss, -np.log(prob[np.arange(5), labels.astype(int)]).mean(), rtol=1e-12)
    check_gradients(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }}", [scores, labels],
                    check_bottoms=[0])
    with pytest.raises(UserError, match=r"3 x 3 matrix|need 4 x 4"):
        make_layer(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }}", [(5, 4), (5,)])
    with pytest.raises(UserError, match="cannot read infogain_loss_param.source.*no such file"):
        make_layer("type: 'InfogainLoss' infogain_loss_param { source: '/nonexistent/H.binaryproto' }",
                   [(5, 3), (5,)])
    with pytest.raises(UserError, match="needs the infogain matrix"):
        make_layer("type: 'InfogainLoss'", [(5, 3), (5,)])
