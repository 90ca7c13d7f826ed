"""Filter (layers/filter.py) and the layers after it (graph/live_batch.py, runtime/live_batch.py) on the CPU
backend, against NumPy references of Caffe's semantics: the tops hold the items whose selector value is nonzero,
in order; backward puts their gradients back and zeros the rest; every layer after the Filter computes on the
kept items only (a loss normalizes by their count)."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from gpu_harness import GPU_ONLY
from harness import check_gradients, forward, make_layer

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.graph.live_batch import batch_variant
from superneurons.layers.base import Layer
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


def test_net_gradient_by_central_differences(rng):
    """d loss / d x of the whole net against central differences of its own forward: the items left out move
    nothing (zero gradient), the kept ones agree."""
    net = _net(_classifier())
    x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
    _feed(net, x=x, label=label, sel=np.array([0, 1, 1, 0, 1, 0, 1], np.float32))
    net.clear_param_diffs()
    net.forward_backward()
    analytic = net.backend.to_host(net.diff["x"].array).astype(np.float64)
    eps = 1e-2
    for i in range(N):
        for j in (0, 3):
            values = []
            for step in (eps, -eps):
                moved = x.copy()
                moved[i, j] += step
                _feed(net, x=moved)
                values.append(net.forward())
            np.testing.assert_allclose(analytic[i, j], (values[0] - values[1]) / (2 * eps), rtol=2e-2, atol=2e-4,
                                       err_msg=f"x[{i}, {j}]")
    assert not analytic[[0, 3, 5]].any()


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


def _conv_net(hw=16):
    return ("force_backward: true\n" + _inputs((N, 2, hw, hw), (N,), (N,)) + F
            + CONV_TAIL.replace("layer { name: 'p' ", "layer { name: 'drop' type: 'Dropout' bottom: 'c' top: 'c' }\n"
                                                      "layer { name: 'p' "))


def test_every_memory_mode_trains_a_conv_net_after_filter_like_baseline():
    """Buffers (BatchNorm's statistics, the dropout mask, the pooling argmax, the softmax) are the front of the
    planned ones under every memory manager, which frees, offloads and replays the full tensors."""
    def train(memory, pool_bytes=None, keep=None):
        net = _net(_conv_net(), memory, pool_bytes)
        if keep is not None:
            keep.append(net)
        rng = np.random.default_rng(9)
        losses = []
        for it, sel in enumerate(([1, 0, 1, 1, 0, 0, 1], [1] * N, [0, 0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0, 1])):
            net.ctx.iteration = it
            _feed(net, x=rng.standard_normal((N, 2, 16, 16)), label=rng.integers(0, 3, N), sel=np.array(sel))
            net.clear_param_diffs()
            losses.append(net.forward_backward())
            for decl in net.learnable:
                decl.data -= np.float32(0.1) * decl.diff
        return losses, [t.array.copy() for t in net.tensors if t.kind == "param"]

    ref = train("baseline")
    for mode in ("liveness", "offload", "recompute", "auto"):
        losses, params = train(mode)
        assert losses == ref[0], mode
        for got, want in zip(params, ref[1]):
            np.testing.assert_array_equal(got, want, err_msg=mode)
    # The smallest pool each mode trains in (what `superneurons memory` reports): offload and recompute then
    # move the full tensors of live blobs off the device and back.
    from superneurons.memory.plan import make_plan

    plan = make_plan(build_graph(text_format.Parse(_conv_net(), pb.NetParameter()), pb.TRAIN))
    for mode in ("offload", "recompute"):
        nets = []
        losses, params = train(mode, pool_bytes=plan.need(mode)[0], keep=nets)
        assert nets[0].memory.bytes_offloaded > 0, mode
        assert losses == ref[0], mode
        for got, want in zip(params, ref[1]):
            np.testing.assert_array_equal(got, want, err_msg=f"{mode} in its smallest pool")


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


# ---- any net after a Filter computes what it computes on the kept items alone ---------------------------

CONV_TAIL = (
    f"layer {{ name: 'c' type: 'Convolution' bottom: 'xf' top: 'c' convolution_param {{ num_output: 3 kernel_size: 3 pad: 1 {W} }} }}\n"
    "layer { name: 'bn' type: 'BatchNorm' bottom: 'c' top: 'c' }\n"
    f"layer {{ name: 'sc' type: 'Scale' bottom: 'c' top: 'c' scale_param {{ bias_term: true }} }}\n"
    "layer { name: 'r' type: 'ReLU' bottom: 'c' top: 'c' }\n"
    "layer { name: 'p' type: 'Pooling' bottom: 'c' top: 'p' pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n"
    f"layer {{ name: 'ip' type: 'InnerProduct' bottom: 'p' top: 'z' inner_product_param {{ num_output: 3 {W} }} }}\n"
    "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'z' bottom: 'lf' top: 'loss' }\n"
    "layer { name: 'acc' type: 'Accuracy' bottom: 'z' bottom: 'lf' top: 'acc' }\n")


@pytest.mark.parametrize("fuse", ["0", "1"])
@pytest.mark.parametrize("sel", [[0, 1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 0, 1, 0], [1] * N])
def test_conv_net_after_filter_matches_the_net_on_the_kept_items(rng, sel, fuse, monkeypatch):
    """Convolution, BatchNorm (batch statistics over the kept items), Scale, ReLU, max pooling, InnerProduct,
    loss and accuracy after a Filter: the loss, every gradient and the running statistics equal those of the
    same layers fed the kept items as their whole batch (which fusion may join: the same numbers)."""
    monkeypatch.setenv("SUPERNEURONS_FUSE", fuse)
    shape = (N, 2, 4, 4)
    net = _net("force_backward: true\n" + _inputs(shape, (N,), (N,))
               + "layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel' top: 'xf' top: 'lf' }\n"
               + CONV_TAIL)
    sel = np.array(sel, np.float32)
    keep = sel != 0
    n = int(keep.sum())
    ref = _net("force_backward: true\nlayer { name: 'in' type: 'Input' top: 'xf' top: 'lf' input_param { "
               f"shape {{ dim: {n} dim: 2 dim: 4 dim: 4 }} shape {{ dim: {n} }} }} }}\n" + CONV_TAIL)
    learning = [node.name for node in ref.graph.nodes if node.layer.params]
    for name in learning:
        for mine, theirs in zip(ref.layer(name).params, net.layer(name).params):
            mine.data[...] = theirs.data
    x, label = rng.standard_normal(shape).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
    _feed(net, x=x, label=label, sel=sel)
    _feed(ref, xf=x[keep], lf=label[keep])
    for each in (net, ref):
        each.clear_param_diffs()
    loss, want = net.forward_backward(), ref.forward_backward()
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(net.blob("acc"), ref.blob("acc"))
    for name in learning:
        for mine, theirs in zip(ref.layer(name).params, net.layer(name).params):
            np.testing.assert_allclose(theirs.diff, mine.diff, rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(theirs.data, mine.data, rtol=1e-6, err_msg=name)  # running statistics
    dx = np.zeros(shape, np.float32)
    dx[keep] = ref.backend.to_host(ref.diff["xf"].array)
    np.testing.assert_allclose(net.backend.to_host(net.diff["x"].array), dx, rtol=1e-5, atol=1e-6)


def test_filter_of_filtered_items(rng):
    """A second Filter on the first's tops selects among the kept items (its selector filtered alongside)."""
    text = ("force_backward: true\n" + _inputs((N, 4), (N,), (N,))
            + "layer { name: 'in2' type: 'Input' top: 'sel2' input_param { shape { dim: 7 } } }\n"
            + "layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel2' bottom: 'sel' "
              "top: 'x1' top: 'l1' top: 's1' }\n"
            + "layer { name: 'g' type: 'Filter' bottom: 'x1' bottom: 'l1' bottom: 's1' top: 'xf' top: 'lf' }\n"
            + f"layer {{ name: 'ip' type: 'InnerProduct' bottom: 'xf' top: 'z' inner_product_param {{ num_output: 3 {W} }} }}\n"
            + "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'z' bottom: 'lf' top: 'loss' }\n")
    net = _net(text)
    x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
    sel, sel2 = np.array([1, 1, 0, 1, 0, 1, 1], np.float32), np.array([0, 1, 1, 1, 0, 0, 1], np.float32)
    _feed(net, x=x, label=label, sel=sel, sel2=sel2)
    net.clear_param_diffs()
    loss = net.forward_backward()
    both = (sel != 0) & (sel2 != 0)
    assert net.blob("x1").shape == (5, 4) and net.blob("xf").shape == (3, 4)
    ip = net.layer("ip")
    want, _acc, dx, dw, _db, _z = _classifier_reference(x, label, both.astype(np.float32), ip.weight.data,
                                                         ip.bias.data)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(net.backend.to_host(net.diff["x"].array), dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ip.weight.diff, dw, rtol=1e-5, atol=1e-6)


# ---- what cannot be right is refused, naming the layer -------------------------------------------

F = "layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel' top: 'xf' top: 'lf' }\n"
IP = f"layer {{ name: 'ip' type: 'InnerProduct' bottom: 'xf' top: 'z' inner_product_param {{ num_output: 3 {W} }} }}\n"


@pytest.mark.parametrize("text,message", [
    (_inputs((N, 4), (N,), (N, 2)) + F, "layer 'f' (Filter): the selector (last bottom 'sel') must have shape N or N x 1"),
    (_inputs((6, 4), (N,), (N,)) + F, "layer 'f' (Filter): bottom 0 'x' must have the selector's 7 items along axis 0"),
    (_inputs((N, 4), (N,), (N,)) + F.replace(" top: 'lf'", ""), "layer 'f' (Filter): needs one top per filtered bottom"),
    (_inputs((N, 4), (N,), (N,)) + F.replace("top: 'xf'", "top: 'x'"), "layer 'f' (Filter): cannot work in place on 'x'"),
    # a loss reading the kept scores but every label: Caffe fails its label count check at the forward
    (_inputs((N, 4), (N,), (N,)) + F + IP
     + "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'z' bottom: 'label' top: 'loss' }\n",
     "layer 'loss' (SoftmaxWithLoss) reads blob(s) 'z' whose batch is the count Filter 'f' keeps, and it cannot be "
     "set up for 1 item(s): label blob"),
    (_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'c' type: 'Concat' bottom: 'xf' bottom: 'x' top: 'c' "
                                       "concat_param { axis: 0 } }\n",
     "layer 'c' (Concat) reads blob(s) 'xf' whose batch is the count Filter 'f' keeps, and its top 'c' (14 4) changes "
     "shape with that count other than along axis 0"),
    (_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'r' type: 'Flatten' bottom: 'xf' top: 'r' flatten_param { axis: 0 } }\n",
     "layer 'r' (Flatten) reads blob(s) 'xf' whose batch is the count Filter 'f' keeps, and its top 'r' (28) changes"),
    (_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'r' type: 'Reshape' bottom: 'xf' top: 'r' "
                                       "reshape_param { shape { dim: 7 dim: -1 } } }\n",
     "layer 'r' (Reshape) reads blob(s) 'xf' whose batch is the count Filter 'f' keeps, and it cannot be set up for "
     "1 item(s): cannot infer the -1 dimension"),
    (_inputs((N, 4), (N,), (N,)) + F + IP.replace("num_output: 3", "num_output: 3 axis: 0"),
     "layer 'ip' (InnerProduct) reads blob(s) 'xf' whose batch is the count Filter 'f' keeps, and it cannot be set up "
     "for 1 item(s): its parameter 0 would change shape with the batch ((3, 4) against (3, 28))"),
    (_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'g' type: 'Filter' bottom: 'x' bottom: 'label' top: 'xg' }\n"
     "layer { name: 'e' type: 'Eltwise' bottom: 'xf' bottom: 'xg' top: 'e' }\n",
     "layer 'e' (Eltwise) reads the items kept by Filter layers 'f' and 'g', whose counts differ from batch to batch"),
    (_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'g' type: 'Filter' bottom: 'xf' bottom: 'sel' top: 'xg' }\n",
     "layer 'g' (Filter) reads both items kept by Filter 'f' and blobs of the full batch"),
])
def test_refusals_name_the_layer(text, message):
    with pytest.raises(UserError) as e:
        _net(text)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_python_layer_after_a_filter_is_refused(tmp_path, monkeypatch):
    (tmp_path / "copy_layer_for_filter.py").write_text(
        "class Copy:\n"
        "    def setup(self, bottom, top): pass\n"
        "    def reshape(self, bottom, top): top[0].reshape(*bottom[0].data.shape)\n"
        "    def forward(self, bottom, top): top[0].data[...] = bottom[0].data\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"layer 'py' \(Python\) reads blob\(s\) 'xf' whose batch is the count Filter "
                                        r"'f' keeps; a Python layer cannot be set up again for each count"):
        _net(_inputs((N, 4), (N,), (N,)) + F + "layer { name: 'py' type: 'Python' bottom: 'xf' top: 'q' "
                                               "python_param { module: 'copy_layer_for_filter' layer: 'Copy' } }\n")


