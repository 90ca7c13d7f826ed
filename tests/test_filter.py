"""Filter (layers/filter.py) and the layers after it (graph/live_batch.py, runtime/live_batch.py) on the CPU
backend, against NumPy references of Caffe's semantics: the tops hold the items whose selector value is nonzero,
in order; backward puts their gradients back and zeros the rest; every layer after the Filter computes on the
kept items only (a loss normalizes by their count)."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from harness import check_gradients, forward, make_layer

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

N = 7
W = "weight_filler { type: 'gaussian' std: 0.5 } bias_filler { type: 'gaussian' std: 0.5 }"


def _net(text, memory="baseline", pool_bytes=None, fuse=None, monkeypatch=None):
    if fuse is not None:
        monkeypatch.setenv("SUPERNEURONS_FUSE", "1" if fuse else "0")
    graph = build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
    return Net(graph, CpuBackend(), seed=3, memory=memory, pool_bytes=pool_bytes)


def _inputs(*shapes):
    names = ("x", "label", "sel")[:len(shapes)]
    dims = " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for s in shapes)
    return ("layer { name: 'in' type: 'Input' " + " ".join(f"top: '{t}'" for t in names)
            + f" input_param {{ {dims} }} }}\n")


def _feed(net, **values):
    for name, v in values.items():
        net.data[name].array[...] = v


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ---- the layer on its own ------------------------------------------------------------------------

@pytest.mark.parametrize("sel", [[1, 0, 2.5, 0, 0, -1, 1], [0] * N, [1] * N, [0, 0, 0, 0, 0, 0, np.nan]])
def test_layer_keeps_the_selected_items_in_order(rng, sel):
    x, y = rng.standard_normal((N, 2, 3)), rng.standard_normal((N,))
    sel = np.array(sel, dtype=np.float64)
    layer, shapes = make_layer("type: 'Filter' top: 't0' top: 't1'", [x.shape, y.shape, (N, 1)])
    assert shapes == [(N, 2, 3), (N,)]  # planned at the full batch
    tx, ty = forward(layer, [x, y, sel.reshape(N, 1)], shapes)
    keep = sel != 0  # NaN is nonzero, as in Caffe's test `!= 0`
    n = int(keep.sum())
    assert layer.selected == n
    np.testing.assert_array_equal(tx[:n], x[keep])
    np.testing.assert_array_equal(ty[:n], y[keep])
    # backward: each kept row's gradient back at its position, zeros elsewhere
    dtx, dty = rng.standard_normal(tx.shape), rng.standard_normal(ty.shape)
    dx, dy = np.full_like(x, 9.0), np.full_like(y, 9.0)
    layer.backward([tx, ty], [dtx, dty], [True, True, False], [x, y, sel], [dx, dy, None])
    want_dx, want_dy = np.zeros_like(x), np.zeros_like(y)
    want_dx[keep], want_dy[keep] = dtx[:n], dty[:n]
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(dy, want_dy)


def test_layer_gradient_by_central_differences(rng):
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 2, 2))
    sel = np.array([0.0, 1.0, 1.0, 0.0, 3.0])
    check_gradients("type: 'Filter' top: 't0' top: 't1'", [x, y, sel], check_bottoms=[0, 1])


def test_selector_gets_no_gradient_and_only_wanted_bottoms_are_written(rng):
    layer, shapes = make_layer("type: 'Filter' top: 't0' top: 't1'", [(4, 2), (4,), (4,)])
    assert layer.label_bottoms == (2,)
    x, y, sel = rng.standard_normal((4, 2)), rng.standard_normal(4), np.array([1.0, 0, 1, 0])
    tops = forward(layer, [x, y, sel], shapes)
    dy = np.full(4, 5.0)
    layer.backward(tops, [np.ones((4, 2)), np.ones(4)], [True, False, False], [x, y, sel],
                   [np.zeros((4, 2)), dy, None])
    np.testing.assert_array_equal(dy, 5.0)  # propagate_down off: untouched


def test_select_nonzero_op(rng):
    ops = CpuBackend().ops
    sel = np.array([0, 2, 0, 0, -1, 1e-30], np.float32)
    pos = np.full(6, -1, np.float32)
    assert ops.select_nonzero(sel, pos) == 3
    np.testing.assert_array_equal(pos[:3], [1, 4, 5])


# ---- a net: Filter -> InnerProduct -> SoftmaxWithLoss (+ Accuracy) ----------------------------------

def _classifier(loss_param="", extra=""):
    return ("force_backward: true\n" + _inputs((N, 4), (N,), (N,))
            + "layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel' top: 'xf' top: 'lf' }\n"
            + f"layer {{ name: 'ip' type: 'InnerProduct' bottom: 'xf' top: 'z' inner_product_param {{ num_output: 3 {W} }} }}\n"
            + f"layer {{ name: 'loss' type: 'SoftmaxWithLoss' bottom: 'z' bottom: 'lf' top: 'loss' {loss_param} }}\n"
            + "layer { name: 'acc' type: 'Accuracy' bottom: 'z' bottom: 'lf' top: 'acc' }\n" + extra)


def _classifier_reference(x, label, sel, w, b, normalization="VALID"):
    """Caffe's loss, accuracy and gradients (x, W, b) in float64 for the kept items."""
    keep = sel != 0
    xk, lk = x[keep].astype(np.float64), label[keep].astype(int)
    n = len(lk)
    z = xk @ w.T.astype(np.float64) + b
    p = _softmax(z) if n else np.zeros((0, 3))
    denom = 1.0 if normalization == "NONE" else max(1.0, float(n))  # FULL: n items x 1 position
    loss = -np.log(p[np.arange(n), lk]).sum() / denom
    acc = float((z.argmax(axis=1) == lk).mean()) if n else 0.0
    dz = p.copy()
    dz[np.arange(n), lk] -= 1
    dz /= denom
    dx = np.zeros(x.shape)
    dx[keep] = dz @ w
    return loss, acc, dx, dz.T @ xk, dz.sum(axis=0), z


