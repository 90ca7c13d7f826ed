"""`import superneurons as caffe`: Net, Blob and the solvers' mechanics against NumPy float64 references.

Small nets written in the test (Input -> InnerProduct -> ReLU -> InnerProduct -> EuclideanLoss) on fresh
random inputs; each forward, backward and update is recomputed with NumPy and compared.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import superneurons as caffe
from superneurons.errors import UserError
from superneurons.pycaffe import net as pycaffe_net

ROOT = Path(__file__).resolve().parents[1]

MLP = """
name: "mlp"
force_backward: true  # the input gets a gradient too (Caffe computes none for it otherwise)
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 6 } shape { dim: 4 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""


@pytest.fixture
def mlp_file(tmp_path):
    path = tmp_path / "mlp.prototxt"
    path.write_text(MLP)
    return str(path)


def reference(net, x, t):
    """float64 forward and backward of MLP from the net's own weights: (ip1, ip2, loss, grads)."""
    w1, b1 = (p.data.astype(np.float64) for p in net.params["ip1"])
    w2, b2 = (p.data.astype(np.float64) for p in net.params["ip2"])
    h = np.maximum(x @ w1.T + b1, 0)
    y = h @ w2.T + b2
    n = x.shape[0]
    loss = ((y - t) ** 2).sum() / (2 * n)
    dy = (y - t) / n
    dh = (dy @ w2) * (h > 0)
    grads = {"ip2": (dy.T @ h, dy.sum(0)), "ip1": (dh.T @ x, dh.sum(0)), "data": dh @ w1}
    return h, y, loss, grads


def test_forward_backward_match_numpy(mlp_file, rng):
    caffe.set_mode_cpu()
    net = caffe.Net(mlp_file, caffe.TRAIN)
    assert net.inputs == ["data", "target"] and net.outputs == ["loss"]
    assert net._layer_names == ["data", "ip1", "relu1", "ip2", "loss"]
    assert list(net.blobs) == ["data", "target", "ip1", "ip2", "loss"]
    assert [b.shape for b in net.params["ip1"]] == [(5, 6), (5,)] and list(net.params) == ["ip1", "ip2"]
    assert net.top_names["relu1"] == ["ip1"] and net.bottom_names["loss"] == ["ip2", "target"]
    assert [layer.type for layer in net.layers] == ["Input", "InnerProduct", "ReLU", "InnerProduct",
                                                     "EuclideanLoss"]
    assert net.layer_dict["ip2"].blobs[0] is net.params["ip2"][0]
    assert net.blob_loss_weights["loss"] == 1.0 and net.blob_loss_weights["ip2"] == 0.0

    x, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    out = net.forward(data=x, target=t)
    h, y, loss, grads = reference(net, x, t)
    assert set(out) == {"loss"}
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(net.blobs["ip1"].data, h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.blobs["ip2"].data, y, rtol=1e-5, atol=1e-6)

    diffs = net.backward()
    assert set(diffs) == {"data", "target"}
    for layer in ("ip1", "ip2"):
        for k in range(2):
            np.testing.assert_allclose(net.params[layer][k].diff, grads[layer][k], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(diffs["data"], grads["data"], rtol=1e-4, atol=1e-6)
    # Parameter gradients add up over backward passes, as in Caffe; bottom gradients are overwritten.
    net.backward()
    np.testing.assert_allclose(net.params["ip2"][0].diff, 2 * grads["ip2"][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.blobs["data"].diff, grads["data"], rtol=1e-4, atol=1e-6)


def test_blob_arrays_are_writable_views_and_params_feed_the_net(mlp_file, rng):
    net = caffe.Net(mlp_file, caffe.TEST)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    net.blobs["data"].data[...] = x  # the classic pycaffe way of feeding a net
    net.params["ip1"][0].data[...] = 0.0  # net surgery: ReLU(0 + b1) feeds ip2
    net.params["ip1"][1].data[...] = np.arange(5, dtype=np.float32) - 2
    net.forward()
    h = np.maximum(np.arange(5.0) - 2, 0)
    w2, b2 = net.params["ip2"][0].data, net.params["ip2"][1].data
    np.testing.assert_allclose(net.blobs["ip2"].data, np.tile(h @ w2.T + b2, (4, 1)), rtol=1e-6)
    assert net.blobs["data"].data.shape == (4, 6) and net.blobs["data"].count == 24
    assert (net.blobs["data"].num, net.blobs["data"].channels, net.blobs["data"].height) == (4, 6, 1)
    # A TEST net keeps no gradients: its diffs read as zeros, as an unused Caffe diff.
    assert not net.blobs["ip2"].diff.any()


@pytest.mark.parametrize("copies", [False, True], ids=["cpu-views", "host-copies"])
def test_host_copies_stay_in_step_with_the_net(mlp_file, rng, monkeypatch, copies):
    """On the GPU blobs are host copies pushed before and pulled after each call; the CPU can run that path."""
    monkeypatch.setattr(pycaffe_net, "FORCE_HOST_COPIES", copies)
    net = caffe.Net(mlp_file, caffe.TRAIN)
    data, w2 = net.blobs["data"].data, net.params["ip2"][0].data
    assert np.shares_memory(data, net.runtime.data["data"].array) != copies
    x, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    data[...] = x
    net.blobs["target"].data[...] = t
    w2 *= 2  # kept across calls: the same array object, written back before the next forward
    net.forward()
    _, y, _, grads = reference(net, x, t)
    np.testing.assert_allclose(net.blobs["ip2"].data, y, rtol=1e-5, atol=1e-6)
    net.backward()
    np.testing.assert_allclose(net.params["ip2"][0].diff, grads["ip2"][0], rtol=1e-4, atol=1e-6)
    assert net.params["ip2"][0].data is w2


def test_forward_and_backward_over_layer_ranges(mlp_file, rng):
    net = caffe.Net(mlp_file, caffe.TRAIN)
    x, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    out = net.forward(data=x, target=t, end="relu1")
    assert set(out) == {"relu1"} or set(out) == {"ip1"}
    h, _y, _loss, _ = reference(net, x, t)
    np.testing.assert_allclose(out.popitem()[1], h, rtol=1e-5, atol=1e-6)
    assert not net.blobs["ip2"].data.any()  # layers after `end` did not run

    # Edit ip1's output and run from ip2 on: the rest of the net sees the edit.
    edited = np.abs(rng.standard_normal((4, 5))).astype(np.float32)
    net.blobs["ip1"].data[...] = edited
    out = net.forward(start="ip2", blobs=["ip2"])
    w2, b2 = (p.data.astype(np.float64) for p in net.params["ip2"])
    np.testing.assert_allclose(out["ip2"], edited @ w2.T + b2, rtol=1e-5, atol=1e-6)

    # backward from given output gradients, down to ip2 only: ip1's gradients are untouched.
    top = rng.standard_normal(()).astype(np.float32) + 3
    diffs = net.backward(loss=np.full((), top), end="ip2", diffs=["ip2"])
    y = edited @ w2.T + b2
    np.testing.assert_allclose(diffs["ip2"], top * (y - t) / 4, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.params["ip2"][0].diff, (top * (y - t) / 4).T @ edited, rtol=1e-4, atol=1e-5)
    assert not net.params["ip1"][0].diff.any()
    with pytest.raises(UserError, match="no layer of that name"):
        net.forward(start="nope")
    with pytest.raises(UserError, match="inputs"):
        net.forward(data=x)


def test_reshape_input_keeps_weights_and_forward_all_batches(mlp_file, rng):
    net = caffe.Net(mlp_file, caffe.TEST)
    weights = [p.data.copy() for p in net.params["ip2"]]
    net.blobs["data"].reshape(7, 6)
    net.blobs["target"].reshape(7, 3)
    net.reshape()
    assert net.blobs["data"].shape == (7, 6) and net.blobs["ip2"].shape == (7, 3)
    for p, w in zip(net.params["ip2"], weights):
        np.testing.assert_array_equal(p.data, w)
    with pytest.raises(UserError, match="only"):
        net.blobs["ip1"].reshape(2, 5)

    net.blobs["data"].reshape(2, 6)
    net.blobs["target"].reshape(2, 3)
    x, t = rng.standard_normal((5, 6)), rng.standard_normal((5, 3))
    out = net.forward_all(blobs=["ip2"], data=x, target=t)  # batches of 2, the last padded and trimmed
    _, y, _, _ = reference(net, x, t)
    assert out["ip2"].shape == (5, 3)
    np.testing.assert_allclose(out["ip2"], y, rtol=1e-5, atol=1e-6)


def test_save_copy_from_and_share_with(mlp_file, tmp_path, rng):
    a = caffe.Net(mlp_file, caffe.TEST)
    for blobs in a.params.values():
        for p in blobs:
            p.data[...] = rng.standard_normal(p.shape)
    a.save(str(tmp_path / "a.caffemodel"))
    caffe.set_random_seed(7)  # b starts from other random weights
    try:
        b = caffe.Net(mlp_file, caffe.TEST)
        c = caffe.Net(mlp_file, str(tmp_path / "a.caffemodel"), caffe.TEST)
        d = caffe.Net(mlp_file, caffe.TEST, weights=str(tmp_path / "a.caffemodel"))
    finally:
        caffe.set_random_seed(0)
    assert not np.array_equal(b.params["ip1"][0].data, a.params["ip1"][0].data)
    b.copy_from(str(tmp_path / "a.caffemodel"))
    for net in (b, c, d):
        for name in ("ip1", "ip2"):
            for p, q in zip(net.params[name], a.params[name]):
                np.testing.assert_array_equal(p.data, q.data)

    b.share_with(a)
    a.params["ip2"][1].data[...] = 42.0
    np.testing.assert_array_equal(b.params["ip2"][1].data, np.full(3, 42.0, np.float32))


def test_memory_data_through_set_input_arrays(tmp_path, rng):
    model = tmp_path / "mem.prototxt"
    model.write_text("""
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
""")
    net = caffe.Net(str(model), caffe.TRAIN)
    data = rng.standard_normal((6, 1, 2, 3)).astype(np.float32)
    labels = np.array([0, 1, 1, 0, 1, 1], dtype=np.float32)
    net.set_input_arrays(data, labels)
    for batch in (0, 1, 2, 0):  # three batches, then around again
        loss = float(net.forward()["loss"])
        np.testing.assert_array_equal(net.blobs["data"].data, data[2 * batch:2 * batch + 2])
        np.testing.assert_array_equal(net.blobs["label"].data, labels[2 * batch:2 * batch + 2])
        w, b = (p.data.astype(np.float64) for p in net.params["ip"])
        z = data[2 * batch:2 * batch + 2].reshape(2, -1) @ w.T + b
        logp = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
        expected = -logp[np.arange(2), labels[2 * batch:2 * batch + 2].astype(int)].mean()
        assert abs(loss - expected) < 1e-5
    with pytest.raises(UserError, match="multiple of batch_size"):
        net.set_input_arrays(data[:3], labels[:3])


@pytest.mark.parametrize("copies", [False, True], ids=["cpu-views", "host-copies"])
def test_solver_step_is_sgd_with_momentum_and_weight_decay(mlp_file, tmp_path, rng, monkeypatch, copies):
    """Two iterations through caffe.SGDSolver against the update computed in NumPy (also through the host
    copies the GPU uses, with a stale copy of the same weights held through the test net)."""
    monkeypatch.setattr(pycaffe_net, "FORCE_HOST_COPIES", copies)
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{mlp_file}"\ntest_iter: 1\ntest_interval: 100\nbase_lr: 0.1\nmomentum: 0.9\n'
                           'weight_decay: 0.01\nlr_policy: "fixed"\nmax_iter: 2\nrandom_seed: 3\ntype: "Adam"\n'
                           f'snapshot_prefix: "{tmp_path}/mlp"\n')
    solver = caffe.SGDSolver(str(solver_file))  # the class wins over the prototxt's type, as in pycaffe
    net = solver.net
    assert solver.iter == 0 and len(solver.test_nets) == 1
    seen_by_test_net = solver.test_nets[0].params["ip2"][1].data
    net.params["ip2"][1].data[...] = 0.5  # an edit through the train net wins over the test net's old copy
    x, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    net.blobs["data"].data[...] = x
    net.blobs["target"].data[...] = t
    history = {name: [np.zeros(p.shape) for p in net.params[name]] for name in net.params}
    for _ in range(2):
        before = {name: [p.data.astype(np.float64) for p in net.params[name]] for name in net.params}
        _, _, loss, grads = reference(net, x, t)
        solver.step(1)
        assert abs(float(net.blobs["loss"].data) - loss) < 1e-5
        for name in ("ip1", "ip2"):
            for k in range(2):
                v = history[name][k] = 0.9 * history[name][k] + 0.1 * (grads[name][k] + 0.01 * before[name][k])
                np.testing.assert_allclose(net.params[name][k].data, before[name][k] - v, rtol=1e-4, atol=1e-6)
    assert solver.iter == 2
    np.testing.assert_array_equal(seen_by_test_net, net.params["ip2"][1].data)  # the test net reads the same
    solver.snapshot()
    assert (tmp_path / "mlp_iter_2.caffemodel").exists() and (tmp_path / "mlp_iter_2.solverstate").exists()
    assert type(caffe.get_solver(str(solver_file))) is caffe.AdamSolver  # the class of its rule, as in pycaffe
    assert caffe.get_solver(str(solver_file)).runtime.rule.name == "Adam"
    no_momentum = tmp_path / "adagrad.prototxt"
    no_momentum.write_text(solver_file.read_text().replace("momentum: 0.9", ""))
    assert caffe.AdaGradSolver(str(no_momentum)).runtime.rule.name == "AdaGrad"
    assert caffe.RMSPropSolver(str(no_momentum)).runtime.rule.name == "RMSProp"
    for cls, rule in ((caffe.NesterovSolver, "Nesterov"), (caffe.AdaDeltaSolver, "AdaDelta"),
                      (caffe.AdamSolver, "Adam"), (caffe.SGDSolver, "SGD")):
        assert cls(str(solver_file)).runtime.rule.name == rule

    # share_weights: a Net of ours reads the solver's weights as they train.
    watcher = caffe.Net(mlp_file, caffe.TEST)
    solver.share_weights(watcher)
    solver.step(1)
    np.testing.assert_array_equal(watcher.params["ip1"][0].data, net.params["ip1"][0].data)

    # solve(): to max_iter from a snapshot, then the final snapshot.
    resumed = caffe.SGDSolver(str(solver_file))
    resumed.solve(str(tmp_path / "mlp_iter_2.solverstate"))
    assert resumed.iter == 2
    snapshot = caffe.Net(mlp_file, str(tmp_path / "mlp_iter_2.caffemodel"), caffe.TEST)
    for name in ("ip1", "ip2"):
        for a, b in zip(resumed.net.params[name], snapshot.params[name]):
            np.testing.assert_array_equal(a.data, b.data)


def test_memory_options_and_plan(mlp_file):
    net = caffe.Net(mlp_file, caffe.TRAIN, memory="liveness", gpu_memory="1M")
    assert net.memory_mode == "liveness" and "1.0 MiB" in net.memory_summary()
    plan = net.memory_plan()
    assert set(plan["modes"]) == {"baseline", "liveness", "offload", "recompute"}
    assert plan["modes"]["liveness"]["peak_bytes"] <= plan["modes"]["baseline"]["peak_bytes"]
    assert [s["layer"] for s in plan["steps"]][:2] == ["data", "ip1"]
    net.forward(data=np.ones((4, 6)), target=np.zeros((4, 3)))
    net.backward()
    assert net.blobs["loss"].data.shape == ()  # losses stay readable
    with pytest.raises(UserError, match="memory mode 'liveness'"):
        net.blobs["ip1"].data  # freed after its last use, in backward
    with pytest.raises(UserError, match="resident"):
        net.forward(end="ip1")


def test_bad_arguments_are_user_errors(mlp_file):
    with pytest.raises(UserError, match="phase"):
        caffe.Net(mlp_file, 7)
    with pytest.raises(UserError, match="no such file"):
        caffe.Net(mlp_file + ".missing", caffe.TEST)
    net = caffe.Net(mlp_file, caffe.TEST)
    with pytest.raises(UserError, match="MemoryData"):
        net.set_input_arrays(np.zeros((1, 1, 1, 1)), np.zeros(1))


def test_import_stays_cheap_and_pycaffe_names_resolve():
    code = ("import sys, superneurons as caffe\n"
            "assert 'numpy' not in sys.modules and 'superneurons.pycaffe' not in sys.modules, sorted(sys.modules)\n"
            "from superneurons.io.prototxt import read_net\n"  # the io package loaded first: still caffe.io
            "from superneurons import layers as L, params as P\n"
            "assert callable(caffe.io.Transformer) and callable(caffe.io.load_image)\n"
            "assert L.Convolution and P.Pooling.MAX == 0 and caffe.TEST == 1 and caffe.TRAIN == 0\n"
            "from superneurons.proto import caffe_pb2\n"
            "assert caffe_pb2.Datum and caffe.Classifier and caffe.draw.draw_net\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_backward_on_a_net_without_gradients_says_why(tmp_path):
    model = tmp_path / "plain.prototxt"
    model.write_text(MLP.replace("force_backward: true", ""))
    net = caffe.Net(str(model), caffe.TEST)
    with pytest.raises(UserError, match="force_backward"):
        net.backward()


def test_forced_backward_of_a_deploy_net_gives_input_gradients(tmp_path, rng):
    """Saliency: a TEST net without a loss, force_backward, gradients of a chosen output w.r.t. the input."""
    model = tmp_path / "deploy.prototxt"
    model.write_text(MLP[:MLP.index('layer { name: "loss"')]
                     .replace(' top: "target"', "").replace(" shape { dim: 4 dim: 3 }", ""))
    net = caffe.Net(str(model), caffe.TEST)
    assert net.inputs == ["data"] and net.outputs == ["ip2"]
    x, g = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
    net.forward(data=x)
    diffs = net.backward(ip2=g)
    w1, b1 = (p.data.astype(np.float64) for p in net.params["ip1"])
    w2 = net.params["ip2"][0].data.astype(np.float64)
    h = np.maximum(x @ w1.T + b1, 0)
    np.testing.assert_allclose(diffs["data"], ((g @ w2) * (h > 0)) @ w1, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(net.params["ip2"][0].diff, g.T @ h, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_blobs_are_host_copies_kept_in_step(mlp_file, tmp_path, rng):
    """On the GPU: feed through blob arrays, forward/backward against NumPy, a solver step, CPU weights."""
    caffe.set_mode_gpu()
    caffe.set_device(0)
    try:
        net = caffe.Net(mlp_file, caffe.TRAIN)
        x, t = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
        net.blobs["data"].data[...] = x
        net.blobs["target"].data[...] = t
        net.params["ip1"][1].data[...] += 0.25  # a write into a parameter reaches the device
        loss = float(net.forward()["loss"])
        h, y, ref_loss, grads = reference(net, x, t)
        assert abs(loss - ref_loss) <= 1e-3 * max(1.0, abs(ref_loss))
        np.testing.assert_allclose(net.blobs["ip2"].data, y, rtol=1e-3, atol=1e-3)
        net.backward()
        np.testing.assert_allclose(net.params["ip1"][0].diff, grads["ip1"][0], rtol=1e-3, atol=1e-3)
        net.save(str(tmp_path / "gpu.caffemodel"))
        caffe.set_mode_cpu()
        cpu = caffe.Net(mlp_file, str(tmp_path / "gpu.caffemodel"), caffe.TRAIN)
        np.testing.assert_array_equal(cpu.params["ip1"][1].data, net.params["ip1"][1].data)
    finally:
        caffe.set_mode_cpu()


def test_own_nets_run_eagerly_and_a_solvers_training_net_may_replay(mlp_file, tmp_path, monkeypatch):
    """pycaffe's own Net calls forward and backward apart, so it tells the runtime Net its passes are eager
    (SUPERNEURONS_LAYOUT=auto weighs whether passes replay as CUDA graphs); a solver's training net does not."""
    from superneurons.runtime import net as runtime_net

    told = []
    init = runtime_net.Net.__init__

    def spy(self, graph, backend, **kwargs):
        told.append((graph.phase, kwargs.get("eager", False)))
        init(self, graph, backend, **kwargs)

    monkeypatch.setattr(runtime_net.Net, "__init__", spy)
    caffe.Net(mlp_file, caffe.TRAIN)
    assert told == [(caffe.TRAIN, True)]
    told.clear()
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{mlp_file}"\nbase_lr: 0.1\nmax_iter: 1\n')
    caffe.SGDSolver(str(solver_file))
    assert told == [(caffe.TRAIN, False)]