def test_layers_after_a_filter_run_unfused_and_the_others_fused(rng, monkeypatch):
    """Fusion leaves the layers after a Filter apart (each runs set up for the count) and fuses the rest."""
    text = ("force_backward: true\n" + _inputs((N, 2, 4, 4), (N,), (N,))
            + f"layer {{ name: 'c0' type: 'Convolution' bottom: 'x' top: 'x0' convolution_param {{ num_output: 2 "
              f"kernel_size: 3 pad: 1 {W} }} }}\n"
            + "layer { name: 'r0' type: 'ReLU' bottom: 'x0' top: 'x0' }\n"
            + F.replace("bottom: 'x' ", "bottom: 'x0' ")
            + f"layer {{ name: 'c' type: 'Convolution' bottom: 'xf' top: 'c' convolution_param {{ num_output: 2 "
              f"kernel_size: 3 {W} }} }}\n"
            + "layer { name: 'r' type: 'ReLU' bottom: 'c' top: 'c' }\n"
            + "layer { name: 'loss' type: 'EuclideanLoss' bottom: 'c' bottom: 'c' top: 'loss' }\n")
    net = _net(text, fuse=True, monkeypatch=monkeypatch)
    fused = {n.name for n in net.graph.nodes if net.graph.step_layer(n) is not n.layer}
    assert fused == {"c0", "r0"}
    _feed(net, x=rng.standard_normal((N, 2, 4, 4)), sel=np.array([0, 1, 0, 0, 1, 1, 0]))
    net.forward_backward()
    assert net.blob("c").shape == (3, 2, 2, 2)