@pytest.mark.parametrize("sel", [[1, 0, 1, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1], [1] * N, [0] * N])
def test_net_matches_caffe_semantics(rng, sel):
    net = _net(_classifier())
    x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
    sel = np.array(sel, np.float32)
    _feed(net, x=x, label=label, sel=sel)
    net.clear_param_diffs()
    loss = net.forward_backward()
    ip = net.layer("ip")
    want_loss, want_acc, dx, dw, db, z = _classifier_reference(x, label, sel, ip.weight.data, ip.bias.data)
    n = int((sel != 0).sum())
    assert net.blob("z").shape == (n, 3) and net.blob("xf").shape == (n, 4)  # the kept items only
    np.testing.assert_allclose(net.blob("z"), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.blob("acc"), want_acc, atol=1e-7)
    np.testing.assert_allclose(net.backend.to_host(net.diff["x"].array), dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ip.weight.diff, dw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ip.bias.diff, db, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalization", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_loss_normalizes_by_the_kept_count(rng, normalization):
    net = _net(_classifier(f"loss_param {{ normalization: {normalization} }}"))
    x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
    sel = np.array([0, 1, 1, 0, 1, 0, 0], np.float32)
    _feed(net, x=x, label=label, sel=sel)
    ip = net.layer("ip")
    want = _classifier_reference(x, label, sel, ip.weight.data, ip.bias.data, normalization)[0]
    np.testing.assert_allclose(net.forward(), want, rtol=1e-5)


def test_euclidean_loss_after_filter_divides_by_twice_the_kept_count(rng):
    text = (_inputs((N, 3), (N, 2), (N, 1))
            + "layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel' top: 'xf' top: 'tf' }\n"
            + f"layer {{ name: 'ip' type: 'InnerProduct' bottom: 'xf' top: 'y' inner_product_param {{ num_output: 2 {W} }} }}\n"
            + "layer { name: 'relu' type: 'ReLU' bottom: 'y' top: 'y' }\n"
            + "layer { name: 'loss' type: 'EuclideanLoss' bottom: 'y' bottom: 'tf' top: 'loss' }\n")
    net = _net(text)
    x, t = rng.standard_normal((N, 3)).astype(np.float32), rng.standard_normal((N, 2)).astype(np.float32)
    sel = np.array([[1], [1], [0], [0], [1], [0], [0]], np.float32)
    _feed(net, x=x, label=t, sel=sel)
    net.clear_param_diffs()
    loss = net.forward_backward()
    ip = net.layer("ip")
    keep = sel[:, 0] != 0
    y = np.maximum(x[keep] @ ip.weight.data.T + ip.bias.data, 0)
    np.testing.assert_allclose(loss, ((y - t[keep]) ** 2).sum() / (2 * keep.sum()), rtol=1e-5)
    dy = (y - t[keep]) / keep.sum() * (y > 0)
    np.testing.assert_allclose(ip.weight.diff, dy.T @ x[keep], rtol=1e-5, atol=1e-6)


def _train(text, memory="baseline", iters=5, pool_bytes=None):
    """SGD on the classifier with a different selection each iteration (one keeps nothing, one everything)."""
    net = _net(text, memory, pool_bytes)
    rng = np.random.default_rng(8)
    selections = [[1, 0, 1, 1, 0, 0, 1], [0] * N, [1] * N, [0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0, 1]]
    losses = []
    for it in range(iters):
        net.ctx.iteration = it
        _feed(net, x=rng.standard_normal((N, 4)).astype(np.float32),
              label=rng.integers(0, 3, N).astype(np.float32), sel=np.array(selections[it % 5], np.float32))
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for decl in net.learnable:
            decl.data -= np.float32(0.1) * decl.diff
    return losses, [t.array.copy() for t in net.tensors if t.kind == "param"]


def test_training_follows_the_reference_as_the_selection_changes():
    losses, params = _train(_classifier())
    net = _net(_classifier())  # the same seed: the same initial weights
    w, b = (d.data.astype(np.float64) for d in net.learnable)
    rng = np.random.default_rng(8)
    selections = [[1, 0, 1, 1, 0, 0, 1], [0] * N, [1] * N, [0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0, 1]]
    for it, sel in enumerate(selections):
        x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
        loss, _acc, _dx, dw, db, _z = _classifier_reference(x, label, np.array(sel, np.float32), w, b)
        np.testing.assert_allclose(losses[it], loss, rtol=1e-4, err_msg=f"iteration {it}")
        w, b = w - 0.1 * dw, b - 0.1 * db
    np.testing.assert_allclose(params[0], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(params[1], b, rtol=1e-4, atol=1e-5)


def test_every_memory_mode_trains_like_baseline():
    text = _classifier(extra=(
        f"layer {{ name: 'ip2' type: 'InnerProduct' bottom: 'xf' top: 'h' inner_product_param {{ num_output: 5 {W} }} }}\n"
        "layer { name: 'r2' type: 'ReLU' bottom: 'h' top: 'h' }\n"
        f"layer {{ name: 'ip3' type: 'InnerProduct' bottom: 'h' top: 'z3' inner_product_param {{ num_output: 3 {W} }} }}\n"
        "layer { name: 'loss3' type: 'SoftmaxWithLoss' bottom: 'z3' bottom: 'lf' top: 'loss3' }\n"))
    ref = _train(text)
    for mode in ("liveness", "offload", "recompute", "auto"):
        losses, params = _train(text, mode)
        assert losses == ref[0], mode
        for got, want in zip(params, ref[1]):
            np.testing.assert_array_equal(got, want, err_msg=mode)
