"""The SoftmaxWithLoss layer (layers/softmax_loss.py) on the CPU backend: float64 reference and gradient,
normalization modes, and bad labels."""
import numpy as np
import pytest
from google.protobuf import text_format
from harness import check_gradients, forward, make_layer, softmax_reference

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

FLT_MIN = float(np.finfo(np.float32).tiny)


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
    prob = softmax_reference(scores, 1)
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
    ref_prob = softmax_reference(scores, 2)
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
    prob = softmax_reference(score, 1)
    ref = -np.log(prob[np.arange(4), label.astype(int)]).mean()
    np.testing.assert_allclose(loss, 2 * ref, rtol=1e-5)
    assert net.blob("loss").shape == () and net.blob("acc").shape == ()
    np.testing.assert_allclose(net.blob("acc"), np.mean(score.argmax(1) == label))
    net.backward()
    dscore = 2 * (prob - np.eye(5)[label.astype(int)]) / 4
    np.testing.assert_allclose(net.diff["score"].array, dscore, rtol=1e-4, atol=1e-6)
    assert net.diff["score"].array.dtype == np.float32


def test_a_deferred_label_check_stops_the_pass_before_the_update(monkeypatch):
    """On the GPU the forward only queues the labels' check (backend/cuda/ops/loss.py: LabelCheck); the Net runs
    it once it has read the loss, so a bad label still raises the layer's error, in forward and in a training
    pass, and only after backward was queued, before the solver could apply anything. Here the CPU op is
    wrapped to return such a check instead of raising at once."""
    text = """
    name: 'tiny'
    layer { name: 'in' type: 'Input' top: 'x' top: 'label'
            input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
    layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'score' inner_product_param { num_output: 5 } }
    layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'score' bottom: 'label' top: 'loss' }
    """
    backend = CpuBackend()
    direct = backend.ops.softmax_loss_forward
    verdicts = []  # when each check ran: the backward steps run before it

    def deferred(*args, **kwargs):
        try:
            direct(*args, **kwargs)
        except UserError as e:
            error = e
        else:
            error = None

        def check():
            verdicts.append(len(backward_calls))
            if error is not None:
                raise error
        return check

    def backward_as_on_the_gpu(prob, label, loss_diff, dx, ignore_label, normalization, scratch=None):  # no check
        lab = np.asarray(label)
        good = np.where((lab >= 0) & (lab < prob.shape[1]), lab, ignore_label if ignore_label is not None else -1)
        direct_backward(prob, good, loss_diff, dx, -1 if ignore_label is None else ignore_label, normalization,
                        scratch=scratch)

    direct_backward = backend.ops.softmax_loss_backward
    monkeypatch.setattr(backend.ops, "softmax_loss_forward", deferred)
    monkeypatch.setattr(backend.ops, "softmax_loss_backward", backward_as_on_the_gpu)
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    net = Net(graph, backend, seed=3)
    backward_calls = []
    layer = net.layer("ip")
    original_backward = layer.backward
    monkeypatch.setattr(layer, "backward", lambda *a: (backward_calls.append(1), original_backward(*a)))
    net.data["x"].array[...] = np.random.default_rng().standard_normal((4, 3))
    net.data["label"].array[...] = np.array([0, 4, 2, 1])
    assert np.isfinite(net.forward_backward()) and verdicts == [1]
    assert net.ctx.deferred_checks == []
    net.data["label"].array[...] = np.array([0, 5, 2, 1])
    with pytest.raises(UserError, match=r"^layer 'loss' \(SoftmaxWithLoss\): 1 label\(s\) outside the 5 classes "
                                        r"\[0, 5\), e.g. 5 in label blob 'label'$"):
        net.forward_backward()
    assert verdicts == [1, 2]  # after the pass's backward
    with pytest.raises(UserError, match="outside the 5 classes"):
        net.forward()
    assert net.ctx.deferred_checks == []  # a raising check leaves none pending