def test_layers_that_keep_their_own_shapes_after_a_filter(rng):
    """A Reshape that copies the batch axis (dim: 0) and a BatchReindex whose indices are the kept labels follow
    the count: what Caffe's Reshape at each forward gives."""
    text = (_inputs((N, 4), (N,), (N,)) + F
            + "layer { name: 'r' type: 'Reshape' bottom: 'xf' top: 'r' reshape_param { shape { dim: 0 dim: 2 dim: 2 } } }\n"
            + "layer { name: 'br' type: 'BatchReindex' bottom: 'x' bottom: 'lf' top: 'br' }\n")
    net = _net(text)
    x, label, sel = rng.standard_normal((N, 4)), rng.integers(0, N, N), np.array([1, 0, 0, 1, 1, 0, 0])
    _feed(net, x=x, label=label, sel=sel)
    net.forward()
    keep = sel != 0
    np.testing.assert_allclose(net.blob("r"), x[keep].reshape(3, 2, 2), rtol=1e-6)
    np.testing.assert_allclose(net.blob("br"), x[label[keep]], rtol=1e-6)


def test_a_backend_that_cannot_run_an_empty_batch_says_so(rng, monkeypatch):
    """cuDNN refuses descriptors of a batch of 0 (Caffe's cuDNN layers stop there too): such a failure is one
    line naming the layer and the Filter, not a backend traceback. The CPU ops stand in for that backend."""
    net = _net(_classifier())
    plain = net.ops.softmax_forward

    def no_empty_batch(x, y):
        if not x.size:
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM\nmore detail")
        plain(x, y)

    monkeypatch.setattr(net.ops, "softmax_forward", no_empty_batch)
    _feed(net, x=rng.standard_normal((N, 4)), label=np.zeros(N), sel=np.array([0, 1, 0, 0, 0, 0, 0]))
    net.forward_backward()  # one item: runs
    _feed(net, sel=np.zeros(N))
    with pytest.raises(UserError) as e:
        net.forward_backward()
    assert str(e.value) == ("layer 'loss' (SoftmaxWithLoss): Filter 'f' kept no item in this batch and this backend "
                            "cannot run the layer's forward on an empty batch (RuntimeError: CUDNN_STATUS_BAD_PARAM)")


# ---- the CUDA backend: the same net, the same numbers ------------------------------------------------

def _gpu_test(fn):
    for mark in GPU_ONLY:
        fn = mark(fn)
    return fn


@_gpu_test
@pytest.mark.parametrize("tail", ["classifier", "conv"])
def test_gpu_matches_cpu_as_the_selection_changes(gpu, tail):
    if tail == "classifier":
        text, shape = _classifier(), (N, 4)
    else:
        shape = (N, 2, 4, 4)
        text = ("force_backward: true\n" + _inputs(shape, (N,), (N,)) + F + CONV_TAIL)
    nets = [Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN), backend, seed=3)
            for backend in (CpuBackend(), gpu)]
    rng = np.random.default_rng(4)
    for sel in ([1, 0, 1, 1, 0, 0, 1], [1] * N, [0, 0, 0, 0, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1]):
        values = dict(x=rng.standard_normal(shape).astype(np.float32),
                      label=rng.integers(0, 3, N).astype(np.float32), sel=np.array(sel, np.float32))
        losses = []
        for net in nets:
            for name, v in values.items():
                net.backend.from_host(net.data[name].array, v)
            net.clear_param_diffs()
            losses.append(net.forward_backward())
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4, atol=1e-6)
        n = int(np.count_nonzero(sel))
        for blob in ("z", "acc"):
            want, got = nets[0].blob(blob), nets[1].blob(blob)
            assert got.shape == want.shape and (blob == "acc" or want.shape[0] == n)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(nets[1].backend.to_host(nets[1].diff["x"].array),
                                   nets[0].backend.to_host(nets[0].diff["x"].array), rtol=1e-4, atol=1e-5)
        for mine, theirs in zip(nets[0].learnable, nets[1].learnable):
            np.testing.assert_allclose(gpu.to_host(theirs.diff), mine.diff, rtol=1e-4, atol=1e-5)


@_gpu_test
def test_gpu_on_a_selection_of_no_item(gpu):
    """Caffe's CPU result (a loss of 0, zero gradients), or where a CUDA op refuses an empty batch, one line
    naming the layer: never a backend traceback or another number."""
    net = Net(build_graph(text_format.Parse(_classifier(), pb.NetParameter()), pb.TRAIN), gpu, seed=3)
    for name, v in dict(x=np.ones((N, 4)), label=np.zeros(N), sel=np.zeros(N)).items():
        gpu.from_host(net.data[name].array, v.astype(np.float32))
    net.clear_param_diffs()
    try:
        loss = net.forward_backward()
    except UserError as e:
        assert "Filter 'f' kept no item in this batch and this backend cannot run" in str(e)
        return
    assert loss == 0.0 and net.blob("z").shape == (0, 3)
    for decl in net.learnable:
        np.testing.assert_array_equal(gpu.to_host(decl.diff), 0.0)


@pytest.mark.parametrize("precision,tol", [("fp16", 2e-3), ("bf16", 1e-2)])
def test_half_precision_net_after_filter(rng, precision, tol):
    """Half storage: the Filter gathers half items (labels stay float32) and the loss is the float64 reference's
    on the same rounded values, within the storage type's rounding."""
    from superneurons.graph.precision import override_defaults

    text = override_defaults(text_format.Parse(_classifier(), pb.NetParameter()), precision)
    net = Net(build_graph(text, pb.TRAIN), CpuBackend(), seed=3)
    assert net.data["xf"].dtype == net.data["x"].dtype != np.float32 and net.data["lf"].dtype == np.float32
    x, label = rng.standard_normal((N, 4)), rng.integers(0, 3, N).astype(np.float32)
    sel = np.array([1, 0, 1, 1, 0, 0, 1], np.float32)
    _feed(net, x=x, label=label, sel=sel)
    loss = net.forward_backward()
    ip = net.layer("ip")
    stored = net.data["x"].array.astype(np.float64)
    np.testing.assert_array_equal(net.blob("xf").astype(np.float64), stored[sel != 0])
    want = _classifier_reference(stored, label, sel, ip.weight.data.astype(np.float64),
                                 ip.bias.data.astype(np.float64))[0]
    np.testing.assert_allclose(loss, want, rtol=tol)


DUMMY_NET = """name: 'filtered'
layer { name: 'd' type: 'DummyData' top: 'x' top: 'label' top: 'raw' dummy_data_param {
  shape { dim: 8 dim: 5 } shape { dim: 8 } shape { dim: 8 }
  data_filler { type: 'gaussian' } data_filler { type: 'constant' value: 1 } data_filler { type: 'uniform' min: -1 max: 1 } } }
layer { name: 'r' type: 'ReLU' bottom: 'raw' top: 'sel' }
layer { name: 'f' type: 'Filter' bottom: 'x' bottom: 'label' bottom: 'sel' top: 'xf' top: 'lf' }
layer { name: 'ip' type: 'InnerProduct' bottom: 'xf' top: 'z' inner_product_param { num_output: 3 weight_filler { type: 'xavier' } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'z' bottom: 'lf' top: 'loss' }
"""


@pytest.mark.parametrize("memory", ["baseline", "recompute"])
def test_cli_time_and_train_run_a_filter_net(tmp_path, capsys, memory):
    """`time` wraps each layer in a timer, and `train` runs the solver: both go through the layers' copies."""
    from superneurons.cli import main

    (tmp_path / "net.prototxt").write_text(DUMMY_NET)
    assert main(["time", "--model", str(tmp_path / "net.prototxt"), "--iterations", "3", "--memory", memory]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["f"], ["ip"], ["loss"])}
    assert rows["ip"][1] == "InnerProduct" and float(rows["ip"][3]) > 0  # timed forward and backward
    (tmp_path / "solver.prototxt").write_text(
        f"net: '{tmp_path / 'net.prototxt'}'\nbase_lr: 0.5\nmax_iter: 30\nlr_policy: 'fixed'\ndisplay: 0\n"
        f"snapshot_prefix: '{tmp_path / 'snap'}'\nsolver_mode: CPU\nmemory_param {{ mode: {memory.upper()} }}\n")
    assert main(["train", "--solver", str(tmp_path / "solver.prototxt")]) == 0
    assert (tmp_path / "snap_iter_30.caffemodel").exists()


@pytest.mark.parametrize("copies", [False, True])
def test_pycaffe_blobs_hold_the_kept_items(tmp_path, rng, monkeypatch, copies):
    """pycaffe's `net.blobs` after a Filter have the count it kept along axis 0, as Caffe's reshape gives them,
    and follow it when the next forward keeps another count; also through host copies (the GPU's way)."""
    import superneurons as caffe
    from superneurons.pycaffe import net as pycaffe_net

    monkeypatch.setattr(pycaffe_net, "FORCE_HOST_COPIES", copies)

    caffe.set_mode_cpu()
    path = tmp_path / "net.prototxt"
    path.write_text(_classifier())
    net = caffe.Net(str(path), caffe.TRAIN)
    ip = net.params["ip"]
    for sel in ([1, 0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0], [1] * N):
        sel = np.array(sel, np.float32)
        x, label = rng.standard_normal((N, 4)).astype(np.float32), rng.integers(0, 3, N).astype(np.float32)
        out = net.forward(x=x, label=label, sel=sel)
        net.backward()
        loss, _acc, dx, dw, _db, z = _classifier_reference(x, label, sel, ip[0].data, ip[1].data)
        n = int(np.count_nonzero(sel))
        assert net.blobs["z"].data.shape == net.blobs["z"].shape == (n, 3) and net.blobs["lf"].shape == (n,)
        np.testing.assert_allclose(net.blobs["z"].data, z, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["loss"], loss, rtol=1e-5)
        assert net.blobs["z"].diff.shape == (n, 3) and net.blobs["x"].data.shape == (N, 4)
        np.testing.assert_allclose(net.blobs["x"].diff, dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ip[0].diff, dw, rtol=1e-5, atol=1e-6)
        ip[0].diff[...] = 0
        ip[1].diff[...] = 0


class _BackwardScratch(Layer):
    """Keeps a buffer that only its backward step uses, as Layer.add_buffer lets a layer declare."""

    def setup(self, bottom_shapes):
        self.add_buffer("scratch", (bottom_shapes[0][0], 2), for_backward=True, in_forward=False)
        return [tuple(bottom_shapes[0])]


def test_batch_variant_takes_every_buffer_option_of_add_buffer():
    """A layer after a Filter is set up again for each batch's count: its setup may declare its buffers with
    any option Layer.add_buffer takes, and the count's declarations keep them."""
    param = text_format.Parse("name: 'scratch' type: 'Scratch' bottom: 'z' top: 'w'", pb.LayerParameter())
    layer = _BackwardScratch(param, pb.TRAIN)
    layer.setup([(N, 3)])
    variant = batch_variant(layer, [(3, 3)])
    assert variant.top_shapes == [(3, 3)]
    decl = variant.state["buffers"]["scratch"]
    assert (decl.shape, decl.for_backward, decl.in_forward) == ((3, 2), True, False)
    assert variant.buffers == {"scratch": layer.buffers["scratch"]}
